"""Sample inputs of ``stepops::paged_kv_write``, shared by opcheck, the tests and the benchmarks."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from stepops._library import SampleInput


def _slots(num_blocks: int, block_size: int, num_tokens: int, num_padding: int, dtype, device, gen) -> torch.Tensor:
    """Distinct random slots for the real tokens, then ``-1`` for ``num_padding`` trailing padding tokens."""
    real = torch.randperm(num_blocks * block_size, generator=gen)[: num_tokens - num_padding]
    pad = torch.full((num_padding,), -1, dtype=torch.int64)
    return torch.cat([real, pad]).to(dtype=dtype, device=device)


def paged_kv_write_samples(device: torch.device) -> Iterator[SampleInput]:
    gen = torch.Generator().manual_seed(0)

    def make(name, *, tokens, heads, head_size, head_size_v, num_blocks, block_size, padding=0,
             dtype=torch.bfloat16, slot_dtype=torch.int32, page_stride_pad=0, key_from_fused=False):
        if key_from_fused:
            # key and value as column slices of one fused [T, H, D + Dv] projection: non-contiguous inputs.
            fused = torch.randn(tokens, heads, head_size + head_size_v, generator=gen).to(dtype).to(device)
            key, value = fused[:, :, :head_size], fused[:, :, head_size:]
        else:
            key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype).to(device)
            value = torch.randn(tokens, heads, head_size_v, generator=gen).to(dtype).to(device)
        caches = []
        for d in (head_size, head_size_v):
            page = block_size * heads * d
            # page_stride_pad > 0: each block is a page-strided view into a wider buffer (as when several
            # layers' pages are unified); the gap between pages must never be written.
            base = torch.randn(num_blocks * (page + page_stride_pad), generator=gen).to(dtype).to(device)
            caches.append(base.as_strided((num_blocks, block_size, heads, d), (page + page_stride_pad, heads * d, d, 1)))
        slots = _slots(num_blocks, block_size, tokens, padding, slot_dtype, device, gen)
        return SampleInput(name, (key, value, caches[0], caches[1], slots))

    yield make("decode_t1", tokens=1, heads=2, head_size=8, head_size_v=8, num_blocks=4, block_size=4)
    yield make("ragged_padding", tokens=7, heads=2, head_size=16, head_size_v=16, num_blocks=6, block_size=4, padding=2)
    yield make("page_strided_int64", tokens=5, heads=3, head_size=8, head_size_v=4, num_blocks=5, block_size=2,
               slot_dtype=torch.int64, page_stride_pad=24)
    yield make("fused_noncontiguous_fp32", tokens=4, heads=1, head_size=6, head_size_v=10, num_blocks=3,
               block_size=4, dtype=torch.float32, key_from_fused=True)
    yield make("all_padding_fp16", tokens=3, heads=2, head_size=4, head_size_v=4, num_blocks=2, block_size=4,
               padding=3, dtype=torch.float16)
    # A model-sized GQA layer (8 KV heads of 128): the configuration the GPU-build check must see compiled.
    yield make("model_heads_8x128", tokens=4, heads=8, head_size=128, head_size_v=128, num_blocks=2, block_size=16)
