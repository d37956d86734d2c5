"""Sample inputs of ``stepops::paged_kv_write``, shared by opcheck, the tests and the benchmarks."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from stepops._library import ErrorInput, SampleInput, guarded


def _slots(num_blocks: int, block_size: int, num_tokens: int, num_padding: int, dtype, device, gen) -> torch.Tensor:
    """Distinct random slots for the real tokens, then ``-1`` for ``num_padding`` trailing padding tokens."""
    real = torch.randperm(num_blocks * block_size, generator=gen, device="cpu")[: num_tokens - num_padding]
    pad = torch.full((num_padding,), -1, dtype=torch.int64, device="cpu")
    return torch.cat([real, pad]).to(dtype=dtype, device=device)


def samples(device: torch.device) -> Iterator[SampleInput]:
    gen = torch.Generator().manual_seed(0)

    def make(name, *, tokens, heads, head_size, head_size_v, num_blocks, block_size, padding=0,
             dtype=torch.bfloat16, slot_dtype=torch.int32, page_stride_pad=0, key_from_fused=False,
             heads_from_fused=False):
        if key_from_fused:
            # key and value as column slices of one fused [T, H, D + Dv] projection: non-contiguous inputs.
            fused = torch.randn(tokens, heads, head_size + head_size_v, generator=gen, device="cpu")
            fused = fused.to(dtype).to(device)
            key, value = fused[:, :, :head_size], fused[:, :, head_size:]
        elif heads_from_fused:
            # key and value as head slices of one [T, 2H, D] tensor: a token stride of 2 H D, not H D.
            fused = torch.randn(tokens, 2 * heads, head_size, generator=gen, device="cpu").to(dtype).to(device)
            key, value = fused[:, :heads], fused[:, heads:]
        else:
            key = torch.randn(tokens, heads, head_size, generator=gen, device="cpu").to(dtype).to(device)
            value = torch.randn(tokens, heads, head_size_v, generator=gen, device="cpu").to(dtype).to(device)
        caches = []
        for d in (head_size, head_size_v):
            page = block_size * heads * d
            # page_stride_pad > 0: each block is a page-strided view into a wider buffer (as when several
            # layers' pages are unified); the gap between pages must never be written.
            base = torch.randn(num_blocks * (page + page_stride_pad), generator=gen, device="cpu").to(dtype).to(device)
            caches.append(base.as_strided((num_blocks, block_size, heads, d), (page + page_stride_pad, heads * d, d, 1)))
        slots = _slots(num_blocks, block_size, tokens, padding, slot_dtype, device, gen)
        return SampleInput(name, (key, value, caches[0], caches[1], slots))

    yield make("decode_t1", tokens=1, heads=2, head_size=8, head_size_v=8, num_blocks=4, block_size=4)
    yield make("ragged_padding", tokens=7, heads=2, head_size=16, head_size_v=16, num_blocks=6, block_size=4, padding=2)
    yield make("page_strided_int64", tokens=5, heads=3, head_size=8, head_size_v=4, num_blocks=5, block_size=2,
               slot_dtype=torch.int64, page_stride_pad=24)
    yield make("fused_noncontiguous_fp32", tokens=4, heads=1, head_size=6, head_size_v=10, num_blocks=3,
               block_size=4, dtype=torch.float32, key_from_fused=True)
    yield make("head_slices_of_fused_kv", tokens=3, heads=2, head_size=4, head_size_v=4, num_blocks=3, block_size=2,
               heads_from_fused=True)
    yield make("all_padding_fp16", tokens=3, heads=2, head_size=4, head_size_v=4, num_blocks=2, block_size=4,
               padding=3, dtype=torch.float16)
    yield make("empty_t0", tokens=0, heads=2, head_size=8, head_size_v=8, num_blocks=2, block_size=4)
    # A model-sized GQA layer (8 KV heads of 128): the configuration the GPU-build check must see compiled.
    yield make("model_heads_8x128", tokens=4, heads=8, head_size=128, head_size_v=128, num_blocks=2, block_size=16)
    # fp8 KV caches, e4m3 and e5m2 (the op copies bits of any dtype). float8_e4m3fnuz/e5m2fnuz take the same
    # one-byte copy (tests/ops/test_paged_kv_write.py); float8_e8m0fnu cannot run on CPU (no index_put for it).
    yield make("fp8_e4m3fn_padding", tokens=4, heads=2, head_size=8, head_size_v=8, num_blocks=3, block_size=4,
               padding=1, dtype=torch.float8_e4m3fn)
    yield make("fp8_e5m2_page_strided", tokens=3, heads=2, head_size=8, head_size_v=8, num_blocks=3, block_size=2,
               dtype=torch.float8_e5m2, page_stride_pad=16)


def error_inputs(device: torch.device) -> Iterator[ErrorInput]:
    """Bad calls and their errors: out-of-range and negative slots (with a valid token first, so a partial
    write would show), and each shape/dtype rule. Caches sit inside larger buffers (``guarded``)."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, dim = 3, 4, 2, 8
    num_slots = num_blocks * block_size

    def call(name, *, slots=(5, 0, -1), key_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, errors=None,
             key_shape=None, slot_dtype=torch.int32, value_cache_dtype=torch.bfloat16):
        tokens = len(slots)
        key = torch.randn(*(key_shape or (tokens, heads, dim)), generator=gen, device="cpu").to(key_dtype).to(device)
        value = torch.randn(tokens, heads, dim, generator=gen, device="cpu").to(torch.bfloat16).to(device)
        caches = [
            guarded(torch.randn(num_blocks, block_size, heads, dim, generator=gen, device="cpu").to(dtype).to(device))
            for dtype in (cache_dtype, value_cache_dtype)
        ]
        slot_mapping = torch.tensor(slots, dtype=slot_dtype, device=device)
        kwargs = {} if errors is None else {"errors": errors}
        return SampleInput(name, (key, value, *caches, slot_mapping), kwargs)

    slot_rule = rf"paged_kv_write: slot_mapping must be -1 or in \[0, {num_slots}\)"
    for name, bad in (("slot_one_past_the_end", num_slots), ("slot_1e7", 10**7), ("slot_minus_2", -2)):
        yield ErrorInput(call(name, slots=(5, bad, -1)), ValueError, slot_rule + rf"; got \[{bad}\]", data=True)
    yield ErrorInput(call("key_2d", key_shape=(3, heads * dim)), ValueError, r"paged_kv_write: key and value must be \[T, H, D\]")
    yield ErrorInput(call("float_slots", slot_dtype=torch.float32), TypeError, "slot_mapping must be int32 or int64")
    column = call("slot_mapping_2d")
    yield ErrorInput(
        SampleInput(column.name, (*column.args[:4], column.args[4][:, None])), ValueError,
        r"paged_kv_write: slot_mapping must be \[T\]; got \(3, 1\)",
    )  # fmt: skip
    yield ErrorInput(call("cache_dtype", cache_dtype=torch.float16), TypeError, "a cache must have its input's dtype")
    yield ErrorInput(
        call("value_cache_dtype", value_cache_dtype=torch.float16), TypeError, "a cache must have its input's dtype"
    )
    yield ErrorInput(call("token_count", key_shape=(2, heads, dim)), ValueError, "need the same token count")
    expanded = call("key_cache_expanded")
    key, value, key_cache, value_cache, slot_mapping = expanded.args
    expanded_args = (key, value, key_cache[:, :1].expand_as(key_cache), value_cache, slot_mapping)
    yield ErrorInput(
        SampleInput(expanded.name, expanded_args), ValueError,
        r"paged_kv_write: key_cache \(shape \(3, 4, 2, 8\), strides \(64, 0, 8, 1\)\) lets several",
    )  # fmt: skip
    one_cache = call("one_tensor_for_both_caches")
    key, value, key_cache, _, slot_mapping = one_cache.args
    yield ErrorInput(
        SampleInput(one_cache.name, (key, value, key_cache, key_cache, slot_mapping)), ValueError,
        "paged_kv_write: key_cache and value_cache are one tensor",
    )  # fmt: skip
    mismatched = call("caches_of_different_block_sizes")
    key, value, key_cache, value_cache, slot_mapping = mismatched.args
    yield ErrorInput(
        SampleInput(mismatched.name, (key, value, key_cache, value_cache[:, : block_size // 2], slot_mapping)),
        ValueError, r"key_cache and value_cache need the same \[num_blocks, block_size\]; got \(3, 4\) and \(3, 2\)",
    )  # fmt: skip
    yield ErrorInput(
        call("complex128_key", key_dtype=torch.complex128, cache_dtype=torch.complex128), TypeError,
        "paged_kv_write: copies elements of at most 8 bytes",
    )  # fmt: skip
    yield ErrorInput(
        call("errors_int64", errors=torch.zeros(1, dtype=torch.int64, device=device)), TypeError,
        "paged_kv_write: errors must be an int32 counter",
    )  # fmt: skip
