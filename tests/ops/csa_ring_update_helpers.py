"""Helpers shared by the ``csa_ring_update`` test modules: special logits for the fold, bit comparisons, the
textbook summary. Not a test module (pytest collects ``test_*.py`` only); the test modules import it by
name, as they import ``conftest``."""

from __future__ import annotations

import numpy as np
import torch


def fp32_bits(x) -> np.ndarray:
    """The uint32 bit patterns of ``x`` as fp32."""
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def special_logits(num_columns: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, z`` ``[8, num_columns]`` fp32 with NaN, ``+inf`` and ``-inf`` logits in every row and mix: one in
    a random row per column, row 0 only, a column of ``-inf``, ``-inf`` followed by finite rows."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(8, num_columns, generator=generator).bfloat16().float()
    k = torch.randn(8, num_columns, generator=generator).bfloat16().float()
    rows = torch.randint(0, 8, (num_columns,), generator=generator)
    columns = torch.arange(num_columns)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    z[rows, columns] = specials[columns % 4]  # one special value per column, in a random row
    z[0, 1::16] = float("nan")
    z[0, 2::16] = float("inf")
    z[:, 3::16] = -float("inf")
    z[:4, 4::16] = -float("inf")
    return k, z


def assert_same_bits_or_both_nan(got: np.ndarray, want: np.ndarray) -> None:
    """Equal fp32 bits wherever ``want`` is a number, NaN exactly where it is NaN (whose payload is the
    platform's)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"NaN at {np.flatnonzero(np.isnan(got) != nan)[:8]}"
    assert np.array_equal(fp32_bits(got[~nan]), fp32_bits(want[~nan]))


def softmax_summary(k_rows: torch.Tensor, z_rows: torch.Tensor) -> torch.Tensor:
    """The textbook formula in fp64: ``sum_t softmax(z, 0)_t * k_t``."""
    return (torch.softmax(z_rows.double(), 0) * k_rows.double()).sum(0)


def summary_bytes(summary_cache: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a summary cache (int16 for bf16, uint8 for fp8), for ``torch.equal`` bit for bit
    (NaN payloads included)."""
    return summary_cache.view(torch.int16 if summary_cache.dtype == torch.bfloat16 else torch.uint8)
