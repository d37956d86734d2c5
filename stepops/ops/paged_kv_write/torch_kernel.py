"""The PyTorch kernel of ``stepops::paged_kv_write``: the readable specification (and the CPU path)."""

from __future__ import annotations

import torch

from stepops._meta.paged_kv_write import check_paged_kv_write_args
from stepops.ops.bounds import IdCheck, any_bad_ids, bad_ids_error
from stepops.ops.put_rows import put_rows_

# Integer dtype of each element size: what the Triton kernel copies, and this kernel for the dtypes that
# index_put has no CPU kernel for (uint16-64, float8_e8m0fnu, float4_e2m1fn_x2, the bits dtypes).
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The dtypes index_put copies bit for bit, eagerly and compiled by Inductor (NaN payloads included), which
# this kernel writes in their own dtype: Inductor miscompiles a put through an integer view of a float
# input (it converts the integers' values to floats), so the view is kept to the dtypes that need it.
_PUT_NATIVELY = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
})  # fmt: skip


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (same shape and strides); the argument check refuses
    elements wider than 8 bytes."""
    return t.view(_BITS_DTYPES[t.element_size()])


def _puttable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where index_put copies its dtype, else :func:`as_bits` of it."""
    return t if t.dtype in _PUT_NATIVELY else as_bits(t)


def paged_kv_write_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    errors: torch.Tensor | None = None,
) -> None:
    """Store each token's key and value rows at its slot of a paged KV cache.

    Shapes: ``key [T, H, D]``, ``value [T, H, Dv]``; ``key_cache [num_blocks, N, H, D]`` and
    ``value_cache [num_blocks, N, H, Dv]`` (NHD pages of ``N`` tokens; any strides, e.g. a page-strided view
    of a larger buffer); ``slot_mapping [T]`` int32/int64. Caches have their input's dtype: the op copies bits.

    Semantics: for every token ``t`` with ``slot = slot_mapping[t] >= 0``,
    ``key_cache[slot // N, slot % N] = key[t]`` and ``value_cache[slot // N, slot % N] = value[t]``.
    ``slot = -1`` marks a padding token and writes nothing; nothing but the named slots is written.

    Every slot must be ``-1`` or in ``[0, num_blocks * N)`` (``stepops.ops.bounds``): this kernel raises a
    ``ValueError`` before writing anything; the Triton kernel writes nothing for such a token and counts it
    in ``errors`` (int32 ``[1]``, optional; never written here). No two tokens of one call may share a slot
    (which one would win is unspecified); the wrapper's ``validate=True`` checks that on the host.
    """
    check_paged_kv_write_args(key, value, key_cache, value_cache, slot_mapping, errors)
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    checks = (IdCheck("slot_mapping", slots, key_cache.shape[0] * block_size),)
    if bool(any_bad_ids(checks)):  # the one host read (stepops.ops.bounds)
        raise bad_ids_error("paged_kv_write", checks)
    index = (slots // block_size, slots % block_size)
    put_rows_(_puttable(key_cache), index, _puttable(key), slots >= 0)
    put_rows_(_puttable(value_cache), index, _puttable(value), slots >= 0)
