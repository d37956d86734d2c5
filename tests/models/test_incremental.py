"""Incremental steps with caches == a full recompute of the committed sequences without caches.

The scripted workload mixes prefill chunks, plain decode and verify steps with rejected drafts (whose
garbage inputs the next step overwrites) over several requests in random block tables, for several model
seeds. Step5 models load a random checkpoint in StepFun's reference names (fp8 experts included) and are
checked against :mod:`stepops.testing.step5_reference`, an independent recompute from the reference's
formulas that reads the same checkpoint; Inkling against :mod:`stepops.testing.inkling_reference`.

The two paths sum in other orders (an online softmax over paged key chunks vs one dense softmax, a per-expert
loop vs all experts), so they need not be bitwise even on CPU: there each output is within one bf16 ulp of its
token's largest value per layer and at most 1/8 of the elements differ (``model_vs_recompute_cpu``); on a GPU the kernels differ
more and the comparison uses ``model_vs_recompute``. Tokens whose region choice in the recompute is a near
tie are left out (either choice is correct), and there must be few of them. A deep Step5 stack is compared
layer by layer (each layer recomputed on its own committed inputs), where neither effect compounds.
"""

import contextlib
import math
import random

import pytest
import torch

import stepops.models.step5 as step5
from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
from stepops.models.runner import ScheduledRequest, StepRunner, Workload, run_workload
from stepops.models.step5_config import CSA, SLIDING, Llama3RopeScaling
from stepops.models.step5_weights import load_step5_state_dict
from stepops.testing import TOLERANCES
from stepops.testing.recompute import (
    MAX_NEAR_TIE_FRACTION,
    CommittedLayerRows,
    compare_layers_with_recompute,
    compare_with_recompute,
)
from stepops.testing.step5_checkpoint import random_step5_checkpoint

_WORKLOAD = Workload(prompt_lens=(19, 9, 30), decode_lens=(12, 16, 7), num_speculative_tokens=3, token_budget=16)
# Past top-k: 8 to 13 complete regions per request against index_top_k = 2, so selection decides.
_LONG_WORKLOAD = Workload(prompt_lens=(90, 40, 57), decode_lens=(14, 30, 9), num_speculative_tokens=3, token_budget=32)
# The share of a workload's elements that may differ at all (model_vs_recompute_cpu). One output one ulp apart
# in a layer before a sliding one moves the next sliding_window + 1 rows of its request by an ulp or so: 17 of
# 240 rows, half their elements, 3.5% of _LONG_WORKLOAD (seen on an AVX-512 CPU in csa_first, where other CPUs
# differ in 0.9% at most). 1/8 leaves room for three such flips; a rounding missed in every layer moves far
# more (the bf16 residual stream: 52%, test_a_broken_layer_part_is_caught).
_MAX_DIFFERING_FRACTION = 1 / 8


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _step5(config: Step5Config, seed: int, *, fp8_experts: bool = False) -> tuple[Step5Model, dict[str, torch.Tensor]]:
    """A Step5 model on the test device with a random reference-named checkpoint loaded (bf16 experts: the
    per-token bound; fp8 experts round their inputs to e4m3, which widens it, see test_step5_fp8_experts_*)."""
    checkpoint = random_step5_checkpoint(config, seed, fp8_experts=fp8_experts)
    with torch.device(_device()):
        model = Step5Model(config)
    load_step5_state_dict(model, checkpoint)
    return model, {name: t.to(_device()) for name, t in checkpoint.items()}


def _run(model, workload: Workload, seed: int, max_tokens: int | None = None, *, record_layers: bool = False):
    """The workload on a fresh runner (the model's ``num_speculative_tokens``, ``seed``); with
    ``record_layers``, returns the committed rows of every layer (:class:`CommittedLayerRows`) as well."""
    k = getattr(model.config, "num_speculative_tokens", 3)
    workload = Workload(**{**workload.__dict__, "num_speculative_tokens": k, "seed": seed})
    runner = StepRunner(
        model, max_requests=4, max_model_len=workload.max_len, max_tokens=max_tokens or workload.token_budget,
        device=_device(), seed=seed,
    )
    recorder = CommittedLayerRows(runner, workload.lengths) if record_layers else contextlib.nullcontext()
    with recorder:
        result = run_workload(runner, workload, model.config.hidden_size)
    assert result.verify_turns > 0 and result.rejected_tokens > 0  # the workload exercises rollback
    assert all(not y.isnan().any() for y in result.outputs), "a committed position has no output"
    return (result, recorder) if record_layers else result


