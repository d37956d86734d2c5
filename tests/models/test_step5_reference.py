"""The Step5 recompute's region choices: near ties are marked per KV group (and nothing else), exact ties go
to the lower id in both the layer and the recompute."""

import torch

from stepops.models import Step5Config, Step5Model
from stepops.models.runner import StepRunner, Workload, run_workload
from stepops.models.step5_weights import load_step5_state_dict
from stepops.testing import TOLERANCES
from stepops.testing.recompute import compare_with_recompute
from stepops.testing.step5_checkpoint import random_step5_checkpoint
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


def test_tied_scores_select_the_lowest_region_ids(monkeypatch):
    """With the CSA indexer's query projection zeroed every region score is relu(0) * w = 0: a token in
    region own >= k + 1 selects regions 0..k-1 (and reads its own) in every KV group, in the layer (checked on
    its selected ids) and in the recompute (checked on the outputs, with no row left out)."""
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
            own = p // 8  # always read besides the selection
            want = torch.full_like(groups[0], -1)
            want[: min(own, k)] = torch.arange(min(own, k))
            for row in groups:
                assert torch.equal(row, want), f"position {p}: selected {row.tolist()}"
            checked += own >= k + 1
    assert checked > 20  # tokens that had a real choice among tied regions
    comparison = compare_with_recompute(model, result.inputs, result.outputs, near_tie_margin=None, state_dict=checkpoint)
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
        got, _ = reference._layer(config, checkpoint, 0, residual, None)
    assert torch.equal(got, want)
