"""``stepops::sconv`` over many steps: chunk and batch invariance, speculative decoding vs ``nn.Conv1d``.

A small engine keeps requests with block tables in one cache and feeds ragged steps (prefill chunks,
decode and verify tokens, padding) through a kernel, building metadata with ``build_sconv_metadata``.
"""

import random

import pytest
import torch

from conftest import triton_device
from stepops.layouts import InklingStream
from stepops.ops.sconv import sconv
from stepops.ops.sconv.samples import SAMPLE_LAYOUT, random_block_table, sample_cache, step_metadata
from stepops.ops.sconv.triton_kernel import sconv_triton
from stepops.testing import TOLERANCES

_W = SAMPLE_LAYOUT.kernel_size
_H = SAMPLE_LAYOUT.local_num_kv_heads


def _torch_kernel(x, weight, cache, block_table, metadata, offset, **flags):
    # validate=True also checks every step the engine builds (contiguous rows, slots, no read/store clash).
    return sconv(x, weight, cache, block_table, metadata, offset, validate=True, **flags)


def _triton_kernel(x, weight, cache, block_table, metadata, offset, **flags):
    return sconv_triton(x, weight, cache, block_table, *metadata, offset, **flags)


_KERNELS = {"torch": _torch_kernel, "triton": _triton_kernel}


