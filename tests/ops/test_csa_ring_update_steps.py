"""``stepops::csa_ring_update`` over many steps: chunk invariance and speculative decoding.

Sequences are driven step by step through the public wrapper (PyTorch kernel) or the Triton launcher
(interpreter), with metadata from ``build_csa_ring_metadata``; every summary is checked bit for bit against
the numpy fold of ``stepops.ops.csa_ring_update.reference.region_summary`` over committed rows only.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import triton_device
from csa_ring_update_helpers import softmax_summary, summary_bytes
from stepops.ops.csa_ring_update import build_csa_ring_metadata, csa_ring_update
from stepops.ops.csa_ring_update.reference import region_summary
from stepops.ops.csa_ring_update.samples import SUMMARY_BLOCK_SIZE, bind_ring
from stepops.ops.csa_ring_update.triton_kernel import csa_ring_update_triton
from stepops.testing import TOLERANCES

_SOFTMAX_TOLERANCE = TOLERANCES["csa_ring_summary_vs_softmax"]


class Rings:
    """Ring and summary caches of ``num_requests`` requests, stepped through one kernel."""

    def __init__(self, num_requests, *, proxy_dim, capacity, rows_per_block, summary_dtype, max_len, kernel, seed):
        generator = torch.Generator().manual_seed(seed)
        self.kernel, self.capacity, self.rows_per_block = kernel, capacity, rows_per_block
        self.proxy_dim, self.summary_dtype = proxy_dim, summary_dtype
        self.device = torch.device("cpu") if kernel == "torch" else triton_device()
        num_blocks = num_requests + 1
        self.cache = torch.randn(num_blocks, rows_per_block * 2 * proxy_dim, generator=generator)
        self.cache = self.cache.to(torch.bfloat16).to(self.device)
        self.ring = bind_ring(self.cache, capacity, 2 * proxy_dim).rows
        self.ring_blocks = torch.randperm(num_blocks, generator=generator)[:num_requests].to(torch.int32)
        blocks = max_len // 8 // SUMMARY_BLOCK_SIZE + 1
        table = torch.randperm(num_requests * blocks, generator=generator).view(num_requests, blocks)
        self.summary_block_table = table.to(torch.int32)
        bits = torch.randint(0, 256, (num_requests * blocks * SUMMARY_BLOCK_SIZE, proxy_dim * 2), generator=generator)
        bits = bits.to(torch.uint8).view(torch.bfloat16)  # random bits: a slot nobody wrote cannot pass a check
        self.summary_cache = (bits if summary_dtype == torch.bfloat16 else bits.view(torch.uint8)[:, :proxy_dim])
        self.summary_cache = self.summary_cache.contiguous().view(summary_dtype).to(self.device)

    def step(self, chunks: dict[int, tuple[torch.Tensor, torch.Tensor, int]], num_padding: int = 0) -> None:
        """``chunks[r] = (k [n, P], z [n, P], seq_len after the step)``; padding tokens carry random rows."""
        requests = list(chunks)
        lens = [chunks[r][0].shape[0] for r in requests]
        num_tokens = sum(lens) + num_padding
        padding = torch.randn(num_padding, self.proxy_dim).to(torch.bfloat16)
        index_k = torch.cat([chunks[r][0] for r in requests] + [padding]).to(self.device)
        index_z = torch.cat([chunks[r][1] for r in requests] + [padding]).to(self.device)
        query_start_loc = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        seq_lens = torch.tensor([chunks[r][2] for r in requests], dtype=torch.int32)
        index = torch.tensor(requests, dtype=torch.long)
        metadata = build_csa_ring_metadata(
            query_start_loc.to(self.device), seq_lens.to(self.device), self.ring_blocks[index].to(self.device),
            self.rows_per_block, self.summary_block_table[index].to(self.device), SUMMARY_BLOCK_SIZE, num_tokens,
        )  # fmt: skip
        if self.kernel == "torch":
            csa_ring_update(index_k, index_z, self.ring, self.summary_cache, metadata, self.capacity, validate=True)
        else:
            summary = self.summary_cache
            summary = summary.view(torch.uint8) if summary.dtype == torch.float8_e4m3fn else summary
            csa_ring_update_triton(index_k, index_z, self.ring, summary, *metadata, self.capacity)

    def summary(self, request: int, region: int) -> torch.Tensor:
        block = int(self.summary_block_table[request, region // SUMMARY_BLOCK_SIZE])
        return summary_bytes(self.summary_cache)[block * SUMMARY_BLOCK_SIZE + region % SUMMARY_BLOCK_SIZE].cpu()


def check_committed_regions(rings: Rings, committed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every complete region of every request: summary bits == the dense fold of its committed rows; bf16
    summaries also match the textbook softmax within the tolerance table's bound."""
    for r, (k, z) in enumerate(committed):
        for region in range(k.shape[0] // 8):
            rows = slice(8 * region, 8 * region + 8)
            got = rings.summary(r, region)
            assert torch.equal(got, summary_bytes(region_summary(k[rows], z[rows], rings.summary_dtype))), (r, region)
            if rings.summary_dtype == torch.bfloat16:
                torch.testing.assert_close(
                    got.view(torch.bfloat16).double(), softmax_summary(k[rows], z[rows]),
                    atol=_SOFTMAX_TOLERANCE.atol, rtol=_SOFTMAX_TOLERANCE.rtol,
                )  # fmt: skip


def random_rows(n: int, proxy_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, proxy_dim).to(torch.bfloat16), (torch.randn(n, proxy_dim) * 3).to(torch.bfloat16)


def random_chunks(length: int, rng: random.Random, max_chunk: int) -> list[int]:
    chunks = []
    while sum(chunks) < length:
        chunks.append(min(rng.randint(1, max_chunk), length - sum(chunks)))
    return chunks


@pytest.mark.parametrize(
    "kernel, lengths", [("torch", [45, 38, 29]), ("triton", [27, 19]), ("triton_reversed", [19])]
)  # fmt: skip
def test_chunk_invariance_prefill_random_chunks_token_by_token(kernel, lengths):
    """The same sequences fed as one prefill, as random chunks, and one token per step: identical summary
    cache and ring cache bytes (gap rows included), and every summary equals the dense fold."""
    proxy_dim, capacity, rows_per_block = 16, 10, 12
    rng = random.Random(1234)
    sequences = [random_rows(n, proxy_dim) for n in lengths]
    schedules = {
        "prefill": [[n] for n in lengths],
        "random_chunks": [random_chunks(n, rng, 13) for n in lengths],
        "token_by_token": [[1] * n for n in lengths],
    }
    results = {}
    for name, schedule in schedules.items():
        rings = Rings(
            len(lengths), proxy_dim=proxy_dim, capacity=capacity, rows_per_block=rows_per_block,
            summary_dtype=torch.bfloat16, max_len=max(lengths), kernel=kernel, seed=7,
        )  # fmt: skip
        done = [0] * len(lengths)
        for step in range(max(len(s) for s in schedule)):
            chunks = {}
            for r, chunk_lens in enumerate(schedule):
                if step < len(chunk_lens):
                    n = chunk_lens[step]
                    k, z = sequences[r]
                    chunks[r] = (k[done[r] : done[r] + n], z[done[r] : done[r] + n], done[r] + n)
                    done[r] += n
            rings.step(chunks, num_padding=step % 3)
        check_committed_regions(rings, sequences)
        results[name] = (rings.cache.view(torch.int16).cpu(), summary_bytes(rings.summary_cache).cpu())
    for name in ("random_chunks", "token_by_token"):
        assert torch.equal(results[name][0], results["prefill"][0]), name
        assert torch.equal(results[name][1], results["prefill"][1]), name


SPECULATIVE_CASES = [
    ("torch", 1, torch.bfloat16, 24),
    ("torch", 2, torch.bfloat16, 24),
    ("torch", 3, torch.bfloat16, 24),
    ("torch", 7, torch.bfloat16, 16),
    ("torch", 3, torch.float8_e4m3fn, 24),
    ("triton", 3, torch.bfloat16, 6),
    ("triton_reversed", 7, torch.float8_e4m3fn, 4),
    ("triton", 1, torch.bfloat16, 6),
    ("triton_reversed", 2, torch.float8_e4m3fn, 5),
]


@pytest.mark.parametrize("kernel, k, summary_dtype, num_steps", SPECULATIVE_CASES)
def test_speculative_decoding_matches_dense_recompute_of_committed_tokens(kernel, k, summary_dtype, num_steps):
    """Capacity exactly 7 + k. Each request starts with a random prefill, then verify steps of k + 1 tokens
    (the last committed token's successor + k drafts) accept a random number of drafts; rejected drafts are
    simply overwritten by the next step. After every step, every region made only of committed tokens has
    the summary of those tokens, bit for bit."""
    proxy_dim, num_requests = 16, 3
    rng = random.Random(k * 100 + num_steps)
    rings = Rings(
        num_requests, proxy_dim=proxy_dim, capacity=7 + k, rows_per_block=7 + k + 3, summary_dtype=summary_dtype,
        max_len=24 + num_steps * (k + 1), kernel=kernel, seed=k,
    )  # fmt: skip
    committed = [random_rows(rng.randint(1, 20), proxy_dim) for _ in range(num_requests)]
    rings.step({r: (k_rows, z_rows, k_rows.shape[0]) for r, (k_rows, z_rows) in enumerate(committed)})
    check_committed_regions(rings, committed)
    for _ in range(num_steps):
        chunks, accepted = {}, {}
        for r in range(num_requests):
            if rng.random() < 0.2:
                continue  # not scheduled this step
            new_k, new_z = random_rows(k + 1, proxy_dim)
            chunks[r] = (new_k, new_z, committed[r][0].shape[0] + k + 1)
            accepted[r] = rng.randint(0, k)  # drafts accepted; the first token is always committed
        if not chunks:
            continue  # build_token_metadata needs at least one request
        rings.step(chunks, num_padding=rng.randint(0, 2))
        for r, a in accepted.items():
            new_k, new_z, _ = chunks[r]
            committed[r] = (torch.cat([committed[r][0], new_k[: a + 1]]), torch.cat([committed[r][1], new_z[: a + 1]]))
        check_committed_regions(rings, committed)
    assert sum(c[0].shape[0] // 8 for c in committed) >= num_requests + 2, "the run checks several regions"