def _compare(model, result, state_dict=None):
    if _device().type == "cpu":
        comparison = compare_with_recompute(model, result.inputs, result.outputs, state_dict=state_dict)
        fp8_moe_layers = sum(isinstance(m, step5.Step5MoE) and m.down_proj.fp8 for m in model.modules())
        bound = (
            len(model.layers) * TOLERANCES["model_vs_recompute_cpu"].rtol
            + fp8_moe_layers * TOLERANCES["model_vs_recompute_cpu_fp8_experts"].rtol
        )
        assert comparison.max_row_relative_err <= bound, comparison
        assert comparison.differing_fraction <= _MAX_DIFFERING_FRACTION, comparison
    else:
        comparison = compare_with_recompute(
            model, result.inputs, result.outputs, tolerance=TOLERANCES["model_vs_recompute"], state_dict=state_dict
        )
        assert comparison.within_bound, comparison
    assert comparison.near_tie_rows <= MAX_NEAR_TIE_FRACTION * comparison.rows, comparison
    return comparison


_STEP5_CONFIGS = [
    pytest.param(Step5Config(), id="step5"),
    pytest.param(Step5Config(layer_types=("csa",), index_top_k=1, num_speculative_tokens=2), id="step5_csa_top1_k2"),
    # Per-layer SwiGLU limits (the reference's swiglu_limits lists: each layer reads its own) that clip in every
    # FFN but the unclamped shared one, and routed weights not renormalised (its norm_expert_weight = false).
    pytest.param(
        Step5Config(swiglu_limit=(0.25, 4.0), swiglu_limit_shared=(math.inf, 0.5), moe_renormalize=False),
        id="step5_per_layer_limits_unnormalised",
    ),
    # The reference's use_head_wise_attn_gate = false: no g_proj in the checkpoint, no gate.
    pytest.param(Step5Config(head_wise_attn_gate=False), id="step5_no_attn_gate"),
    # No CSA layer: numbers only the indexer and the CSA rope read do not fit (3 KV heads do not divide the 16
    # indexer heads; a third of head_dim 4 rotates 1 dim) and are not checked.
    pytest.param(
        Step5Config(layer_types=("sliding", "sliding"), moe_layers=(1,), num_heads=6, num_kv_heads=3, head_dim=4),
        id="step5_sliding_only",
    ),
    # One indexer head per KV group: a region's score is relu(dot) * w, 0 for about half the regions, so the
    # k-th and (k+1)-th often tie at exactly 0. Those ties are exact (the lower id wins in both) unless a dot
    # lies within the margin of 0; counted as near ties they left out 12-16 of these 93 rows, past the bound.
    pytest.param(Step5Config(num_heads=4, num_kv_heads=2, index_num_heads=2), id="step5_one_indexer_head_per_group"),
]


@pytest.mark.parametrize("config", _STEP5_CONFIGS)
@pytest.mark.parametrize("seed", range(4))
def test_step5_matches_the_independent_recompute(config, seed):
    """Chunked prefill, decode and verify with rejections of a loaded reference-named checkpoint."""
    model, checkpoint = _step5(config, seed)
    _compare(model, _run(model, _WORKLOAD, seed), checkpoint)


def test_step5_small_steps_run_only_the_chosen_experts(monkeypatch):
    """16 experts top-2: steps of up to 7 tokens (``T * k < E``; here steps padded to 2 and 4, mostly decode
    and verify) gather only the chosen experts, those of 8 run all of them; both against the recompute,
    which runs each expert on its chosen rows as the reference does."""
    taken = []
    chosen = step5.Step5MoE.chosen_experts
    monkeypatch.setattr(step5.Step5MoE, "chosen_experts", lambda self, *a: (taken.append(a[0].shape[0]), chosen(self, *a))[1])
    model, checkpoint = _step5(Step5Config(moe_num_experts=16), seed=0)
    workload = Workload(**{**_WORKLOAD.__dict__, "token_budget": 8})  # steps of 2, 4 and 8 tokens
    _compare(model, _run(model, workload, seed=0), checkpoint)
    assert len(taken) >= 4 and set(taken) <= {2, 4}, taken


