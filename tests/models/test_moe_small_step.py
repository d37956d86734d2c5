"""Small steps run only the chosen experts (``T * top_k < num_experts``), in both models' MoE blocks.

- The chosen-experts path equals the all-experts path on the same inputs, for T on both sides of the
  threshold and k = 1 and k = E (where only the direct call reaches it): bitwise in bf16 on CPU (both run
  each dot product through the same bf16 GEMM kernel, which accumulates in fp32 in an order that does not
  depend on the row count; seen bitwise over every case here), and in fp32 within ``FP32_BOUND``: the fp32
  GEMMs block K differently for 1 row than for T rows, a few ulps (2**-24 relative) of sums of <= 64
  terms, seen <= 2**-20.8 of the output's largest value.
- ``forward`` takes the path the threshold names (calls counted), and the step runner's decode steps of a
  model with 16 experts top-2 take it, eagerly and compiled (one graph per side of the threshold, no graph
  break, compiled == eager bitwise).

The external oracles run it too: tests/models/test_inkling_oracle.py (a 16-expert variant vs transformers)
and tests/models/test_incremental.py (a 16-expert Step5 vs the independent recompute).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
from stepops.models.inkling import SPARSE, InklingMoE
from stepops.models.moe import small_step_max_tokens
from stepops.models.runner import COMPILED, EAGER, ScheduledRequest, StepRunner, token_ranges_for
from stepops.models.step5 import Step5MoE
from stepops.testing import INDUCTOR_KEEPS_BF16_ROUNDINGS, TOLERANCES

FP32_BOUND = 2**-18
HIDDEN = 64


def _inkling_moe(num_experts: int, top_k: int, dtype: torch.dtype) -> InklingMoE:
    config = InklingConfig(n_routed_experts=num_experts, num_experts_per_tok=top_k, hidden_size=HIDDEN)
    moe = InklingMoE(config, 32, dtype)
    with torch.no_grad():  # unit-gain weights and a routing that varies from token to token
        for p in moe.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.5)
    return moe


def _step5_moe(num_experts: int, top_k: int, dtype: torch.dtype) -> Step5MoE:
    config = Step5Config(moe_num_experts=num_experts, moe_top_k=top_k)
    assert config.hidden_size == HIDDEN
    moe = Step5MoE(config, dtype, config.swiglu_limit)
    with torch.no_grad():
        moe.router_bias.normal_(0.0, 0.5)
    return moe


def _both_paths(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        if isinstance(moe, InklingMoE):
            weights, _, chosen = moe.gate.route(x)
            return moe.chosen_experts(x, weights, chosen), moe.all_experts(x, weights)
        _, ids = moe.route(x)
        return moe.chosen_experts(x, ids), moe.all_experts(x, ids)


_CASES = [(16, 2), (16, 1), (8, 8), (64, 8)]  # threshold T <= 7, 15, 0, 7


@pytest.mark.parametrize("make", [_inkling_moe, _step5_moe], ids=["inkling", "step5"])
@pytest.mark.parametrize("num_experts, top_k", _CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_chosen_experts_equal_all_experts(make, num_experts, top_k, dtype):
    torch.manual_seed(num_experts * 10 + top_k)
    moe = make(num_experts, top_k, dtype)
    bound = small_step_max_tokens(num_experts, top_k)
    for num_tokens in sorted({1, 2, 3, max(bound, 1), bound + 1, 2 * bound + 3}):
        x = torch.randn(num_tokens, HIDDEN).to(dtype)
        small, full = _both_paths(moe, x)
        assert small.shape == full.shape and small.dtype == full.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(small, full), f"T = {num_tokens}"
        else:
            err = (small - full).abs().max() / full.abs().max()
            assert err <= FP32_BOUND, f"T = {num_tokens}: relative error {err:.3g}"


def test_inkling_sums_in_ascending_expert_order_whatever_topk_returns(monkeypatch):
    """``topk(sorted=False)`` returns the k ids in the kernel's order; the sum must follow expert ids.

    In fp32 the four products are added in fp32, where another order rounds differently often enough to be
    seen (bf16 products summed in fp32 and rounded once to bf16 would hide it); reversing the router's slots
    must change nothing. (In fp32 the all-experts path's GEMMs round apart from the gathered ones: close.)"""
    torch.manual_seed(1)
    moe = _inkling_moe(16, 4, torch.float32)
    x = torch.randn(3, HIDDEN)
    with torch.inference_mode():
        weights, _, chosen = moe.gate.route(x)
        orders = (chosen, chosen.flip(-1), chosen.sort(-1, descending=True).values)
        first, *others = [moe.chosen_experts(x, weights, order) for order in orders]
        assert all(torch.equal(other, first) for other in others)
        torch.testing.assert_close(first, moe.all_experts(x, weights))


@pytest.mark.parametrize("make", [_inkling_moe, _step5_moe], ids=["inkling", "step5"])
def test_forward_takes_the_path_the_threshold_names(make, monkeypatch):
    moe = make(16, 2, torch.bfloat16)
    assert moe.small_step_max_tokens == 7
    taken = []
    for name in ("chosen_experts", "all_experts"):
        method = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _m=method, _n=name: (taken.append(_n), _m(*a))[1])
    for num_tokens in (1, 2, 7, 8, 16):
        with torch.inference_mode():
            moe(torch.randn(num_tokens, HIDDEN).to(torch.bfloat16))
    assert taken == ["chosen_experts"] * 3 + ["all_experts"] * 2


