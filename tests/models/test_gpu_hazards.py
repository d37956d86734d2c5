"""Behaviour a GPU run would show and a CPU run hides, pinned where a CPU test can pin it.

- ``round_to_e4m3`` saturates at +-448: torch 2.11's eager cast (the GPU machines' torch) gives NaN from
  464 up where torch 2.12+ and Inductor's Triton code saturate (on torch 2.13 this passes with or without
  the clamp; it is the statement of the contract, and fails on 2.11 without it).
- A runner on a GPU that is not the current one runs its steps (and captures) inside
  ``torch.cuda.device(runner.device)``: Triton launches on the current GPU, not on its tensors' one.
  Run with fake CUDA tensors on a CPU-only wheel, ``torch.cuda.device`` replaced by a recorder.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
from stepops.models.runner import StepRunner
from stepops.models.step5 import round_to_e4m3
from stepops.testing.fake_cuda import getitem_through_the_dispatcher


def test_round_to_e4m3_saturates_past_the_largest_code():
    x = torch.tensor([1000.0, -1e4, 464.0, 465.0, -465.0, float("inf"), 448.0, 1.0])
    want = torch.tensor([448.0, -448.0, 448.0, 448.0, -448.0, 448.0, 448.0, 1.0])
    assert torch.equal(round_to_e4m3(x), want)
    assert torch.equal(round_to_e4m3(x.to(torch.bfloat16)), want)


@pytest.mark.parametrize("model_cls, config", [(Step5Model, Step5Config()), (InklingModel, InklingConfig())])
def test_a_runner_on_another_gpu_steps_inside_its_device(monkeypatch, model_cls, config):
    """Also the eager CUDA path (test_compile traces the compiled one) with fake tensors: no host read of a
    device tensor (a fake one has no data) and no CPU tensor meeting a CUDA one."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    if torch.cuda.is_available():
        pytest.skip("traces fake CUDA tensors on a CPU-only wheel")
    monkeypatch.setattr(FakeTensor, "__getitem__", getitem_through_the_dispatcher)
    current: list[torch.device] = []
    forwards: list[list[torch.device]] = []

    @contextlib.contextmanager
    def device(d):
        current.append(torch.device(d))
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    model = model_cls(config)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda:1")
        runner = StepRunner(model, max_requests=2, max_model_len=32, max_tokens=4, device="cuda:1")
        # A host -> fake-CUDA copy has no kernel on this wheel: the buffers keep their padding-only values.
        monkeypatch.setattr(runner, "_fill_buffers", lambda batch: 0)
        forward = runner._forward

        def recording_forward(*args):
            forwards.append(list(current))
            return forward(*args)

        runner._forward = recording_forward
        runner.warm_up()
        runner.step([])
    assert forwards == [[torch.device("cuda:1")]] * (len(runner.capture_sizes) + 1)