# The CSA layer last (the default) and first: a near tie in a first CSA layer marks the rest of its request.
_CSA_LAST_AND_FIRST = [
    pytest.param(Step5Config(), id="csa_last"),
    pytest.param(Step5Config(layer_types=("csa", "sliding"), moe_layers=(1,)), id="csa_first"),
]


@pytest.mark.parametrize(
    "config",
    _CSA_LAST_AND_FIRST
    # The smallest chunks: sliding attention folds one 80-token block of keys at a time (windows across a block
    # boundary take two), the indexer scores one region at a time (exact top-k for any chunk size).
    + [pytest.param(Step5Config(attention_keys_per_chunk=1, indexer_regions_per_chunk=1), id="csa_last_smallest_chunks")],
)
@pytest.mark.parametrize("seed", range(2))
def test_step5_long_sequences_past_top_k_regions(config, seed):
    """Sequences of up to 104 tokens (13 regions) against top-2: per-group selection, e4m3 scoring and the
    CSA layer's rope decide which keys each token sees (a near tie in a first CSA layer leaves out the rest
    of its request: up to 22 of 240 rows here)."""
    model, checkpoint = _step5(config, seed)
    _compare(model, _run(model, _LONG_WORKLOAD, seed), checkpoint)


def _compare_layers(model, layer_rows, checkpoint):
    """Each layer against the recompute of that layer alone on the inputs the model's layer committed (teacher
    forced): one layer's bound each, and a near tie leaves out its row in that layer only."""
    if _device().type == "cpu":
        comparisons = compare_layers_with_recompute(model, layer_rows, state_dict=checkpoint)
        for i, comparison in enumerate(comparisons):
            assert comparison.max_row_relative_err <= TOLERANCES["model_vs_recompute_cpu"].rtol, (i, comparison)
            assert comparison.differing_fraction <= _MAX_DIFFERING_FRACTION, (i, comparison)
    else:
        tolerance = TOLERANCES["model_vs_recompute"]
        comparisons = compare_layers_with_recompute(model, layer_rows, tolerance=tolerance, state_dict=checkpoint)
        assert all(comparison.within_bound for comparison in comparisons), comparisons
    for i, comparison in enumerate(comparisons):
        assert comparison.near_tie_rows <= MAX_NEAR_TIE_FRACTION * comparison.rows, (i, comparison)
    return comparisons


# Six layers: two CSA layers side by side, CSA after and before sliding ones, MoE in a layer of each kind.
# End to end, near ties compound here: 32 and 60 of 240 rows left out for seeds 1 and 0, past the 1/10 bound.
_DEEP = Step5Config(layer_types=("sliding", "csa", "sliding", "csa", "csa", "sliding"), moe_layers=(1, 4))