def test_token_ranges_split_at_the_threshold():
    assert token_ranges_for(InklingModel(InklingConfig()), 16) == ((2, 16),)  # 4 experts top-2: T <= 1
    many = InklingModel(InklingConfig(n_routed_experts=16))
    assert token_ranges_for(many, 16) == ((2, 7), (8, 16))
    assert token_ranges_for(many, 4) == ((2, 4),)
    assert token_ranges_for(many, 8) == ((2, 7), (8, 8))
    assert token_ranges_for(many, 7) == ((2, 7),)  # the bound at max_size: no empty range after it
    assert token_ranges_for(InklingModel(InklingConfig(n_routed_experts=6)), 16) == ((2, 2), (3, 16))
    dense = InklingModel(InklingConfig(n_routed_experts=16, mlp_layer_types=("dense", "dense")))
    assert token_ranges_for(dense, 16) == ((2, 16),)


_MODELS = [
    pytest.param(InklingModel, InklingConfig(n_routed_experts=16), id="inkling"),
    pytest.param(Step5Model, Step5Config(moe_num_experts=16), id="step5"),
]


@pytest.mark.parametrize("model_cls, config", _MODELS)
def test_runner_decode_steps_take_the_small_path_eager_and_compiled(model_cls, config, monkeypatch):
    """A prefill (T = 16: all experts), then decode and verify steps (T = 2, 4: chosen experts), eagerly
    (calls counted) and compiled (``aot_eager``: two graphs, one per token range, no graph break, the
    small range's graph gathering expert weights with ``index_select``; bitwise equal to eager)."""
    moe_cls = InklingMoE if model_cls is InklingModel else Step5MoE
    gathers = 2 if moe_cls is InklingMoE else 3  # weight tensors gathered per MoE block
    outputs = {}
    for mode in (EAGER, COMPILED):
        torch.manual_seed(0)
        model = model_cls(config)
        routed_layers = sum(isinstance(m, moe_cls) for m in model.modules())
        assert routed_layers >= 1
        graphs = []

        def record(gm, example_inputs):
            graphs.append(sum(str(n.target).endswith("index_select") for n in gm.graph.nodes))
            return gm

        backend = torch._dynamo.testing.CompileCounterWithBackend(record)
        runner = StepRunner(model, max_requests=2, max_model_len=24, max_tokens=16, device="cpu", mode=mode,
                            compile_backend=backend)
        taken = []
        if mode == EAGER:  # (a counting wrapper in a compiled step would guard on the count: a recompile)
            for name in ("chosen_experts", "all_experts"):
                method = getattr(moe_cls, name)
                monkeypatch.setattr(moe_cls, name, lambda self, *a, _m=method, _n=name: (taken.append(_n), _m(self, *a))[1])
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(20, config.hidden_size, generator=gen).to(torch.bfloat16)
        y = torch.randn(4, config.hidden_size, generator=gen).to(torch.bfloat16)
        counters.clear()
        outs = runner.step([ScheduledRequest(0, 0, x[:10]), ScheduledRequest(1, 0, y[:3])])  # T = 13 -> 16
        outs += runner.step([ScheduledRequest(0, 10, x[10:11])])  # decode, T = 1 -> 2
        outs += runner.step([ScheduledRequest(0, 11, x[11:14]), ScheduledRequest(1, 3, y[3:4])])  # verify, T = 4
        monkeypatch.undo()
        if mode == EAGER:
            assert taken == ["all_experts"] * routed_layers + ["chosen_experts"] * 2 * routed_layers
        else:
            assert runner.token_ranges == ((2, 7), (8, 16))
            assert backend.frame_count == 2 and not counters["graph_break"], dict(counters["graph_break"])
            assert graphs[1] - graphs[0] == gathers * routed_layers, graphs  # [8, 16] first, then [2, 7]
        outputs[mode] = outs
    for got, want in zip(outputs[COMPILED], outputs[EAGER]):
        assert torch.equal(got, want)


def test_sparse_layers_exist_in_the_runner_models():
    """(The runner tests above would pass vacuously on a model without an MoE block.)"""
    assert SPARSE in InklingConfig(n_routed_experts=16).mlp_layer_types
    assert Step5Config(moe_num_experts=16).moe_layers


def test_inkling_top_0_routes_no_token_to_an_expert_eager_and_compiled():
    """``num_experts_per_tok = 0`` (transformers runs it: shared experts only; against transformers in
    test_inkling_oracle's ``shared_experts_only`` variant): every step size takes the chosen-experts path,
    with no expert, so the runner compiles one graph for all sizes, zero-sized tensors and all; Inductor's
    equals eager bitwise where it keeps the bf16 roundings (torch >= 2.13)."""
    config = InklingConfig(num_experts_per_tok=0)
    torch.manual_seed(0)
    moe = _inkling_moe(config.n_routed_experts, 0, torch.bfloat16)
    assert moe.small_step_max_tokens == sys.maxsize
    small, full = _both_paths(moe, torch.randn(5, HIDDEN).to(torch.bfloat16))
    assert torch.equal(small, full) and not small.any()
    outputs = {}
    for mode in (EAGER, COMPILED):
        torch.manual_seed(0)
        model = InklingModel(config)
        runner = StepRunner(model, max_requests=2, max_model_len=24, max_tokens=16, device="cpu", mode=mode)
        x = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        counters.clear()
        outputs[mode] = runner.step([ScheduledRequest(0, 0, x[:9]), ScheduledRequest(1, 0, x[9:11])])
        outputs[mode] += runner.step([ScheduledRequest(0, 9, x[11:12])])
        assert runner.token_ranges == ((2, 16),) and not counters["graph_break"]
    tol = TOLERANCES["model_vs_recompute"]
    for got, want in zip(outputs[COMPILED], outputs[EAGER], strict=True):
        if INDUCTOR_KEEPS_BF16_ROUNDINGS:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)
