"""The naive reference of ``stepops::paged_kv_write``: token by token, one row assignment per cache.

Independent of :mod:`stepops.ops.paged_kv_write.torch_kernel` (no index tensors); used by the op tests and
the benchmark's naive provider.
"""

from __future__ import annotations

import torch


def paged_kv_write_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``torch.ops.stepops.paged_kv_write``'s arguments and effect: ``key[t, h]`` to
    ``key_cache[slot // N, slot % N, h]`` (``value`` likewise) for every token whose slot is not -1."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot != -1:
            key_cache[slot // block_size, slot % block_size] = key[t]
            value_cache[slot // block_size, slot % block_size] = value[t]