@pytest.mark.parametrize("seed", range(2))
def test_step5_deep_stack_matches_the_recompute_layer_by_layer(seed):
    """Six layers over long sequences, each layer against the recompute of that layer on its own committed
    inputs, so a deep stack is held to one layer's bound (at most 2 of 240 rows per layer near ties)."""
    model, checkpoint = _step5(_DEEP, seed)
    result, layer_rows = _run(model, _LONG_WORKLOAD, seed, record_layers=True)
    # The recorded rows are the run's: the workload's inputs go in, each layer feeds the next, and the last
    # layer's rows through the final norm are the committed outputs.
    for request, x in enumerate(result.inputs):
        assert torch.equal(layer_rows.inputs[0][request], x.float())
        for i in range(1, len(model.layers)):
            assert torch.equal(layer_rows.inputs[i][request], layer_rows.outputs[i - 1][request])
        last = layer_rows.outputs[-1][request].to(_device(), torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(model.norm(last).cpu(), result.outputs[request])
    _compare_layers(model, layer_rows, checkpoint)


def _random_step5_config(rng: random.Random) -> Step5Config:
    """A config drawn from the space the named ones vary one option at a time: 2-3 layers (a CSA layer in
    most), MHA to GQA 2 over 1-4 KV heads, head dims 12-24, 1-8 indexer heads per group, top-k 1-5, windows
    of 4-33, llama3 bands or none, partial rotary 1/3-1, SwiGLU limits from 1 to none, MoE in any layers
    (2-6 experts, any top-k, renormalised or not), the attention gate or none, indexer chunks of 1-128
    regions. (Attention chunks stay the default: chunks smaller than a window round the softmax weights
    against each chunk's running max, which the one-pass recompute's per-layer bound of one ulp does not
    allow for; see docs/models.md, "Chunk sizes". The named smallest-chunks config and transformers'
    Inkling at random chunk sizes run them.)"""
    layers = rng.randint(2, 3)
    layer_types = tuple(rng.choice((SLIDING, CSA)) for _ in range(layers))
    if CSA not in layer_types and rng.random() < 0.7:
        layer_types = layer_types[:-1] + (CSA,)
    kv_heads, experts = rng.choice((1, 2, 4)), rng.choice((2, 4, 6))
    return Step5Config(
        hidden_size=rng.choice((32, 48, 64)), num_heads=kv_heads * rng.choice((1, 2)), num_kv_heads=kv_heads,
        head_dim=rng.choice((12, 16, 24)), intermediate_size=rng.choice((32, 128)),
        sliding_window=rng.choice((4, 8, 16, 33)), index_num_heads=kv_heads * rng.choice((1, 2, 4, 8)),
        index_rope_dim=rng.choice((8, 16)), index_top_k=rng.choice((1, 2, 3, 5)),
        num_speculative_tokens=rng.choice((1, 2, 3)), rms_norm_eps=rng.choice((1e-5, 1e-6)),
        csa_partial_rotary_factor=rng.choice((1 / 3, 0.5, 1.0)),
        csa_rope_scaling=rng.choice((None, Llama3RopeScaling(4.0, 1.0, 4.0, 64), Llama3RopeScaling(8.0, 1.0, 2.0, 32))),
        swiglu_limit=rng.choice((1.0, 7.0, math.inf)), swiglu_limit_shared=rng.choice((0.75, math.inf)),
        moe_layers=tuple(i for i in range(layers) if rng.random() < 0.5), moe_num_experts=experts,
        moe_top_k=rng.randint(1, experts), moe_intermediate_size=rng.choice((16, 32)),
        share_expert_dim=rng.choice((16, 32)), moe_router_scaling_factor=rng.choice((1.0, 3.0)),
        moe_renormalize=rng.random() < 0.5, head_wise_attn_gate=rng.random() < 0.7, layer_types=layer_types,
        indexer_regions_per_chunk=rng.choice((1, 3, 128)),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_step5_random_configs_match_the_recompute_layer_by_layer(seed):
    """Combinations no named config has, over long sequences, layer by layer (every layer within its bound in
    60 draws). End to end, near ties compound over 2-3 layers (24 of those 60 left out more than a tenth of
    the rows), and in another draw of 60 one sliding + CSA config (head_dim 24) left the bound: a sliding
    layer's output one ulp off the recompute's in one row (another sum order) moved a region summary's e4m3
    code and a score by 0.5% of its group's largest, past ``NEAR_TIE_MARGIN``, and flipped region choices."""
    model, checkpoint = _step5(_random_step5_config(random.Random(seed)), seed)
    _, layer_rows = _run(model, _LONG_WORKLOAD, seed, record_layers=True)
    _compare_layers(model, layer_rows, checkpoint)


def test_layer_rows_that_no_step_fed_are_an_error_and_the_runner_is_given_back():
    model, _ = _step5(Step5Config(), seed=0)
    runner = StepRunner(model, max_requests=2, max_model_len=16, max_tokens=8, device=_device())
    step = runner.step
    with pytest.raises(ValueError, match=r"request slots \[1\] have positions no step fed"):
        with CommittedLayerRows(runner, [4, 3]):
            runner.step([ScheduledRequest(0, 0, torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16))])
    assert runner.step == step and not any(layer._forward_hooks for layer in model.layers)


def test_step5_requests_reach_the_last_region_of_their_block_table():
    """max_model_len = one 80-token block: the longest request's last committed tokens (72..76) sit in the
    table's last region and may select the region before it, the last one a block table can offer."""
    config = Step5Config(layer_types=("csa",), index_top_k=4)
    model, checkpoint = _step5(config, seed=0)
    workload = Workload(prompt_lens=(50, 20), decode_lens=(27, 30), num_speculative_tokens=3, token_budget=16)
    result = _run(model, workload, seed=0)
    assert workload.max_len == model.attn_block_size == 80
    _compare(model, result, checkpoint)


@pytest.mark.parametrize("config", _CSA_LAST_AND_FIRST)
@pytest.mark.parametrize("seed", range(2))
def test_step5_fp8_experts_match_the_independent_recompute(config, seed):
    """A checkpoint with fp8 experts, long sequences: the layer's e4m3-rounded GEMM inputs against the
    recompute's transcription of the reference's act_quant + fp8_gemm, through chunked prefill, decode and
    verify (the bound grows by ``model_vs_recompute_cpu_fp8_experts`` per such layer)."""
    model, checkpoint = _step5(config, seed, fp8_experts=True)
    assert all(layer.moe.down_proj.fp8 for i, layer in enumerate(model.layers) if i in config.moe_layers)
    result = _run(model, _LONG_WORKLOAD, seed)
    _compare(model, result, checkpoint)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(InklingConfig(), id="inkling"),
        pytest.param(InklingConfig(layer_types=("global",), block_size=32), id="inkling_global_enlarged_blocks"),
        # Global conv pages twice the sliding ones: the unified page gives the layers conv blocks of 16 and 8.
        pytest.param(InklingConfig(head_dim=64), id="inkling_unequal_conv_pages"),
        # Global layers fold their keys one block at a time (by default, all at once at these lengths).
        pytest.param(InklingConfig(attention_keys_per_chunk=1), id="inkling_one_block_chunks"),
    ],
)
@pytest.mark.parametrize("seed", range(6))
def test_inkling_matches_full_recompute(config, seed):
    torch.manual_seed(seed)
    with torch.device(_device()):
        model = InklingModel(config)
    _compare(model, _run(model, _WORKLOAD, seed))


