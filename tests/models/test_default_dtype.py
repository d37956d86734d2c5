"""The models do not follow torch's default dtype: their fp32 state (Inkling's conv weights, router scale
and bias; the attention's online-softmax state) is fp32 by construction. Built and run under
``torch.set_default_dtype(torch.float64)`` with the same weights, a model makes no float64 tensor and gives
the bits it gives under float32."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stepops.models import InklingModel, Step5Model
from stepops.models.runner import ScheduledRequest, StepRunner


class _RecordFloat64(TorchDispatchMode):
    """Names every aten op that returns a float64 tensor with elements (an unbound cache owner's
    placeholder, ``torch.tensor([])``, is empty and replaced when the allocator binds the caches)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(r, torch.Tensor) and r.dtype == torch.float64 and r.numel() for r in results):
            self.ops.add(str(func.overloadpacket))
        return out


def _steps(model) -> list[torch.Tensor]:
    """A prefill of two requests, then a verify step and a decode step: every attention and cache path."""
    runner = StepRunner(model, max_requests=2, max_model_len=40, max_tokens=16, device="cpu", seed=0)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(24, hidden, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    schedule = [
        [ScheduledRequest(0, 0, inputs[:11]), ScheduledRequest(1, 0, inputs[11:16])],
        [ScheduledRequest(0, 11, inputs[16:20]), ScheduledRequest(1, 5, inputs[20:21])],
        [ScheduledRequest(0, 15, inputs[21:22]), ScheduledRequest(1, 6, inputs[22:23])],
    ]
    with torch.inference_mode():
        return [logits for batch in schedule for logits in runner.step(batch)]


@pytest.mark.parametrize("model_cls", [Step5Model, InklingModel], ids=["step5", "inkling"])
def test_float64_default_dtype_changes_no_bit(model_cls):
    torch.manual_seed(0)
    model = model_cls()
    want = _steps(model)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _RecordFloat64() as record:
            other = model_cls()
            other.load_state_dict(model.state_dict())
            got = _steps(other)
    finally:
        torch.set_default_dtype(previous)
    assert not record.ops, f"float64 tensors made by {sorted(record.ops)}"
    assert {k: v.dtype for k, v in other.state_dict().items()} == {k: v.dtype for k, v in model.state_dict().items()}
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"output {step}"
