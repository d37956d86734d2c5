"""Sample inputs of ``stepops::sconv`` for opcheck, the tests and the benchmarks.

Most samples use one small Inkling layout (2 KV heads, head_dim 8, hidden 32, W = 4, so D = 64 with the
streams K [0, 8), V [8, 16), attention output [16, 32), MLP output [32, 48)) and cover: T = 1, ragged
steps mixing prefill, decode and verify tokens, padding, block-boundary crossings, random block tables,
an enlarged block size (N = 8W), all four streams, K and V in one call (as the models run them), residual
on/off, SiLU, fp32 weights, tap-major weights (stride 1 along channels, as the models store them) and a
page-strided cache. With 3 KV heads of a 16-channel K+V range, one Triton program covers several heads and
masks the heads past H. Two use widths the Triton kernel must mask: 12 and 20 channels per head (not powers
of two, so part of each channel block is masked off) and 1100 (wider than the kernel's 1024-channel block,
so a second, partly masked program per head runs). Three more use the illustrative production layout
(D = 2048: K alone, 128 wide; K+V, 256; MLP output, 512) so that the GPU-build check compiles the kernel
configurations a real model launches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import accumulate

import torch

from stepops._library import ErrorInput, SampleInput, guarded
from stepops.layouts import INKLING_EXAMPLE_LAYOUT, InklingConvStateLayout, InklingStream
from stepops.ops.sconv.metadata import SconvMetadata, build_sconv_metadata

SAMPLE_LAYOUT = InklingConvStateLayout(num_kv_heads=2, head_dim=8, hidden_size=32, kernel_size=4)
# Widths 12 (K, V) and 20 (attention and MLP output): channel blocks of 16 and 32 with masked lanes.
ODD_WIDTH_LAYOUT = InklingConvStateLayout(num_kv_heads=2, head_dim=12, hidden_size=40, kernel_size=4)
# MLP output width 1100 > the Triton kernel's 1024-channel block: two programs per head, the second 76 wide.
WIDE_LAYOUT = InklingConvStateLayout(num_kv_heads=1, head_dim=8, hidden_size=1100, kernel_size=4)
# 3 KV heads: a Triton program spans several heads (16-channel K+V ranges), the last ones masked.
THREE_HEAD_LAYOUT = InklingConvStateLayout(num_kv_heads=3, head_dim=8, hidden_size=48, kernel_size=4)
KV = (InklingStream.K, InklingStream.V)  # the models' one call for both


def random_block_table(
    num_requests: int, max_blocks: int, num_blocks: int, *, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """``[num_requests, max_blocks]`` int32 of distinct random blocks in ``[0, num_blocks)``."""
    if num_requests * max_blocks > num_blocks:
        raise ValueError(f"{num_requests} x {max_blocks} distinct blocks do not fit in {num_blocks}")
    blocks = torch.randperm(num_blocks, generator=generator, device="cpu")[: num_requests * max_blocks]
    return blocks.view(num_requests, max_blocks).to(device=device, dtype=torch.int32)


def sample_cache(
    shape: Sequence[int], *, block_gap: int = 0, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Random bf16 cache ``[num_blocks, H, N, D]``; ``block_gap > 0`` makes it a page-strided view.

    With a gap, block ``b`` starts ``b * (H * N * D + block_gap)`` elements into a larger buffer, as when
    the engine hands over a view of a page that is larger than this layer's block.
    """
    num_blocks, heads, block_size, head_size = shape
    block = heads * block_size * head_size
    buffer = torch.randn(num_blocks, block + block_gap, generator=generator, device="cpu")
    buffer = buffer.to(device=device, dtype=torch.bfloat16)
    return buffer[:, :block].view(num_blocks, heads, block_size, head_size)


def step_metadata(
    prior_lens: Sequence[int],
    new_lens: Sequence[int],
    block_table: torch.Tensor,
    block_size: int,
    num_tokens: int,
) -> SconvMetadata:
    """Metadata of a step in which request ``r`` had ``prior_lens[r]`` tokens and adds ``new_lens[r]``."""
    device = block_table.device
    query_start_loc = torch.tensor([0, *accumulate(new_lens)], dtype=torch.int32, device="cpu")
    seq_lens = torch.tensor([p + n for p, n in zip(prior_lens, new_lens)], dtype=torch.int32, device="cpu")
    return build_sconv_metadata(query_start_loc.to(device), seq_lens.to(device), block_table, block_size, num_tokens)