def test_inkling_decodes_into_a_partial_last_conv_block():
    """max_model_len 35 over conv blocks of 4: the table's last block is partial (positions 32..34) and the
    longest request commits positions 32 and 33 into it, 33's taps reading 32 back from the cache (k = 1, so
    committed tokens reach it)."""
    config = InklingConfig(num_speculative_tokens=1)
    workload = Workload(prompt_lens=(19, 9, 21), decode_lens=(12, 16, 13), num_speculative_tokens=1, token_budget=16)
    torch.manual_seed(0)
    with torch.device(_device()):
        model = InklingModel(config)
    result = _run(model, workload, seed=0)
    assert workload.max_len == 35 and {layer.conv_state.kv_cache.shape[2] for layer in model.layers} == {4}
    _compare(model, result)


def _run_poisoned(model, poison: bool):
    """The workload; with ``poison`` every attention KV cache holds NaN before the first step and every
    Step5 summary cache e4m3's NaN code (0x7F), so only rows the steps write are ever real."""
    runner = StepRunner(model, max_requests=4, max_model_len=_WORKLOAD.max_len, max_tokens=16, device=_device())
    for layer in model.layers:
        layer.attn.kv_cache.fill_(float("nan") if poison else 0.0)
        if getattr(layer, "kind", None) == CSA:
            layer.summary_cache.fill_(0x7F if poison else 0)
    return run_workload(runner, _WORKLOAD, model.config.hidden_size).outputs


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _step5(Step5Config(), 0)[0], id="step5"),
        pytest.param(lambda: (torch.manual_seed(0), InklingModel(InklingConfig()))[1], id="inkling"),
    ],
)
def test_unwritten_cache_rows_holding_nan_change_no_output(make):
    """Cache rows no step has written (past a request's length, other requests' blocks, a freed block's
    stale data) are masked: a NaN there changes no output bit, in sliding, global and CSA layers."""
    with torch.device(_device()):
        clean, poisoned = _run_poisoned(make(), poison=False), _run_poisoned(make(), poison=True)
    for got, want in zip(poisoned, clean):
        assert got.isfinite().all()
        assert torch.equal(got, want)


def _pooled_selection(select):
    """Group 0's selection for every KV group (one pooled choice per token, the pre-fix behaviour)."""

    def pooled(self, h, metadata):
        selected = select(self, h, metadata)
        return selected[:, :1].expand_as(selected)

    return pooled


def _bf16_residual(forward):
    """The layer on a residual stream rounded to bf16 before and after it (the pre-fix behaviour)."""

    def bf16(self, residual, metadata):
        return forward(self, residual.to(torch.bfloat16).float(), metadata).to(torch.bfloat16).float()

    return bf16


