"""Argument checks and the fake for ``stepops::paged_kv_write``.

The checks use only sizes, dtypes and devices, so the fake (trace time) and both kernels (call time) share
them and a bad call fails the same way eagerly and under ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch.compiler import is_dynamo_compiling

from stepops._meta.accepted import ABSENT, AcceptedSignatures
from stepops._meta.errors import check_errors_arg
from stepops._meta.written import check_distinct, check_own_elements

_SLOT_DTYPES = (torch.int32, torch.int64)
_ACCEPTED = AcceptedSignatures()


def check_paged_kv_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    errors: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError``/``TypeError`` unless the shapes below hold.

    ``key [T, H, D]``, ``value [T, H, Dv]``, ``key_cache [num_blocks, N, H, D]``,
    ``value_cache [num_blocks, N, H, Dv]`` (same ``num_blocks`` and ``N >= 1``), ``slot_mapping [T]`` int32/int64,
    caches of the same dtype as their inputs, elements of at most 8 bytes, everything on one device;
    ``errors`` None or an int32 ``[1]``; caches that own their elements and are two tensors
    (``stepops._meta.written``).
    A call that repeats a recently accepted signature returns at once (``stepops._meta.accepted``).
    """
    if not is_dynamo_compiling():
        for accepted in _ACCEPTED.entries:
            if accepted.guards.check(
                key, value, key_cache, value_cache, slot_mapping, ABSENT if errors is None else errors
            ):
                if accepted is not _ACCEPTED.entries[0]:
                    _ACCEPTED.promote(accepted)
                return
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            f"paged_kv_write: key and value must be [T, H, D]; got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(
            "paged_kv_write: key_cache and value_cache must be [num_blocks, block_size, H, D]; got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if slot_mapping.dim() != 1:
        raise ValueError(f"paged_kv_write: slot_mapping must be [T]; got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in _SLOT_DTYPES:
        raise TypeError(f"paged_kv_write: slot_mapping must be int32 or int64; got {slot_mapping.dtype}")
    if key_cache.dtype != key.dtype or value_cache.dtype != value.dtype:
        raise TypeError(
            "paged_kv_write: a cache must have its input's dtype (the op copies bits); got key "
            f"{key.dtype} -> key_cache {key_cache.dtype}, value {value.dtype} -> value_cache {value_cache.dtype}"
        )
    if key.element_size() > 8 or value.element_size() > 8:
        raise TypeError(
            "paged_kv_write: copies elements of at most 8 bytes (each moves as one integer of its width; there is "
            f"no 16-byte integer); got key {key.dtype}, value {value.dtype}"
        )
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"paged_kv_write: all tensors must be on one device; got {sorted(map(str, devices))}")
    num_tokens = key.shape[0]
    # A plain comparison, not torch._check (which raises RuntimeError): user errors are ValueErrors. On
    # symbolic sizes it guards T like the other ops' checks do.
    if value.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            "paged_kv_write: key, value and slot_mapping need the same token count; got "
            f"{key.shape[0]}, {value.shape[0]}, {slot_mapping.shape[0]}"
        )
    if key.shape[1] != value.shape[1] or key.shape[1] != key_cache.shape[2] or value.shape[1] != value_cache.shape[2]:
        raise ValueError(
            "paged_kv_write: the head count H must agree: key "
            f"{key.shape[1]}, value {value.shape[1]}, key_cache {key_cache.shape[2]}, value_cache {value_cache.shape[2]}"
        )
    if key.shape[2] != key_cache.shape[3] or value.shape[2] != value_cache.shape[3]:
        raise ValueError(
            f"paged_kv_write: head sizes must agree: key {key.shape[2]} vs key_cache {key_cache.shape[3]}, "
            f"value {value.shape[2]} vs value_cache {value_cache.shape[3]}"
        )
    if key_cache.shape[1] < 1:
        raise ValueError(
            f"paged_kv_write: key_cache must have a block size N >= 1 (its shape[1]); got {tuple(key_cache.shape)}"
        )
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise ValueError(
            "paged_kv_write: key_cache and value_cache need the same [num_blocks, block_size]; got "
            f"{tuple(key_cache.shape[:2])} and {tuple(value_cache.shape[:2])}"
        )
    check_errors_arg("paged_kv_write", errors, key.device)
    check_own_elements("paged_kv_write", "key_cache", key_cache)
    check_own_elements("paged_kv_write", "value_cache", value_cache)
    check_distinct("paged_kv_write", ("key_cache", key_cache), ("value_cache", value_cache))
    _ACCEPTED.remember(
        (key, value, key_cache, value_cache, slot_mapping, ABSENT if errors is None else errors), written=(2, 3)
    )


# The op writes its caches and returns nothing, so its fake is its argument check (one frame less on
# every eager call's host path, which runs the same check).
paged_kv_write_fake = check_paged_kv_write_args
