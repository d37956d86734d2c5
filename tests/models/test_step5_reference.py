"""The Step5 recompute's region choices: near ties are marked per KV group (and nothing else), exact ties go
to the lower id in both the layer and the recompute (ties at 0 that no rounding moves are exact, not near);
the layer's indexer scores equal the recompute's."""

import pytest
import torch

from stepops.layouts import REGION_SIZE
from stepops.models import Step5Config, Step5Model
from stepops.models.runner import StepRunner, Workload, run_workload
from stepops.models.step5_weights import load_step5_state_dict
from stepops.testing import TOLERANCES
from stepops.testing.recompute import compare_with_recompute
from stepops.testing.step5_checkpoint import random_step5_checkpoint
from stepops.testing import step5_reference as reference
from stepops.testing.step5_reference import region_selection


def test_near_ties_are_the_close_kth_and_next_scores_of_any_group():
    # Tokens 16..23 have two earlier regions, tokens 8..15 one (no choice with top_k = 1), 0..7 none.
    scores = torch.zeros(24, 2, 3)
    scores[16, 0, :2] = torch.tensor([1.00, 0.99])  # gap 0.01 <= 2**-5 * 1.0: either region may be chosen
    scores[16, 1, :2] = torch.tensor([1.00, 0.10])
    scores[17, 0, :2] = torch.tensor([1.00, 0.90])  # gap 0.10 in both groups: clear choices
    scores[17, 1, :2] = torch.tensor([0.20, 1.00])
    scores[19, :, :2] = torch.tensor([-0.50, -0.52])  # negative weights: gap 0.02 > 2**-5 * 0.52
    scores[20, 1, :2] = torch.tensor([0.5, 0.49])  # only group 1 is close: 0.01 <= 2**-5 * 0.5
    scores[9, :, 0] = 5.0  # one candidate: nothing to choose
    allowed, near = region_selection(scores, top_k=1, margin=2**-5)
    # 18 and 21..23 are exact ties (every score 0): marked too, as any gap <= margin is.
    assert near.nonzero().flatten().tolist() == [16, 18, 20, 21, 22, 23]
    # Token 17: group 0 takes region 0, group 1 region 1, each with its own region 2.
    assert allowed[0, 17].view(3, 8).any(1).tolist() == [True, False, True]
    assert allowed[1, 17].view(3, 8).any(1).tolist() == [False, True, True]


def test_near_ties_at_top_k_2_are_between_the_second_and_third_scores():
    """With top_k = 2 the choice at stake is the 2nd against the 3rd ranked region: a close 1st and 2nd is
    no near tie (both are chosen either way). Tokens 24..31 have three earlier regions, the others two or fewer
    (no choice)."""
    scores = torch.zeros(32, 1, 4)
    scores[24, 0, :3] = torch.tensor([1.00, 0.99, 0.10])  # 2nd - 3rd = 0.89: clear
    scores[25, 0, :3] = torch.tensor([1.00, 0.50, 0.49])  # 2nd - 3rd = 0.01 <= 2**-5 * 1.0
    _, near = region_selection(scores, top_k=2, margin=2**-5)
    assert near.nonzero().flatten().tolist() == [25, 26, 27, 28, 29, 30, 31]  # 26..31: exact ties (all 0)


def test_a_tie_at_zero_is_exact_where_no_score_may_round_across_zero():
    """Given the recompute's ``unsettled`` scores, a k-th and (k+1)-th both 0 are an exact tie (every correct
    implementation takes the lower id) unless a zero score has a dot within the margin of 0 (a rounding may
    open its relu) or another score lies within the margin of 0. Tokens 32..39 have four earlier regions."""
    scores = torch.zeros(40, 1, 4)
    unsettled = torch.zeros(40, 1, 4, dtype=torch.bool)
    unsettled[33, 0, 3] = True  # an unchosen zero that may turn positive
    unsettled[34, 0, 0] = True  # a chosen zero that may turn negative (a negative head weight)
    scores[35, 0, 2:] = torch.tensor([-0.01, -1.0])  # -0.01 lies within 2**-5 * 1.0 of 0
    scores[36, 0, 2:] = torch.tensor([-0.5, -1.0])  # clear of 0: the tie at 0 stays exact
    _, near = region_selection(scores, top_k=1, margin=2**-5, unsettled=unsettled)
    assert near[32:].nonzero().flatten().tolist() == [1, 2, 3]
    _, near_without = region_selection(scores, top_k=1, margin=2**-5)
    assert near_without[32:].all()  # without unsettled, every tie at 0 is taken for a near one