class _Engine:
    """Requests over one conv-state cache; ``step`` feeds each request's next rows at its next positions."""

    def __init__(self, *, num_requests, max_blocks, block_size, stream, weight, kernel, seed, flags=None):
        generator = torch.Generator().manual_seed(seed)
        # Everything the kernel sees lives where the kernel runs; outputs come back to the CPU.
        self.device = triton_device() if kernel is _triton_kernel else torch.device("cpu")
        shape = (num_requests * max_blocks + 3, _H, block_size, SAMPLE_LAYOUT.head_size)
        self.cache = sample_cache(shape, block_gap=24, generator=generator, device=self.device)
        self.block_table = random_block_table(
            num_requests, max_blocks, shape[0], generator=generator, device=self.device
        )
        self.offset, self.width = SAMPLE_LAYOUT.stream_range(stream)
        self.weight, self.kernel, self.flags = weight.to(self.device), kernel, flags or {}
        self.lens = [0] * num_requests  # positions each request holds (rolled back after rejected drafts)

    def step(self, rows: dict, num_tokens: int) -> dict:
        """Feed ``rows[r]`` ``[n, C]`` to request ``r`` (others idle); return each request's output rows."""
        new_lens = [rows[r].shape[0] if r in rows else 0 for r in range(len(self.lens))]
        metadata = step_metadata(self.lens, new_lens, self.block_table, self.cache.shape[2], num_tokens)
        x = torch.full((num_tokens, _H * self.width), float("nan"), dtype=torch.bfloat16)  # NaN padding rows
        start = 0
        for r, n in enumerate(new_lens):
            if n:
                x[start : start + n] = rows[r]
            start += n
        x = x.to(self.device)
        y = self.kernel(x, self.weight, self.cache, self.block_table, metadata, self.offset, **self.flags).cpu()
        assert not y.isnan().any(), "a padding row leaked into an output"
        out, start = {}, 0
        for r, n in enumerate(new_lens):
            if n:
                out[r] = y[start : start + n]
            self.lens[r] += n
            start += n
        return out

    def stored_rows(self, request: int, length: int) -> torch.Tensor:
        """``[length, C]``: the inputs the cache holds for positions ``0 .. length-1`` of ``request``."""
        n = self.cache.shape[2]
        cache, block_table = self.cache.cpu(), self.block_table.cpu()
        blocks = block_table[request, torch.arange(length) // n].long()
        rows = cache[blocks, :, torch.arange(length) % n, self.offset : self.offset + self.width]
        return rows.reshape(length, -1)

    def request_blocks(self, request: int) -> torch.Tensor:
        """Every element of ``request``'s blocks (all four streams), on the CPU."""
        return self.cache[self.block_table[request].long()].cpu()


def _dense_reference(x_seq: torch.Tensor, weight: torch.Tensor, *, residual=True, silu=False) -> torch.Tensor:
    """No cache, no steps: ``nn.Conv1d(C, C, W, padding=W-1, groups=C)`` in fp32 on the whole sequence."""
    length, channels = x_seq.shape
    conv = torch.nn.Conv1d(channels, channels, _W, padding=_W - 1, groups=channels, bias=False)
    with torch.no_grad():
        conv.weight.copy_(weight.float().view(channels, 1, _W))
        y = conv(x_seq.float().T[None])[0, :, :length].T
    if silu:
        y = torch.nn.functional.silu(y)
    if residual:
        y = y + x_seq.float()
    return y.to(torch.bfloat16)


def _random_chunks(length: int, rng: random.Random, max_chunk: int) -> list[int]:
    chunks = []
    while length:
        chunks.append(min(length, rng.randint(1, max_chunk)))
        length -= chunks[-1]
    return chunks


# ---------------------------------------------------------------------------------------------------------
# Chunk and batch invariance
# ---------------------------------------------------------------------------------------------------------

_TARGET = 1  # the request whose outputs and cache rows are compared across schedules
_LENGTH = 11


def _run_schedule(schedule, x_seq, weight, kernel, flags, seed):
    """Feed ``x_seq`` to request 1 of 3 in the given schedule; return its outputs and its blocks."""
    rng = random.Random(seed)
    engine = _Engine(
        num_requests=3, max_blocks=4, block_size=4, stream=InklingStream.V, weight=weight, kernel=kernel,
        seed=0, flags=flags,
    )
    if schedule == "prefill":
        chunks = [_LENGTH]
    elif schedule == "chunks":
        chunks = _random_chunks(_LENGTH, rng, 5)
    else:  # "tokens" and "batched"
        chunks = [1] * _LENGTH if schedule == "tokens" else _random_chunks(_LENGTH, rng, 4)
    outputs, fed = [], 0
    for chunk in chunks:
        rows = {_TARGET: x_seq[fed : fed + chunk]}
        if schedule == "batched":
            # Other requests come and go around the target with their own random rows.
            for other in (0, 2):
                if rng.random() < 0.7 and engine.lens[other] < 14:
                    rows[other] = torch.randn(rng.randint(1, 2), x_seq.shape[1]).to(torch.bfloat16)
        # One padding row per step keeps padding in every schedule and the interpreter's grid small.
        outputs.append(engine.step(rows, num_tokens=sum(r.shape[0] for r in rows.values()) + 1)[_TARGET])
        fed += chunk
    return torch.cat(outputs), engine.request_blocks(_TARGET).clone()


@pytest.mark.parametrize(
    ("kernel", "flags"),
    [
        ("torch", {}),
        ("torch", {"residual": False, "silu": True}),
        ("triton", {}),
        ("triton", {"residual": False, "silu": True}),
    ],
    ids=["torch", "torch-silu-no-residual", "triton", "triton-silu-no-residual"],
)
def test_chunk_and_batch_invariance(kernel, flags):
    """One prefill, random chunks, token by token, batched with others: the same bits everywhere."""
    x_seq = torch.randn(_LENGTH, _H * SAMPLE_LAYOUT.head_dim).to(torch.bfloat16)
    weight = torch.randn(_H * SAMPLE_LAYOUT.head_dim, _W).to(torch.bfloat16)
    y_want, blocks_want = _run_schedule("prefill", x_seq, weight, _KERNELS[kernel], flags, seed=0)
    # Not a tautology: the prefill itself equals the dense reference (up to the conv's summation order).
    tol = TOLERANCES["sconv_dense_reference"]
    torch.testing.assert_close(
        y_want.float(), _dense_reference(x_seq, weight, **flags).float(), atol=tol.atol, rtol=tol.rtol
    )
    for schedule, seed in (("chunks", 1), ("tokens", 2), ("batched", 3), ("batched", 4)):
        y, blocks = _run_schedule(schedule, x_seq, weight, _KERNELS[kernel], flags, seed)
        assert torch.equal(y, y_want), schedule
        assert torch.equal(blocks.view(torch.int16), blocks_want.view(torch.int16)), schedule


# ---------------------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------------------


def _speculative_run(*, k, block_size, kernel, num_steps, seed, flags):
    """Several requests: chunked prefill, then verify steps of k + 1 tokens with random acceptance.

    Each verify step feeds the pending (sampled) token and k drafts at positions s..s+k; a random number
    a of drafts is accepted, positions s..s+a are committed with their outputs, and the next step starts
    at s+a+1 with a fresh pending token, overwriting the rejected drafts' slots.
    """
    rng = random.Random(seed)
    channels = _H * SAMPLE_LAYOUT.hidden_per_head
    weight = torch.randn(channels, _W).to(torch.bfloat16)
    num_requests = 3
    max_len = 10 + num_steps * (k + 1) + k + 1
    engine = _Engine(
        num_requests=num_requests, max_blocks=-(-max_len // block_size), block_size=block_size,
        stream=InklingStream.ATTN_OUT, weight=weight, kernel=kernel, seed=seed, flags=flags,
    )
    prompts = [torch.randn(rng.randint(1, 10), channels).to(torch.bfloat16) for _ in range(num_requests)]
    prompt_fed = [0] * num_requests
    committed_x = [[] for _ in range(num_requests)]
    committed_y = [[] for _ in range(num_requests)]
    pending = [None] * num_requests
    saw_rejection = False
    for _ in range(num_steps):
        rows = {}
        for r in range(num_requests):
            if prompt_fed[r] < prompts[r].shape[0]:
                chunk = min(rng.randint(1, 4), prompts[r].shape[0] - prompt_fed[r])
                rows[r] = prompts[r][prompt_fed[r] : prompt_fed[r] + chunk]
            elif rng.random() < 0.85:  # sometimes a request sits a step out
                drafts = torch.randn(k, channels).to(torch.bfloat16)
                rows[r] = torch.cat([pending[r][None], drafts])
        starts = list(engine.lens)
        out = engine.step(rows, num_tokens=num_requests * (k + 1) + 2)
        for r, y in out.items():
            if prompt_fed[r] < prompts[r].shape[0]:
                n = rows[r].shape[0]
                committed_x[r].append(rows[r])
                committed_y[r].append(y)
                prompt_fed[r] += n
                if prompt_fed[r] == prompts[r].shape[0]:
                    pending[r] = torch.randn(channels).to(torch.bfloat16)
                continue
            accepted = rng.randint(0, k)
            saw_rejection |= accepted < k
            committed_x[r].append(rows[r][: accepted + 1])
            committed_y[r].append(y[: accepted + 1])
            engine.lens[r] = starts[r] + accepted + 1  # roll back: rejected drafts get overwritten
            pending[r] = torch.randn(channels).to(torch.bfloat16)
    assert saw_rejection or k == 0
    return engine, weight, [torch.cat(x) for x in committed_x], [torch.cat(y) for y in committed_y]


@pytest.mark.parametrize(
    ("kernel", "k", "block_size", "num_steps", "flags"),
    [
        ("torch", 1, 4, 24, {}),
        ("torch", 3, 4, 24, {}),
        ("torch", 3, 32, 20, {}),
        ("torch", 3, 2, 20, {"residual": False}),
        ("torch", 1, 4, 16, {"silu": True}),
        ("triton", 3, 4, 6, {}),
        ("triton", 1, 2, 6, {"silu": True}),
        ("triton", 2, 32, 6, {"residual": False}),
    ],
    ids=[
        "torch-k1", "torch-k3", "torch-k3-N32", "torch-k3-N2-no-residual", "torch-k1-silu", "triton-k3",
        "triton-k1-N2-silu", "triton-k2-N32-no-residual",
    ],  # fmt: skip
)
def test_speculative_decoding_matches_dense_conv1d(kernel, k, block_size, num_steps, flags):
    engine, weight, xs, ys = _speculative_run(
        k=k, block_size=block_size, kernel=_KERNELS[kernel], num_steps=num_steps, seed=k * 100 + block_size,
        flags=flags,
    )
    tol = TOLERANCES["sconv_dense_reference"]
    for r, (x_seq, y_seq) in enumerate(zip(xs, ys)):
        want = _dense_reference(x_seq, weight, **flags)
        torch.testing.assert_close(y_seq.float(), want.float(), atol=tol.atol, rtol=tol.rtol, msg=f"request {r}")
        # Every committed position's slot holds the committed input, whatever drafts passed through it.
        stored = engine.stored_rows(r, x_seq.shape[0])
        assert torch.equal(stored.view(torch.int16), x_seq.view(torch.int16)), f"request {r}"
