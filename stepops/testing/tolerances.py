"""The one per-comparison tolerance table. Each entry says why it is as wide as it is.

Bitwise comparisons (chunk invariance, incremental vs dense recompute with the same arithmetic order,
Triton interpreter vs PyTorch kernel) use ``torch.equal``, not this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    why: str


TOLERANCES: dict[str, Tolerance] = {}
