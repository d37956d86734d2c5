"""Model outputs vs a full recompute without caches, leaving out (and counting) near-tie region choices.

Step5 is recomputed by :func:`stepops.testing.step5_reference.step5_recompute` from a checkpoint in the
reference's names (by default the model's own ``state_dict()``); Inkling by
:func:`stepops.testing.inkling_reference.inkling_layer_reference`.

Two ways to compare: :func:`compare_with_recompute` recomputes the whole stack from each request's inputs
(end to end), :func:`compare_layers_with_recompute` recomputes each layer from the inputs the model's own
layer got (:class:`CommittedLayerRows`, teacher forced). End to end, a near-tie region choice in one layer
marks every later row of its request and one-ulp differences feed every later layer, so deep stacks leave
out most rows; layer by layer, each layer is held to one layer's bound and a near tie marks only its row
in that layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from stepops.models.inkling import InklingModel
from stepops.models.runner import ScheduledRequest, StepRunner
from stepops.models.step5 import Step5Model
from stepops.testing.inkling_reference import inkling_layer_reference
from stepops.testing.step5_reference import recompute_layer, step5_recompute
from stepops.testing.tolerances import Tolerance

# Region choices closer than this (relative to the token's largest candidate score) may go either way between
# two correct implementations: a score is a sum over the group's indexer heads of products of e4m3-rounded
# inputs, and an input one bf16 ulp apart (another sum order upstream) can land on the next e4m3 code. A
# flipped choice changes the token's attention by O(1). Measured, not derived: on CPU no flip outside 2**-10
# over the named configs' long runs (one drawn config flipped one end to end: see
# test_step5_random_configs_match_the_recompute_layer_by_layer); on an H200 (torch 2.11, Triton 3.6) every row
# of the 17 Step5 workloads of tests/models/test_incremental.py was within model_vs_recompute with no row left
# out at all. At 2**-10 at most 22 of 240 rows are left out (a CSA layer first); 2**-5 left out up to 150 of
# 240 on either device.
NEAR_TIE_MARGIN = 2**-10
# Left-out rows must stay few, or the comparison would say little: at NEAR_TIE_MARGIN, none of the 93 rows of
# the short workloads and at most 22 of 240 of the long ones (a near tie in a CSA layer before the last marks
# every later row of the request), the same rows on CPU and on the H200.
MAX_NEAR_TIE_FRACTION = 1 / 10


def model_reference_with_near_ties(
    model: Step5Model | InklingModel,
    x: torch.Tensor,
    near_tie_margin: float | None = NEAR_TIE_MARGIN,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recompute of one request's inputs ``x [L, hidden]`` and ``[L]`` bool: the rows whose output
    depends on a near-tie region choice (``near_tie_margin=None`` marks nothing; Inkling marks nothing).
    ``state_dict``: the Step5 checkpoint to recompute from (default: ``model.state_dict()``)."""
    if isinstance(model, Step5Model):
        return step5_recompute(model.config, state_dict or model.state_dict(), x, near_tie_margin)
    with torch.inference_mode():
        for layer in model.layers:
            x = inkling_layer_reference(layer, x)
    return x, torch.zeros(x.shape[0], dtype=torch.bool)


@dataclass(frozen=True)
class RecomputeComparison:
    """Committed outputs of a run vs the recompute, over the rows that do not depend on a near tie.

    ``max_abs_err``: largest ``|incremental - recompute|``; ``max_row_relative_err``: largest error relative
    to its token's scale, the power of two at or below the row's largest ``|recompute|`` (one bf16 ulp there
    is ``2**-7`` of it); ``differing_fraction``: the share of compared elements that differ at all;
    ``within_bound``: whether every compared element is inside the given tolerance's ``atol + rtol *
    |recompute|`` (``None`` without one); ``near_tie_rows`` of ``rows`` were left out.
    """

    max_abs_err: float
    max_row_relative_err: float
    differing_fraction: float
    within_bound: bool | None
    rows: int
    near_tie_rows: int


class _ErrorStats:
    """The running figures of a :class:`RecomputeComparison`."""

    def __init__(self, tolerance: Tolerance | None) -> None:
        self.tolerance = tolerance
        self.worst = self.worst_relative = 0.0
        self.differing = self.compared = self.rows = self.near_tie_rows = 0
        self.inside = True

    def add(self, got: torch.Tensor, want: torch.Tensor, near_tie: torch.Tensor) -> None:
        """One request's rows ``[L, hidden]``, leaving out those marked in ``near_tie [L]``."""
        keep = ~near_tie.cpu()
        want, got = want.cpu().float()[keep], got.cpu().float()[keep]
        self.rows += near_tie.shape[0]
        self.near_tie_rows += int(near_tie.sum())
        if not keep.any():
            return
        err = (got - want).abs()
        self.worst = max(self.worst, float(err.max()))
        # 2**e with 2**e <= m < 2**(e + 1) for the row's largest magnitude m (frexp: m = f * 2**E, f in [0.5, 1)).
        row_max = want.abs().amax(1, keepdim=True).clamp(min=torch.finfo(torch.bfloat16).tiny)
        binade = torch.ldexp(torch.ones_like(row_max), torch.frexp(row_max).exponent - 1)
        self.worst_relative = max(self.worst_relative, float((err / binade).max()))
        self.differing += int((err > 0).sum())
        self.compared += err.numel()
        if self.tolerance is not None:
            self.inside &= bool((err <= self.tolerance.atol + self.tolerance.rtol * want.abs()).all())

    def result(self) -> RecomputeComparison:
        return RecomputeComparison(
            max_abs_err=self.worst,
            max_row_relative_err=self.worst_relative,
            differing_fraction=self.differing / max(self.compared, 1),
            within_bound=self.inside if self.tolerance is not None else None,
            rows=self.rows,
            near_tie_rows=self.near_tie_rows,
        )


