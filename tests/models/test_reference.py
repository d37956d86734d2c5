"""The recompute's region choices: near ties are marked, and nothing else."""

from stepops.models.reference import _near_ties


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
