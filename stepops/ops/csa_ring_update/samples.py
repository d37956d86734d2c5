"""Sample steps for ``stepops::csa_ring_update``, shared by opcheck, the tests and benchmarks.

Rings are bound through ``stepops.layouts.CSATailRingLayout`` as the Step5 layer binds them: a cache of
``num_blocks`` blocks, each strided ``rows_per_block`` rows apart but holding ``capacity`` rows, viewed as
one 2-D ``as_strided`` rows tensor.
Small proxy dims (16) keep opcheck fast; one sample uses Step5's P = 256.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from stepops._library import ErrorInput, SampleInput, guarded
from stepops.layouts import REGION_SIZE, REPLAY_ROWS, BoundCSATailRing, CSATailRingLayout
from stepops.ops.csa_ring_update.metadata import CSARingMetadata, build_csa_ring_metadata

SUMMARY_BLOCK_SIZE = 4


def bind_ring(cache: torch.Tensor, capacity: int, row_elements: int) -> BoundCSATailRing:
    """Bind a ring of ``capacity`` rows of ``row_elements`` bf16 per block of ``cache``
    ``[num_blocks, rows_per_block * row_elements]`` (blocks strided ``rows_per_block >= capacity`` rows apart;
    the rows past ``capacity`` stand for another cache's bytes)."""
    row_bytes = row_elements * torch.bfloat16.itemsize
    layout = CSATailRingLayout(
        page_bytes=capacity * row_bytes, block_size=1, num_speculative_tokens=capacity - REPLAY_ROWS,
        row_bytes=row_bytes,
    )
    return layout.bind(cache[:, : capacity * row_elements])


@dataclass
class CSARingStep:
    """One step of a ragged batch: inputs, caches (whole storage and views) and metadata."""

    index_k: torch.Tensor  # [T, P] bf16
    index_z: torch.Tensor  # [T, P] bf16
    cache: torch.Tensor  # [num_blocks, rows_per_block * 2P] bf16: every byte the ring view may reach
    ring: torch.Tensor  # rows view of cache
    summary_cache: torch.Tensor  # [num_slots, P]
    metadata: CSARingMetadata
    capacity: int
    rows_per_block: int
    ring_blocks: torch.Tensor  # [R]
    summary_block_table: torch.Tensor  # [R, max_blocks]

    def op_args(self) -> tuple:
        """Arguments of ``torch.ops.stepops.csa_ring_update``, as the wrapper passes them."""
        return (self.index_k, self.index_z, self.ring, self.summary_cache, *self.metadata, self.capacity)


def make_step(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    proxy_dim: int,
    capacity: int,
    rows_per_block: int | None = None,
    num_padding: int = 0,
    summary_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> CSARingStep:
    """A random step: request ``r`` brings ``query_lens[r]`` tokens and then holds ``seq_lens[r]``.

    Rings and summary slots hold random data (a request's earlier rows), requests get distinct, shuffled
    ring blocks and summary blocks, and the batch ends with ``num_padding`` padding tokens. ``summary_dtype``
    uint8 holds float8_e4m3fn codes, as the Step5 model keeps its summary caches.
    """
    rows_per_block = capacity if rows_per_block is None else rows_per_block
    num_requests = len(query_lens)
    width = 2 * proxy_dim
    num_tokens = sum(query_lens) + num_padding

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cpu").to(torch.bfloat16).to(device)

    num_blocks = num_requests + 2
    cache = guarded(randn(num_blocks, rows_per_block * width))  # bytes around it that must stay unchanged
    ring = bind_ring(cache, capacity, width).rows
    ring_blocks = torch.randperm(num_blocks, generator=generator, device="cpu")[:num_requests]

    blocks_per_request = max(seq_lens) // REGION_SIZE // SUMMARY_BLOCK_SIZE + 1
    num_slots = num_requests * blocks_per_request * SUMMARY_BLOCK_SIZE
    summary_block_table = torch.randperm(num_requests * blocks_per_request, generator=generator, device="cpu")
    summary_block_table = summary_block_table.view(num_requests, blocks_per_request)
    summary_cache = randn(num_slots, proxy_dim)
    if summary_dtype == torch.uint8:
        summary_cache = summary_cache.to(torch.float8_e4m3fn).view(torch.uint8)
    summary_cache = guarded(summary_cache.to(summary_dtype))

    query_start_loc = torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32, device="cpu")
    metadata = build_csa_ring_metadata(
        query_start_loc.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        ring_blocks.to(device),
        rows_per_block,
        summary_block_table.to(device),
        SUMMARY_BLOCK_SIZE,
        num_tokens,
    )
    return CSARingStep(
        index_k=randn(num_tokens, proxy_dim),
        index_z=randn(num_tokens, proxy_dim),
        cache=cache,
        ring=ring,
        summary_cache=summary_cache,
        metadata=metadata,
        capacity=capacity,
        rows_per_block=rows_per_block,
        ring_blocks=ring_blocks.to(device),
        summary_block_table=summary_block_table.to(device),
    )


def samples(device: torch.device) -> Iterator[SampleInput]:
    generator = torch.Generator().manual_seed(0)
    cases = {
        # One decode token closing region 1 (positions 8..15): 7 rows from the ring.
        "t1_decode_closes": dict(query_lens=[1], seq_lens=[16], proxy_dim=16, capacity=8),
        # Prefill chunk longer than capacity, a decode, a verify step (k = 3), then padding; strided blocks.
        "ragged_padding_strided": dict(
            query_lens=[21, 1, 4], seq_lens=[21, 40, 27], proxy_dim=16, capacity=10, rows_per_block=13,
            num_padding=3,
        ),
        # The trap: capacity exactly 7 + k (k = 3), a verify step whose first token (position 23) closes a
        # region, so its last token's row lands on the slot of position 16, which the replay reads.
        "trap_verify_first_token_closes_fp8": dict(
            query_lens=[4, 4], seq_lens=[27, 12], proxy_dim=16, capacity=10, summary_dtype=torch.float8_e4m3fn,
        ),
        # fp8 summaries as uint8 codes, the form the Step5 model passes (the one above passes float8_e4m3fn).
        "ragged_fp8_strided": dict(
            query_lens=[9, 2, 16], seq_lens=[17, 34, 16], proxy_dim=16, capacity=9, rows_per_block=12,
            num_padding=1, summary_dtype=torch.uint8,
        ),
        "step5_proxy_dim_256": dict(query_lens=[3, 8], seq_lens=[8, 24], proxy_dim=256, capacity=16),
        # An empty step (T = 0): one request with no tokens in it.
        "empty_t0": dict(query_lens=[0], seq_lens=[8], proxy_dim=16, capacity=8),
    }  # fmt: skip
    for name, kwargs in cases.items():
        step = make_step(**kwargs, device=device, generator=generator)
        yield SampleInput(name, step.op_args())


def error_inputs(device: torch.device) -> Iterator[ErrorInput]:
    """Bad calls of ``stepops::csa_ring_update`` and their errors: each id out of range (earlier tokens are
    valid, so a partial write would show), then shape and dtype rules. Step: request 0 at positions 13..15
    (tokens 0-2; token 2 closes region 1, replaying 5 ring rows), request 1 at position 23 (token 3,
    closes region 2), one padding token; capacity 8, blocks 10 rows apart (ring: 38 rows)."""
    num_rows = 38

    def call(name, edit=lambda args: None):
        step = make_step(
            [3, 1], [16, 24], proxy_dim=4, capacity=8, rows_per_block=10, num_padding=1, device=device,
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip
        args = list(step.op_args())
        args[4:9] = [m.clone() for m in args[4:9]]
        edit(args)
        return SampleInput(name, tuple(args))

    def set_id(index, token, value):
        return lambda args: args[index].__setitem__(token, value)

    base_rule = r"csa_ring_update: token_ring_base must be in \[0, 30\] for a real token .*got \[{}\] at tokens \[3\]"
    for value in (-10, num_rows - 7):  # ring block -1; a ring running one row past the view
        yield ErrorInput(call(f"ring_base_{value}", set_id(7, 3, value)), ValueError, base_rule.format(value), True)
    slot_rule = r"csa_ring_update: token_summary_slot must be -1 or in \[0, {}\); got \[{}\] at tokens \[3\]"
    for value in (8, 10**6, -2):
        yield ErrorInput(call(f"summary_slot_{value}", set_id(8, 3, value)), ValueError, slot_rule.format(8, value), True)
    yield ErrorInput(
        call("chunk_start_negative", set_id(5, 3, -3)), ValueError,
        r"csa_ring_update: token_chunk_start must be in \[0, t\] for a real token t .*got \[-3\] at tokens \[3\]",
        True,
    )  # fmt: skip
    # Each bound just past: a chunk running one token past the step (token 3 of 5), a request's first
    # position -1 (token 2, two after its chunk's start, at position 1; the error reports 1 - 2).
    yield ErrorInput(
        call("chunk_len_one_past_the_step", set_id(6, 3, 3)), ValueError,
        r"csa_ring_update: token_chunk_len must be in \[0, 5 - chunk_start\] .*got \[3\] at tokens \[3\]", True,
    )  # fmt: skip
    yield ErrorInput(
        call("first_position_minus_1", set_id(4, 2, 1)), ValueError,
        r"csa_ring_update: token_position must be at least t - chunk_start .*got \[-1\] at tokens \[2\]", True,
    )  # fmt: skip
    yield ErrorInput(
        call("capacity_6", lambda args: args.__setitem__(9, 6)), ValueError, "csa_ring_update: capacity 6 < 7"
    )
    yield ErrorInput(
        call("ring_row_width", lambda args: args.__setitem__(2, args[2][:, :6])), ValueError,
        r"csa_ring_update: a ring row is \[index_k \| index_z\] = 8 bf16 values",
    )  # fmt: skip
    yield ErrorInput(
        call("ring_3d", lambda args: args.__setitem__(2, args[2][..., None])), ValueError,
        r"csa_ring_update: ring must be 2-D, got shape \(38, 8, 1\)",
    )  # fmt: skip
    # Rows 4 values apart but 8 wide: each row's index_z half is the next row's index_k half.
    yield ErrorInput(
        call("ring_rows_overlap", lambda args: args.__setitem__(2, args[2].flatten()[: 4 * (num_rows + 1)].unfold(0, 8, 4))),
        ValueError, r"csa_ring_update: ring \(shape \(38, 8\), strides \(4, 1\)\) lets several of its positions share",
    )  # fmt: skip
    yield ErrorInput(
        call("summary_expanded", lambda args: args.__setitem__(3, args[3][:1].expand_as(args[3]))), ValueError,
        r"csa_ring_update: summary_cache \(shape \(8, 4\), strides \(0, 1\)\) lets several of its positions share",
    )  # fmt: skip
    yield ErrorInput(
        call("index_z_float32", lambda args: args.__setitem__(1, args[1].float())), TypeError,
        "csa_ring_update: index_z must be bfloat16",
    )  # fmt: skip
    yield ErrorInput(
        call("summary_float32", lambda args: args.__setitem__(3, args[3].float())), TypeError,
        "csa_ring_update: summary_cache must be bfloat16",
    )  # fmt: skip
    yield ErrorInput(
        call("errors_int64", lambda args: args.append(torch.zeros(1, dtype=torch.int64, device=device))), TypeError,
        "csa_ring_update: errors must be an int32 counter",
    )  # fmt: skip