def test_unsettled_scores_have_a_dot_not_clearly_below_zero():
    """Per region (two heads): dots clearly below 0, one within 2**-10 of its products' magnitudes below 0,
    a dot of 0 from all-zero products (stays 0 under any rounding), a dot of 0 from nonzero products."""
    dots = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-1.0, -(2**-12), -1.0, -1.0]]).view(1, 1, 2, 4)
    magnitudes = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]).view(1, 1, 2, 4)
    unsettled = reference.unsettled_scores(dots, magnitudes, margin=2**-10)
    assert unsettled.flatten().tolist() == [False, True, False, True]


def test_a_near_tie_before_the_last_layer_marks_the_rest_of_its_request(monkeypatch):
    """A near-tie choice in a layer before the last changes that row's keys and values there, which every
    later row of the request reads: the recompute marks them all; in the last layer only the row itself."""
    choose = reference.region_selection

    def near_tie_at_row_30(scores, top_k, margin, unsettled):
        allowed, near = choose(scores, top_k, margin, unsettled)
        return allowed, torch.arange(near.shape[0]) == 30

    monkeypatch.setattr(reference, "region_selection", near_tie_at_row_30)
    x = torch.randn(40, Step5Config().hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for layer_types, marked in ((("csa", "sliding"), list(range(30, 40))), (("sliding", "csa"), [30])):
        config = Step5Config(layer_types=layer_types, moe_layers=())
        _, rows = reference.step5_recompute(config, random_step5_checkpoint(config, seed=0), x, near_tie_margin=2**-5)
        assert rows.nonzero().flatten().tolist() == marked, layer_types


def test_the_random_checkpoint_exercises_what_the_reference_rounds_and_adds():
    """The values that let the oracle tests see a missed rounding or a dropped term: indexer head weights
    fp32 and not bf16-exact (the layer rounds them to bf16), zero-centred norm weights that are not 0 (the
    reference scales by w + 1), and an indexer key norm with a bias."""
    checkpoint = random_step5_checkpoint(Step5Config(), seed=0)
    w = checkpoint["layers.1.self_attn.sparse_indexer_w.weight"]
    assert w.dtype == torch.float32 and not torch.equal(w, w.to(torch.bfloat16).float())
    for name in ("layers.0.input_layernorm.weight", "layers.1.post_attention_layernorm.weight", "norm.weight",
                 "layers.1.self_attn.sparse_indexer_k_norm.bias"):
        assert checkpoint[name].abs().min() > 0 and checkpoint[name].std() > 0.05, name


def test_tied_scores_select_the_lowest_region_ids(monkeypatch):
    """With the CSA indexer's query projection zeroed every region score is relu(0) * w = 0: a token in
    region own >= k + 1 selects regions 0..k-1 (and reads its own) in every KV group, in the layer (checked on
    its selected ids) and in the recompute (checked on the outputs). Every dot sums zero products, so no
    rounding moves a score off 0: exact ties, and the recompute's near-tie margin leaves no row out."""
    config = Step5Config()
    checkpoint = random_step5_checkpoint(config, seed=0)
    checkpoint["layers.1.self_attn.sparse_indexer_q.weight"].zero_()
    model = Step5Model(config)
    load_step5_state_dict(model, checkpoint)
    csa = model.layers[1]
    recorded = []
    select = csa._select_regions

    def record(h, metadata):
        selected = select(h, metadata)
        recorded.append((metadata.token.position.clone(), selected.clone()))
        return selected

    monkeypatch.setattr(csa, "_select_regions", record)
    workload = Workload(prompt_lens=(19, 9, 30), decode_lens=(12, 16, 7), num_speculative_tokens=3, token_budget=16)
    runner = StepRunner(model, max_requests=4, max_model_len=workload.max_len, max_tokens=16, device="cpu")
    result = run_workload(runner, workload, config.hidden_size)
    k = config.index_top_k
    checked = 0
    for position, selected in recorded:
        for p, groups in zip(position.tolist(), selected):
            if p < 0:
                continue
            own = p // REGION_SIZE  # always read besides the selection
            want = torch.full_like(groups[0], -1)
            want[: min(own, k)] = torch.arange(min(own, k))
            for row in groups:
                assert torch.equal(row, want), f"position {p}: selected {row.tolist()}"
            checked += own >= k + 1
    assert checked > 20  # tokens that had a real choice among tied regions
    comparison = compare_with_recompute(model, result.inputs, result.outputs, state_dict=checkpoint)
    assert comparison.near_tie_rows == 0
    assert comparison.max_row_relative_err <= len(model.layers) * TOLERANCES["model_vs_recompute_cpu"].rtol
    assert comparison.differing_fraction <= 1 / 8


def test_moe_layers_sum_routed_and_shared_experts_before_the_residual(monkeypatch):
    """The reference's ``Step4DecoderLayer._feed_forward`` adds the routed and the shared expert in fp32
    first and only then adds that sum to the fp32 residual: ``x + (moe + shared)``, not ``(x + moe) +
    shared``. With x = 1 and both branches 2**-24 the two orders differ (1 + 2**-23 vs 1, ties to even).
    Checked on the layer and on the recompute, each with its attention contributing exactly 0."""
    import stepops.testing.step5_reference as reference

    config = Step5Config(layer_types=("sliding",), moe_layers=(0,))
    checkpoint = random_step5_checkpoint(config, seed=0)
    checkpoint["layers.0.self_attn.o_proj.weight"].zero_()  # attention adds exactly 0 to the residual
    residual = torch.ones(3, config.hidden_size)
    branch = torch.full((3, config.hidden_size), 2.0**-24, dtype=torch.bfloat16)
    want = torch.full_like(residual, 1.0 + 2.0**-23)

    model = Step5Model(config)
    load_step5_state_dict(model, checkpoint)
    layer = model.layers[0]
    monkeypatch.setattr(layer, "_attention", lambda h, metadata: torch.zeros_like(h))
    monkeypatch.setattr(layer.moe, "forward", lambda h: branch)
    monkeypatch.setattr(layer.share_expert, "forward", lambda h: branch)
    with torch.inference_mode():
        assert torch.equal(layer(residual, None), want)

    monkeypatch.setattr(reference, "_moe", lambda c, state, prefix, h: branch)
    monkeypatch.setattr(reference, "_swiglu", lambda h, gate, up, down, limit: branch)  # the shared expert
    with torch.inference_mode():
        got, _ = reference.recompute_layer(config, checkpoint, 0, residual, None)
    assert torch.equal(got, want)


# The layer's fp8 expert GEMMs (e4m3-rounded inputs times fp32-held weights, one fp32 sum) against the
# recompute's transcription of the reference's act_quant + fp8_gemm (fp32 sums per 128-wide K block): seen
# 99.8% of the MoE outputs bitwise equal at hidden 320 (a ragged K block), the rest one fp32 sum order apart
# and re-rounded. Without the input rounding only ~4% are equal (it moves each product by up to 1/16).
_FP8_MOE_EQUAL_FRACTION = 0.99


@pytest.mark.parametrize(
    "round_inputs, bf16_projection",
    [(True, None), (False, None), (True, "up_proj"), (True, "gate_proj")],
    ids=["as_the_reference", "weights_only", "bf16_up_proj", "bf16_gate_proj"],
)
def test_fp8_experts_compute_the_reference_fp8_gemm(round_inputs, bf16_projection, monkeypatch):
    """The same ``h`` into the layer's MoE and the recompute's: they agree as two fp8 GEMMs do, and a layer
    that only dequantises the weights (no input rounding) fails the same bar. A checkpoint may hold one of
    gate/up in bf16: that GEMM takes the bf16 input while the other rounds it."""
    import stepops.models.step5 as step5
    import stepops.testing.step5_reference as reference

    config = Step5Config(hidden_size=320, moe_intermediate_size=200)  # ragged 128-blocks along both K
    checkpoint = random_step5_checkpoint(config, seed=0)
    layer = config.moe_layers[0]
    prefix = f"layers.{layer}."
    if bf16_projection:
        name = f"{prefix}moe.{bf16_projection}"
        codes, scale = checkpoint[f"{name}.weight"], checkpoint.pop(f"{name}.weight_scale_inv")
        checkpoint[f"{name}.weight"] = step5.dequantize_fp8_blocks(codes, scale).to(torch.bfloat16)
    model = Step5Model(config)
    load_step5_state_dict(model, checkpoint)
    moe = model.layers[layer].moe
    assert [moe.gate_proj.fp8, moe.up_proj.fp8, moe.down_proj.fp8] == [
        bf16_projection != "gate_proj", bf16_projection != "up_proj", True
    ]
    if not round_inputs:
        monkeypatch.setattr(step5, "round_to_e4m3_blocks", lambda x: x.float())
    h = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    h[1], h[2, :128] = 0, 0  # an all-zero 128-block takes the scale's floor (1e-10), not 0 (0 / 0: NaN)
    small = h[: moe.small_step_max_tokens]  # a step that gathers the chosen experts: the other path
    with torch.inference_mode():
        got = torch.cat([moe(h), moe(small)])
        want = torch.cat([reference._moe(config, checkpoint, layer, h), reference._moe(config, checkpoint, layer, small)])
    assert got.isfinite().all() and want.isfinite().all()
    equal = float((got == want).float().mean())
    assert (equal >= _FP8_MOE_EQUAL_FRACTION) == round_inputs, equal


# Seen on CPU: the layer's indexer scores are the recompute's within 7e-8 of the largest score (the two
# sum the heads' dot products in other orders; same e4m3 inputs). An indexer part one bf16 rounding off
# moves them by ~2e-3 of it, yet flips only near-tie selections, which the output comparison may never meet.
_INDEXER_SCORE_BOUND = 2**-16


@pytest.mark.parametrize("seed", range(2))
def test_indexer_scores_equal_the_recompute(seed, monkeypatch):
    """Every score the CSA layer's indexer ranks, over steps (a prefill chunk, a decode, a longer chunk whose
    tokens close regions by replaying ring rows), equals ``step5_reference.indexer_scores`` on the same
    normed inputs, and exactly the regions before the token's own are scored (the rest ``-inf``). The
    output comparisons see an indexer error only when it flips a selection; e.g. indexer head weights
    computed from the fp32 checkpoint weight instead of its bf16 rounding (as the reference loads it)
    passed them all."""
    import stepops.models.step5 as step5
    import stepops.testing.step5_reference as reference
    from stepops.models.runner import ScheduledRequest

    config = Step5Config(layer_types=("csa",), moe_layers=())
    checkpoint = random_step5_checkpoint(config, seed)
    model = Step5Model(config)
    load_step5_state_dict(model, checkpoint)
    layer = model.layers[0]
    recorded = []  # (positions [T], normed inputs [T, hidden], scores [T, G, num_regions])
    topk, select = step5.streaming_topk, layer._select_regions

    def recording_topk(scorer, num_items, k, chunk_size):
        chunks = []

        def score_chunk(start, size):
            chunks.append(scorer(start, size))
            return chunks[-1]

        values_ids = topk(score_chunk, num_items, k, chunk_size)
        recorded[-1] += (torch.cat(chunks, -1),)
        return values_ids

    def recording_select(h, metadata):
        recorded.append((metadata.token.position.clone(), h.clone()))
        return select(h, metadata)

    monkeypatch.setattr(step5, "streaming_topk", recording_topk)
    monkeypatch.setattr(layer, "_select_regions", recording_select)
    length = 48
    x = torch.randn(length, config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    runner = StepRunner(model, max_requests=2, max_model_len=length, max_tokens=32, device="cpu")
    for start, end in ((0, 21), (21, 22), (22, length)):
        runner.step([ScheduledRequest(0, start, x[start:end])])

    h = torch.zeros(length, config.hidden_size, dtype=torch.bfloat16)
    for position, normed, _ in recorded:
        h[position[position >= 0]] = normed[position >= 0]
    want = reference.indexer_scores(config, checkpoint, "layers.0.", h, config.csa_rope_theta, config.csa_rope_scaling)
    bound = _INDEXER_SCORE_BOUND * float(want.abs().amax())
    checked = 0
    for position, _, scores in recorded:
        for p, got in zip(position.tolist(), scores):
            if p < 0:
                continue
            own = p // REGION_SIZE
            assert got[:, own:].eq(float("-inf")).all(), f"position {p}: a region from its own on was scored"
            err = (got[:, :own] - want[p, :, :own]).abs().max() if own else torch.tensor(0.0)
            assert err <= bound, f"position {p}: indexer score off by {float(err):.3g} (bound {bound:.3g})"
            checked += own
    assert checked >= 100  # (token, region) pairs scored
