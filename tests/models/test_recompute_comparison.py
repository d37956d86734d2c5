"""``stepops.testing.recompute.compare_with_recompute`` on outputs with errors placed by hand: every field it
reports is the one the model tests bound, so each must be exact where the error is known.

The incremental tests would not see a comparison that under-counts: their errors are either zero-ish or
large. Here one Step5 CSA layer's recompute (the oracle itself) gives the wanted rows, and the outputs are
those rows with one error of a known size, in a known row, and one large error in a row left out as a near tie.
"""

from __future__ import annotations

import torch

from stepops.models import Step5Config, Step5Model
from stepops.testing.recompute import compare_with_recompute
from stepops.testing.step5_checkpoint import random_step5_checkpoint
from stepops.testing.step5_reference import step5_recompute
from stepops.testing.tolerances import Tolerance


def test_the_comparison_reports_known_errors_exactly():
    config = Step5Config(layer_types=("csa",), moe_layers=())
    checkpoint = random_step5_checkpoint(config, seed=0)
    model = Step5Model(config)  # not loaded: the recompute must read the state_dict it is given
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(n, config.hidden_size, generator=gen).to(torch.bfloat16) for n in (30, 12)]
    outputs = [step5_recompute(config, checkpoint, x)[0].clone() for x in inputs]  # clone: not inference tensors
    want_row = outputs[0][10].float()
    # The error in request 0's row 10, at its smallest element: relative to the row's binade (the power of
    # two at or below its largest |value|), which the error leaves unchanged.
    binade = 2.0 ** torch.floor(torch.log2(want_row.abs().max())).item()
    column = int(want_row.abs().argmin())
    outputs[0][10, column] += binade * 2**-5
    error = abs(float(outputs[0][10, column]) - float(want_row[column]))
    assert error > 0 and float(outputs[0][10].abs().max()) == float(want_row.abs().max())
    # A margin of 2 makes every choice between regions a near tie: request 0's rows 24..29, whose own region
    # 3 leaves more earlier regions than index_top_k, are left out, with the large error in row 28.
    outputs[0][28, 0] += 100.0

    def compare(atol: float, rtol: float = 0.0):
        return compare_with_recompute(
            model, inputs, outputs, near_tie_margin=2.0, state_dict=checkpoint,
            tolerance=Tolerance(atol=atol, rtol=rtol, why="the placed error"),
        )  # fmt: skip

    comparison = compare(error)
    assert (comparison.rows, comparison.near_tie_rows) == (42, 6)
    assert comparison.max_abs_err == error
    assert comparison.max_row_relative_err == error / binade
    assert comparison.differing_fraction == 1 / (36 * config.hidden_size)
    assert comparison.within_bound is True
    assert compare(error / 2).within_bound is False
    # rtol scales the recompute's |value| (the oracle's), not the output's, which the error made larger here.
    wanted, got = abs(float(want_row[column])), abs(float(outputs[0][10, column]))
    assert got > 1.1 * wanted > 0
    assert compare(0.0, rtol=1.01 * error / wanted).within_bound is True
    assert compare(0.0, rtol=0.99 * error / wanted).within_bound is False
