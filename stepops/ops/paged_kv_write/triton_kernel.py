"""The Triton kernel of ``stepops::paged_kv_write`` (CUDA path).

One program per token copies the token's ``[H, D]`` key tile and ``[H, Dv]`` value tile into its slot. The
op is a pure copy: values are loaded and stored in their own dtype with no arithmetic, so the result is
bit-identical to the PyTorch kernel on a GPU and under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepops._meta.paged_kv_write import check_paged_kv_write_args
from stepops.ops.paged_kv_write.torch_kernel import as_bits
from stepops.ops.triton_bounds import bad_id, count_error, in_extent
from stepops.ops.triton_launch import MAX_TILE_NUMEL, CachedLaunch, next_power_of_2, tile_too_large


@triton.jit
def _paged_kv_write_kernel(
    key_ptr,  # [T, H, D], any dtype as integers of its width (see as_bits)
    value_ptr,  # [T, H, Dv]
    key_cache_ptr,  # [num_blocks, N, H, D], written
    value_cache_ptr,  # [num_blocks, N, H, Dv], written
    slot_mapping_ptr,  # [T] int32 or int64, -1 for padding
    errors_ptr,  # [1] int32, or any pointer when HAS_ERRORS is off
    block_size,
    num_slots,
    num_heads,
    head_size,
    head_size_v,
    key_stride_t,
    key_stride_h,
    key_stride_d,
    value_stride_t,
    value_stride_h,
    value_stride_d,
    key_cache_stride_b,
    key_cache_stride_n,
    key_cache_stride_h,
    key_cache_stride_d,
    value_cache_stride_b,
    value_cache_stride_n,
    value_cache_stride_h,
    value_cache_stride_d,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_ERRORS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Padding (slot -1) and a slot outside the caches write nothing (the latter is counted as an error):
    # every store below is masked by `write`, so the grid stays one program per token whatever the data.
    inside = in_extent(slot, num_slots)
    count_error(errors_ptr, bad_id(slot, num_slots), HAS_ERRORS)
    block = tl.where(inside, slot // block_size, 0)
    offset = tl.where(inside, slot % block_size, 0)
    heads = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)  # a head stride may exceed 2**31 / BLOCK_H (head-major)
    head_ok = heads < num_heads
    # A [BLOCK_H, 1] tensor rather than a scalar: the interpreter rejects a scalar bool in a mask.
    write = in_extent(heads * 0 + slot, num_slots)

    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = head_ok & (dims < head_size)
    k = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims * key_stride_d, mask=mask)
    k_dst = key_cache_ptr + block * key_cache_stride_b + offset * key_cache_stride_n
    tl.store(k_dst + heads * key_cache_stride_h + dims * key_cache_stride_d, k, mask=mask & write)

    dims_v = tl.arange(0, BLOCK_DV)[None, :]
    mask_v = head_ok & (dims_v < head_size_v)
    v = tl.load(value_ptr + token * value_stride_t + heads * value_stride_h + dims_v * value_stride_d, mask=mask_v)
    v_dst = value_cache_ptr + block * value_cache_stride_b + offset * value_cache_stride_n
    tl.store(v_dst + heads * value_cache_stride_h + dims_v * value_cache_stride_d, v, mask=mask_v & write)


_launch_paged_kv_write = CachedLaunch(_paged_kv_write_kernel)


def paged_kv_write_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    errors: torch.Tensor | None = None,
) -> None:
    """Launch one program per token; the grid depends only on ``T`` (see the PyTorch kernel for semantics)."""
    check_paged_kv_write_args(key, value, key_cache, value_cache, slot_mapping, errors)
    num_tokens, num_heads, head_size = key.shape
    # At least 1: a zero-sized H, D or Dv (e.g. Dv = 0 for a packed latent) is a fully masked tile.
    head_size_v = value.shape[2]
    block_h = max(next_power_of_2(num_heads), 1)
    block_d = max(next_power_of_2(head_size), 1)
    block_dv = max(next_power_of_2(head_size_v), 1)
    tile_width = max(block_d, block_dv)
    if block_h * tile_width > MAX_TILE_NUMEL:
        raise tile_too_large("paged_kv_write", block_h, tile_width, H=num_heads, D=head_size, Dv=head_size_v)
    if num_tokens == 0:
        return
    # The kernel reads slot t at `slot_mapping + t`: a strided [T] view (e.g. a column of a [T, k] table)
    # becomes a contiguous copy, never a read of other tokens' slots.
    slot_mapping = slot_mapping.contiguous()
    # The op copies bits: the kernel moves them as integers of the same width (a view, same strides), so
    # any dtype takes the same copy. Passed as they are, float8_e4m3fnuz/e5m2fnuz caches ran under the
    # interpreter but do not compile for sm_90 or sm_80, and float8_e8m0fnu or complex64 have no Triton type.
    key, value, key_cache, value_cache = (as_bits(t) for t in (key, value, key_cache, value_cache))
    _launch_paged_kv_write(
        (num_tokens,),
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        slot_mapping if errors is None else errors,  # any pointer when there is no counter: never touched
        key_cache.shape[1],
        key_cache.shape[0] * key_cache.shape[1],
        num_heads,
        head_size,
        head_size_v,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        HAS_ERRORS=errors is not None,
        # Triton's default, stated: 128 threads x 8 bf16 (one 128-bit access each) cover a model-sized
        # [8, 128] head tile in one pass; a pure copy needs no more threads per token.
        num_warps=4,
        # A bit copy has nothing to fuse; stated, as every stepops launch states it (Triton 3.9 warns when a
        # launch leaves it to a default that Triton 3.10 changes).
        enable_fp_fusion=False,
    )