def _plain_scale_norm(self, x):
    """``x / rms(x) * w`` instead of ``* (1 + w)``."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


# One broken part of the layer at a time; each must take the outputs outside the CPU bound.
_BROKEN_PARTS = {
    "norm_w_not_1_plus_w": ("ZeroCentredRMSNorm.forward", _plain_scale_norm),
    "swiglu_unclamped": ("clamped_swiglu", lambda gate, up, limit: (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)),
    "selection_pooled_over_groups": ("Step5DecoderLayer._select_regions", _pooled_selection(step5.Step5DecoderLayer._select_regions)),
    "rope_without_llama3": ("rope_inv_freq", lambda dim, theta, scaling, f=step5.rope_inv_freq: f(dim, theta, None)),
    "router_weights_not_renormalised": ("ROUTER_RENORM_EPS", 1e6),
    "indexer_query_not_e4m3": ("round_to_e4m3", lambda x: x.float()),
    "residual_stream_bf16": ("Step5DecoderLayer.forward", _bf16_residual(step5.Step5DecoderLayer.forward)),
}
# Parts that act only once selection has many regions to choose from.
_NEED_LONG_SEQUENCES = {"selection_pooled_over_groups", "indexer_query_not_e4m3"}


@pytest.mark.parametrize("part", sorted(_BROKEN_PARTS))
def test_a_broken_layer_part_is_caught(part, monkeypatch):
    """The recompute is independent: breaking one part of the layer (not of the recompute) fails the check."""
    target, replacement = _BROKEN_PARTS[part]
    owner, _, attr = target.rpartition(".")
    monkeypatch.setattr(getattr(step5, owner) if owner else step5, attr, replacement)
    model, checkpoint = _step5(Step5Config(), seed=0)  # modules built after the patch (rope buffers)
    result = _run(model, _LONG_WORKLOAD if part in _NEED_LONG_SEQUENCES else _WORKLOAD, seed=0)
    comparison = compare_with_recompute(model, result.inputs, result.outputs, state_dict=checkpoint)
    bound = len(model.layers) * TOLERANCES["model_vs_recompute_cpu"].rtol
    assert comparison.max_row_relative_err > bound or comparison.differing_fraction > _MAX_DIFFERING_FRACTION, comparison


@pytest.mark.parametrize("part", sorted(_BROKEN_PARTS))
def test_a_broken_layer_part_is_caught_layer_by_layer(part, monkeypatch):
    """The layer-by-layer comparison can fail too: each broken part takes some layer outside its bound."""
    target, replacement = _BROKEN_PARTS[part]
    owner, _, attr = target.rpartition(".")
    monkeypatch.setattr(getattr(step5, owner) if owner else step5, attr, replacement)
    model, checkpoint = _step5(Step5Config(), seed=0)
    workload = _LONG_WORKLOAD if part in _NEED_LONG_SEQUENCES else _WORKLOAD
    _, layer_rows = _run(model, workload, seed=0, record_layers=True)
    comparisons = compare_layers_with_recompute(model, layer_rows, state_dict=checkpoint)
    bound = TOLERANCES["model_vs_recompute_cpu"].rtol
    assert any(c.max_row_relative_err > bound or c.differing_fraction > _MAX_DIFFERING_FRACTION for c in comparisons)


def test_a_stale_summary_is_caught():
    """The comparison can fail: zeroing the CSA summaries after each step changes later selections."""
    model, checkpoint = _step5(Step5Config(layer_types=("csa",)), seed=0)
    runner = StepRunner(model, max_requests=4, max_model_len=_WORKLOAD.max_len, max_tokens=16, device=_device())
    step = runner.step

    def step_then_forget(batch):
        out = step(batch)
        model.layers[0].summary_cache.zero_()
        return out

    runner.step = step_then_forget
    result = run_workload(runner, _WORKLOAD, model.config.hidden_size)
    comparison = compare_with_recompute(
        model, result.inputs, result.outputs, tolerance=TOLERANCES["model_vs_recompute"], state_dict=checkpoint
    )
    assert comparison.max_abs_err > 0.1 and not comparison.within_bound
    assert comparison.max_row_relative_err > TOLERANCES["model_vs_recompute_cpu"].rtol
