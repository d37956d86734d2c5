"""The recompute's region choices: near ties are marked (and nothing else), exact ties go to the lower id
in both the layer and the recompute."""

import torch

from stepops.models import Step5Config, Step5Model
from stepops.models.reference import _near_ties, compare_with_recompute
from stepops.models.runner import StepRunner, Workload, run_workload
from stepops.testing import TOLERANCES


def test_near_ties_are_the_close_kth_and_next_scores():
    # Tokens 16..23 have two earlier regions, tokens 8..15 one (no choice with top_k = 1), 0..7 none.
    scores = [[0.0, 0.0, 0.0] for _ in range(24)]
    scores[16][:2] = [1.00, 0.99]  # gap 0.01 <= 2**-5 * 1.0: either region may be chosen
    scores[17][:2] = [1.00, 0.90]  # gap 0.10: a clear choice
    scores[18][:2] = [0.0, 0.0]  # an exact tie (every score 0)
    scores[19][:2] = [-0.50, -0.52]  # negative weights: gap 0.02 > 2**-5 * 0.52 (the largest magnitude)
    scores[20][:2] = [0.5, 0.49]  # gap 0.01 <= 2**-5 * 0.5 = 0.0156
    scores[9][0] = 5.0  # one candidate: nothing to choose
    near = _near_ties(scores, top_k=1, margin=2**-5)
    assert near.nonzero().flatten().tolist() == [16, 18, 20, 21, 22, 23]


def _tied_model_and_run(monkeypatch):
    """Step5 with its CSA indexer's query projection zeroed: every region score is relu(0) * w = 0."""
    torch.manual_seed(0)
    model = Step5Model(Step5Config())
    csa = model.layers[1]
    with torch.no_grad():
        csa.index_q_proj.weight.zero_()
    recorded = []
    select = csa._select_regions

    def record(h, metadata):
        selected = select(h, metadata)
        recorded.append((metadata.token.position.clone(), selected.clone()))
        return selected

    monkeypatch.setattr(csa, "_select_regions", record)
    workload = Workload(prompt_lens=(19, 9, 30), decode_lens=(12, 16, 7), num_speculative_tokens=3, token_budget=16)
    runner = StepRunner(model, max_requests=4, max_model_len=workload.max_len, max_tokens=16, device="cpu")
    return model, run_workload(runner, workload, model.config.hidden_size), recorded


def test_tied_scores_select_the_lowest_region_ids(monkeypatch):
    """All scores tie: a token in region own >= k + 1 selects regions 0..k-1 and its own, in the layer (checked
    on its selection) and in the recompute (checked on the outputs, with no row left out)."""
    model, result, recorded = _tied_model_and_run(monkeypatch)
    k = model.config.index_top_k
    checked = 0
    for position, selected in recorded:
        for p, row in zip(position.tolist(), selected):
            if p < 0:
                continue
            own = p // 8
            want = torch.zeros_like(row)
            want[: min(own, k)] = True
            want[own] = True
            assert torch.equal(row, want), f"position {p}: selected {row.nonzero().flatten().tolist()}"
            checked += own >= k + 1
    assert checked > 20  # tokens that had a real choice among tied regions
    comparison = compare_with_recompute(model, result.inputs, result.outputs, near_tie_margin=None)
    assert comparison.near_tie_rows == 0
    assert comparison.max_row_relative_err <= len(model.layers) * TOLERANCES["model_vs_recompute_cpu"].rtol
    assert comparison.differing_fraction <= 1 / 8
