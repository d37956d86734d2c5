"""Masked row writes with shapes that do not depend on the data, for the PyTorch kernels.

``dest[index[keep]] = values[keep]`` selects rows with a boolean mask: its size is known only after a
``nonzero``, which splits a ``torch.compile`` graph. :func:`put_rows_` writes every row instead and makes
the rows outside the mask harmless, so a compiled kernel stays one graph with static shapes.
"""

from __future__ import annotations

import torch


def put_rows_(dest: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor, keep: torch.Tensor) -> None:
    """``dest[index] = values`` for the rows ``t`` with ``keep[t]``; nothing else of ``dest`` is written.

    ``index`` holds ``[T]`` int64 tensors, one per leading dim of ``dest``; ``values`` is ``[T, ...]`` in
    ``dest``'s dtype, ``keep`` a ``[T]`` bool mask. A row outside ``keep`` may have any index: it repeats
    the first kept row (its index and its value, so the duplicate writes the same bits); when no row is
    kept, every row copies ``dest``'s first element onto itself. Kept rows must have distinct indices, as
    for any put. Rows are only gathered and copied, never selected with ``where``: compiled, a float
    select may change a NaN's payload.
    """
    if keep.numel() == 0 or dest.numel() == 0:  # no row, or no row that could be valid
        return
    num_rows = keep.numel()
    first = keep.to(torch.int32).argmax()  # the first kept row; 0 when none is
    any_kept = keep.any()
    row = torch.where(keep, torch.arange(num_rows, device=keep.device), first)
    target = tuple(torch.where(any_kept, i[row], 0) for i in index)
    origin = dest[(0,) * len(index)]
    source = torch.cat([values, origin.unsqueeze(0)])  # row num_rows: dest's first element
    dest[target] = source[torch.where(any_kept, row, num_rows)]