def compare_with_recompute(
    model: Step5Model | InklingModel,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    *,
    tolerance: Tolerance | None = None,
    near_tie_margin: float | None = NEAR_TIE_MARGIN,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> RecomputeComparison:
    """Compare each request's committed ``outputs`` (``[L, hidden]``) with the recompute of its ``inputs`` on
    ``model``'s device, leaving out the rows of near-tie region choices (:func:`model_reference_with_near_ties`)."""
    device = next(model.parameters()).device
    stats = _ErrorStats(tolerance)
    for x, y in zip(inputs, outputs):
        want, near_tie = model_reference_with_near_ties(model, x.to(device), near_tie_margin, state_dict)
        stats.add(y, want, near_tie)
    return stats.result()


class CommittedLayerRows:
    """Each decoder layer's input and output rows of every request of a run, as the step that committed
    them fed them: what that layer's caches were written from.

    A context manager: inside it, ``runner.step`` records and every layer of ``runner.model`` is hooked.
    A position fed again (a rejected draft's, refed by a later step) is overwritten, and a committed
    position is never fed again, so after the run each committed position holds its committing step's rows.
    Rows past a request's ``length`` (drafts beyond its end) are dropped. Leaving the block unhooks, then
    raises ``ValueError`` if some position below a request's length was never fed. The hooks see eager
    layers only: a compiled or captured step runs none, and its step is a ``ValueError``.

    ``inputs[i][r]`` and ``outputs[i][r]``: layer ``i``'s rows ``[lengths[r], hidden]`` (CPU, the layer's
    dtype: Step5's fp32 residual stream, Inkling's bf16 hidden states) for request slot ``r``.
    """

    def __init__(self, runner: StepRunner, lengths: Sequence[int]) -> None:
        self._runner = runner
        self._layers = list(runner.model.layers)
        self.inputs: list[list[torch.Tensor | None]] = [[None] * len(lengths) for _ in self._layers]
        self.outputs: list[list[torch.Tensor | None]] = [[None] * len(lengths) for _ in self._layers]
        self._fed = [torch.zeros(length, dtype=torch.bool) for length in lengths]
        self._step_rows: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._hooks: list = []
        self._step = runner.step

    def __enter__(self) -> CommittedLayerRows:
        self._hooks = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self._layers)]
        self._runner.step = self._recording_step
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        for hook in self._hooks:
            hook.remove()
        self._runner.step = self._step
        if exc_type is None and not all(fed.all() for fed in self._fed):
            missing = [slot for slot, fed in enumerate(self._fed) if not fed.all()]
            raise ValueError(f"CommittedLayerRows: request slots {missing} have positions no step fed")

    def _hook(self, index: int):
        def record(module, args, output):
            self._step_rows[index] = (args[0].detach().cpu(), output.detach().cpu())

        return record

    def _recording_step(self, batch: Sequence[ScheduledRequest]) -> list[torch.Tensor]:
        self._step_rows = [None] * len(self._layers)
        outputs = self._step(batch)
        if any(rows is None for rows in self._step_rows):
            raise ValueError("CommittedLayerRows: a layer ran no hook in this step (a compiled or captured step?)")
        offset = 0
        for scheduled in batch:
            n, slot, start = len(scheduled.inputs), scheduled.slot, scheduled.start
            end = min(start + n, self._fed[slot].shape[0])
            self._fed[slot][start:end] = True
            for index, (x, y) in enumerate(self._step_rows):
                for table, rows in ((self.inputs[index], x), (self.outputs[index], y)):
                    if table[slot] is None:
                        table[slot] = rows.new_zeros(self._fed[slot].shape[0], rows.shape[1])
                    table[slot][start:end] = rows[offset : offset + end - start]
            offset += n
        return outputs


def compare_layers_with_recompute(
    model: Step5Model | InklingModel,
    rows: CommittedLayerRows,
    *,
    tolerance: Tolerance | None = None,
    near_tie_margin: float | None = NEAR_TIE_MARGIN,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> list[RecomputeComparison]:
    """Per layer ``i``: the recompute of layer ``i`` alone, fed each request's committed inputs of the model's
    layer ``i`` (teacher forced), against that layer's committed outputs. A near-tie region choice leaves out
    its row in that layer only. ``state_dict``: the Step5 checkpoint (default: ``model.state_dict()``)."""
    device = next(model.parameters()).device
    state = (state_dict or model.state_dict()) if isinstance(model, Step5Model) else None
    comparisons = []
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            stats = _ErrorStats(tolerance)
            for x, y in zip(rows.inputs[i], rows.outputs[i]):
                x = x.to(device)
                if state is not None:
                    want, near_tie = recompute_layer(model.config, state, i, x, near_tie_margin)
                else:
                    want, near_tie = inkling_layer_reference(layer, x), torch.zeros(x.shape[0], dtype=torch.bool)
                stats.add(y, want, near_tie)
            comparisons.append(stats.result())
    return comparisons