def _sample(
    name: str,
    device: torch.device,
    *,
    seed: int,
    prior_lens: Sequence[int],
    new_lens: Sequence[int],
    num_tokens: int,
    stream: InklingStream | tuple[InklingStream, ...],
    block_size: int | None = None,
    block_gap: int = 0,
    weight_dtype: torch.dtype = torch.bfloat16,
    tap_major: bool = False,
    channel_major_x: bool = False,
    residual: bool = True,
    silu: bool = False,
    layout: InklingConvStateLayout = SAMPLE_LAYOUT,
    num_blocks: int = 64,
) -> SampleInput:
    generator = torch.Generator().manual_seed(seed)
    offset, width = layout.stream_range(stream)
    shape = layout.cache_shape(num_blocks=num_blocks, block_size=block_size)
    n = shape[2]
    max_blocks = max((-(-(p + k) // n) for p, k in zip(prior_lens, new_lens)), default=1)
    block_table = random_block_table(len(new_lens), max_blocks, shape[0], generator=generator, device=device)
    metadata = step_metadata(prior_lens, new_lens, block_table, n, num_tokens)
    channels = layout.local_num_kv_heads * width
    x = torch.randn(num_tokens, channels, generator=generator, device="cpu").to(device=device, dtype=torch.bfloat16)
    if channel_major_x:  # y is still a new token-major tensor, whatever x's strides
        x = x.t().contiguous().t()
    weight = torch.randn(channels, layout.kernel_size, generator=generator, device="cpu")
    weight = weight.to(device=device, dtype=weight_dtype)
    if tap_major:
        weight = weight.t().contiguous().t()
    cache = sample_cache(shape, block_gap=block_gap, generator=generator, device=device)
    return SampleInput(
        name,
        (x, weight, cache, block_table, *metadata, offset),
        {"residual": residual, "silu": silu},
    )


def samples(device: torch.device) -> Iterator[SampleInput]:
    """The sconv sample registry (fresh tensors on every call)."""
    yield _sample("decode_t1", device, seed=0, prior_lens=[5], new_lens=[1], num_tokens=1, stream=InklingStream.K)
    yield _sample(
        "ragged_prefill_decode_verify_padded",
        device,
        seed=1,
        prior_lens=[0, 9, 6],
        new_lens=[7, 1, 4],
        num_tokens=16,
        stream=InklingStream.V,
    )
    yield _sample(
        "enlarged_block_8w",
        device,
        seed=2,
        prior_lens=[30, 0],
        new_lens=[5, 3],
        num_tokens=8,
        stream=InklingStream.ATTN_OUT,
        block_size=8 * SAMPLE_LAYOUT.kernel_size,
    )
    yield _sample(
        "mlp_out_no_residual",
        device,
        seed=3,
        prior_lens=[2, 11],
        new_lens=[3, 1],
        num_tokens=5,
        stream=InklingStream.MLP_OUT,
        residual=False,
    )
    yield _sample(
        "silu_fp32_weight",
        device,
        seed=4,
        prior_lens=[3, 0],
        new_lens=[2, 6],
        num_tokens=9,
        stream=InklingStream.K,
        weight_dtype=torch.float32,
        silu=True,
    )
    yield _sample(
        "page_strided_cache",
        device,
        seed=5,
        prior_lens=[7, 1],
        new_lens=[4, 2],
        num_tokens=6,
        stream=InklingStream.V,
        block_gap=96,
    )
    yield _sample(
        "k_plus_v_three_heads_tap_major",
        device,
        seed=18,
        prior_lens=[6, 0, 3],
        new_lens=[1, 4, 2],
        num_tokens=8,
        stream=KV,
        weight_dtype=torch.float32,
        tap_major=True,
        layout=THREE_HEAD_LAYOUT,
    )
    yield _sample(
        "channel_major_x", device, seed=19, prior_lens=[4, 1], new_lens=[3, 2], num_tokens=6, stream=InklingStream.V,
        channel_major_x=True,
    )  # fmt: skip
    yield _sample("empty_t0", device, seed=15, prior_lens=[3], new_lens=[0], num_tokens=0, stream=InklingStream.K)
    yield _sample("no_requests_r0", device, seed=16, prior_lens=[], new_lens=[], num_tokens=2, stream=InklingStream.V)
    yield _sample(
        "padding_only", device, seed=6, prior_lens=[4], new_lens=[0], num_tokens=3, stream=InklingStream.ATTN_OUT
    )
    for stream in (InklingStream.K, InklingStream.ATTN_OUT):
        yield _sample(
            f"odd_width_{ODD_WIDTH_LAYOUT.stream_range(stream)[1]}_{stream.name.lower()}",
            device,
            seed=10 + stream,
            prior_lens=[5, 0, 2],
            new_lens=[2, 3, 1],
            num_tokens=7,
            stream=stream,
            layout=ODD_WIDTH_LAYOUT,
            num_blocks=8,
        )
    yield _sample(
        "wide_1100_mlp_out",
        device,
        seed=14,
        prior_lens=[5, 0],
        new_lens=[1, 2],
        num_tokens=4,
        stream=InklingStream.MLP_OUT,
        layout=WIDE_LAYOUT,
        num_blocks=4,
    )
    for i, (name, stream) in enumerate((("k", InklingStream.K), ("k_plus_v", KV), ("mlp_out", InklingStream.MLP_OUT))):
        yield _sample(
            f"model_layout_{name}",
            device,
            seed=7 + 10 * i,
            prior_lens=[6, 0],
            new_lens=[1, 3],
            num_tokens=4,
            stream=stream,
            weight_dtype=torch.float32,
            tap_major=True,
            layout=INKLING_EXAMPLE_LAYOUT,
            num_blocks=4,
        )


def error_inputs(device: torch.device) -> Iterator[ErrorInput]:
    """Bad calls of ``stepops::sconv`` and their errors: each id out of range (the first tokens are valid,
    so a partial write would show), then shape, dtype and argument rules. The cache sits inside a larger
    buffer (``guarded``). Step: request 0 at positions 5..6 (tokens 0-1, reading positions 2..4 from the
    cache), request 1 at position 2 (token 2), one padding token."""
    num_blocks = 6

    def call(name, edit=lambda args: None, **kwargs):
        sample = _sample(
            name, device, seed=20, prior_lens=[5, 2], new_lens=[2, 1], num_tokens=4, stream=InklingStream.V,
            num_blocks=num_blocks,
        )  # fmt: skip
        args = list(sample.args)
        args[2] = guarded(args[2])
        args[4:8] = [m.clone() for m in args[4:8]]
        edit(args)
        return SampleInput(name, tuple(args), {**sample.kwargs, **kwargs})

    def set_id(index, token, value):
        return lambda args: args[index].__setitem__(token, value)

    request_rule = r"sconv: token_request must be -1 or a block_table row in \[0, 2\); got \[{}\] at tokens \[2\]"
    for value in (2, -2):
        yield ErrorInput(call(f"token_request_{value}", set_id(4, 2, value)), ValueError, request_rule.format(value), True)
    yield ErrorInput(
        call("chunk_start_negative", set_id(5, 1, -3)), ValueError,
        r"sconv: token_chunk_start must be in \[0, t\] for a real token t .*got \[-3\] at tokens \[1\]", True,
    )  # fmt: skip
    yield ErrorInput(  # just past the bound: a chunk starting after its own token
        call("chunk_start_past_the_token", set_id(5, 1, 2)), ValueError,
        r"sconv: token_chunk_start must be in \[0, t\] for a real token t .*got \[2\] at tokens \[1\]", True,
    )  # fmt: skip
    slot_rule = rf"sconv: slot_mapping must be -1 or in \[0, {num_blocks * 4}\); got \[{{}}\]"
    for value in (num_blocks * 4, 10**7, -2):
        yield ErrorInput(call(f"slot_{value}", set_id(6, 1, value)), ValueError, slot_rule.format(value), True)
    block_rule = rf"sconv: block_table must be negative \(unallocated\) or in \[0, {num_blocks}\)"
    for value in (num_blocks, 10**6):  # request 1's first block: token 2's taps at positions 0..1 read it
        yield ErrorInput(
            call(f"read_block_{value}", lambda args, v=value: args[3].__setitem__((1, 0), v)), ValueError,
            block_rule + rf".*; got \[{value}\] at tokens \[2\]", True,
        )  # fmt: skip
    yield ErrorInput(
        call("x_float32", lambda args: args.__setitem__(0, args[0].float())), TypeError, "sconv: x must be bfloat16"
    )
    yield ErrorInput(
        call("stream_offset_past_d", lambda args: args.__setitem__(8, 60)), ValueError,
        r"sconv: stream range \[60, 68\) lies outside the cache's D = 64",
    )  # fmt: skip
    for dim, size in ((1, "heads"), (2, "block_size"), (3, "head_size")):  # cache (6, 2, 4, 64), one size 0
        shape = [6, 2, 4, 64]
        shape[dim] = 0
        yield ErrorInput(
            call(f"cache_zero_{size}", lambda args, d=dim: args.__setitem__(2, args[2].narrow(d, 0, 0))), ValueError,
            rf"sconv: cache needs H, N, D >= 1, got shape \({', '.join(map(str, shape))}\)",
        )  # fmt: skip
    yield ErrorInput(
        call("cache_expanded_over_n", lambda args: args.__setitem__(2, args[2][:, :, :1].expand_as(args[2]))),
        ValueError, r"sconv: cache \(shape \(6, 2, 4, 64\), strides \(512, 256, 0, 1\)\) lets several of its",
    )  # fmt: skip
    yield ErrorInput(
        call("request_int64", lambda args: args.__setitem__(4, args[4].long())), TypeError,
        "sconv: token_request must be int32",
    )  # fmt: skip
    yield ErrorInput(
        call("errors_shape", errors=torch.zeros(2, dtype=torch.int32, device=device)), ValueError,
        r"sconv: errors must be an int32 \[1\] tensor",
    )  # fmt: skip
