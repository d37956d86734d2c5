"""The host validator of ``stepops::paged_kv_write`` (``validate=True``): data checks that need a sync."""

from __future__ import annotations

import torch

from stepops._meta.paged_kv_write import check_paged_kv_write_args
from stepops.ops.bounds import check_ids


@torch.compiler.disable
def validate_paged_kv_write_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Host-side data checks of a paged_kv_write call; ``ValueError``. Syncs, so it runs outside any graph."""
    check_paged_kv_write_args(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.to(torch.int64).cpu()
    check_ids("paged_kv_write", "slot_mapping", slots, key_cache.shape[0] * key_cache.shape[1])
    real = slots[slots >= 0]
    if real.unique().numel() != real.numel():
        raise ValueError("paged_kv_write: slot_mapping gives two tokens of one call the same slot; slots must be distinct")
