"""Incremental steps with caches == a full recompute of the committed sequences without caches.

The scripted workload mixes prefill chunks, plain decode and verify steps with rejected drafts (whose
garbage inputs the next step overwrites) over several requests in random block tables. On CPU the two
paths round identically (every fp32 difference is absorbed by the single bf16 rounding of each stage), so
the comparison is bitwise; on a GPU the kernels differ (cuBLAS, SDPA, Triton), so it uses the
``model_vs_recompute`` tolerance.
"""

import pytest
import torch

from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
from stepops.models.reference import model_reference
from stepops.models.runner import StepRunner, Workload, run_workload
from stepops.testing import TOLERANCES

_WORKLOAD = Workload(prompt_lens=(19, 9, 30), decode_lens=(12, 16, 7), num_speculative_tokens=3, token_budget=16)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _assert_matches_recompute(model, result):
    tol = TOLERANCES["model_vs_recompute"]
    for request, (x, y) in enumerate(zip(result.inputs, result.outputs)):
        assert not y.isnan().any(), f"request {request}: a committed position has no output"
        want = model_reference(model, x.to(_device())).cpu()
        if _device().type == "cpu":
            assert torch.equal(y, want), f"request {request}: max err {(y.float() - want.float()).abs().max()}"
        else:
            torch.testing.assert_close(y, want, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize(
    "model_cls, config",
    [
        (Step5Model, Step5Config()),
        (Step5Model, Step5Config(layer_types=("csa",), index_top_k=1, num_speculative_tokens=2)),
        (InklingModel, InklingConfig()),
        (InklingModel, InklingConfig(layer_types=("global",), block_size=32)),
    ],
    ids=["step5", "step5_csa_top1_k2", "inkling", "inkling_global_enlarged_blocks"],
)
def test_incremental_matches_full_recompute(model_cls, config):
    with torch.device(_device()):
        model = model_cls(config)
    workload = Workload(**{**_WORKLOAD.__dict__, "num_speculative_tokens": getattr(config, "num_speculative_tokens", 3)})
    runner = StepRunner(
        model, max_requests=4, max_model_len=workload.max_len, max_tokens=workload.token_budget, device=_device()
    )
    result = run_workload(runner, workload, config.hidden_size)
    assert result.verify_turns > 0 and result.rejected_tokens > 0  # the workload exercises rollback
    _assert_matches_recompute(model, result)


def test_a_stale_summary_is_caught():
    """The comparison can fail: zeroing the CSA summaries after each step changes later selections."""
    with torch.device(_device()):
        model = Step5Model(Step5Config(layer_types=("csa",)))
    runner = StepRunner(model, max_requests=4, max_model_len=_WORKLOAD.max_len, max_tokens=16, device=_device())
    step = runner.step

    def step_then_forget(batch):
        out = step(batch)
        model.layers[0].summary_cache.zero_()
        return out

    runner.step = step_then_forget
    result = run_workload(runner, _WORKLOAD, model.config.hidden_size)
    errors = [(y.float() - model_reference(model, x.to(_device())).cpu().float()).abs().max()
              for x, y in zip(result.inputs, result.outputs)]
    assert max(errors) > 0.1
