"""``stepops::csa_ring_update``: dense recomputes, the read-before-store trap, poisoned caches, bad input, the
metadata builder, the Triton kernel bitwise, and the docs example.

Multi-step behaviour (chunk invariance, speculative decoding) is in ``test_csa_ring_update_steps.py``.
The per-token reference is ``stepops.ops.csa_ring_update.reference``: the fold the op documents in numpy,
independently of the kernels (rows 0..7 in order, fp32 running max/sum/accumulator, two ``exp`` per step
with its own numpy ``exp``, ``a / s``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import triton_device
from csa_ring_update_helpers import assert_same_bits_or_both_nan, softmax_summary, special_logits, summary_bytes
import triton
import triton.language as tl
from stepops.layouts import REGION_SIZE
from stepops.ops.csa_ring_update import CSARingMetadata, build_csa_ring_metadata, csa_ring_update
from stepops.ops.csa_ring_update.reference import csa_ring_update_reference, fold, region_summary
from stepops.ops.csa_ring_update.samples import SUMMARY_BLOCK_SIZE, make_step
from stepops.ops.csa_ring_update.torch_kernel import csa_ring_update_torch
from stepops.ops.csa_ring_update.triton_kernel import fold_step, csa_ring_update_triton
from stepops.ops.csa_ring_update.validate import validate_csa_ring_update_inputs
from stepops.testing import TOLERANCES, copy_as_views, op_samples

_SAMPLES = list(op_samples(op_name="csa_ring_update"))
_SOFTMAX_TOLERANCE = TOLERANCES["csa_ring_summary_vs_softmax"]


# ------------------------------------------------------------------------------------------------------
# Independent checks and helpers
# ------------------------------------------------------------------------------------------------------


def summary_slot(step, request: int, region: int) -> int:
    block = int(step.summary_block_table[request, region // SUMMARY_BLOCK_SIZE])
    return block * SUMMARY_BLOCK_SIZE + region % SUMMARY_BLOCK_SIZE


def poison(step) -> None:
    """Random bits (NaN patterns included) in every summary slot. The ring cache (gap rows between strided
    blocks included) already holds random normal values, distinct from every input row; it is not filled
    with random bits because replays read its earlier rows, and NaN payloads differ between libraries."""
    summary = summary_bytes(step.summary_cache)
    low, high = (-(2**15), 2**15) if summary.dtype == torch.int16 else (0, 256)
    summary.copy_(torch.randint(low, high, summary.shape, dtype=summary.dtype))


def run(kernel: str, step) -> None:
    if kernel == "torch":
        csa_ring_update(
            step.index_k, step.index_z, step.ring, step.summary_cache, step.metadata, step.capacity, validate=True
        )
    else:
        csa_ring_update_triton(*step.op_args(), reverse_grid=kernel == "triton_reversed")


# The interpreter runs a grid's programs one by one in order; running it backwards too shows that no
# program depends on another having run first (a store landing before a replay's read would show).
KERNELS = ["torch", "triton", "triton_reversed"]


# ------------------------------------------------------------------------------------------------------
# One step against a per-token walk
# ------------------------------------------------------------------------------------------------------


def _expected_after(step, ring_before, summary_before):
    """The reference on CPU copies of the caches' bytes: ``(ring cache as int16, summary cache bytes)``."""
    cache = ring_before.cpu().clone()
    ring = torch.as_strided(
        cache.view(torch.bfloat16), step.ring.shape, step.ring.stride(), step.ring.storage_offset() - step.cache.storage_offset()
    )
    summary = summary_before.cpu().clone()
    summary_cache = summary.view(torch.bfloat16) if summary.dtype == torch.int16 else summary
    inputs = [t.cpu() for t in (step.index_k, step.index_z, *step.metadata)]
    csa_ring_update_reference(inputs[0], inputs[1], ring, summary_cache, *inputs[2:], step.capacity)
    return cache, summary


STEPS = {
    # One decode token closing region 1: its 7 earlier rows come from the ring.
    "decode_closes": ([1], [16], 8, None),
    # A prefill longer than capacity (only its last 10 rows land), a decode, a verify, strided blocks.
    "ragged_strided": ([12, 1, 4, 3], [12, 40, 27, 30], 10, 13),
    # The leader does not close (region 2 closes at its 4th token) and stores wrap over the rows it reads.
    "chunk_of_capacity_closes_late": ([10], [30], 10, 12),
    # A chunked-prefill chunk longer than capacity, starting mid-region (positions 13..32): the leader
    # replays ring rows of positions 8..12 and defers the stores that land on them; the last token
    # (position 32) lands on the row of position 12, so the deferred row is the chunk's last, not a row
    # before its stored window.
    "chunk_longer_than_capacity_starts_mid_region": ([20], [33], 10, 12),
    # Chunks of 7 starting at every position mod 8 (0..7): the leader's close comes at each offset 0..6
    # of its chunk (or not at all), and picks that token's summary slot.
    "chunks_of_7_start_at_every_position_mod_8": ([7] * 8, list(range(7, 15)), 10, 12),
    # Chunks of capacity + 2 starting at every position mod 8 (8..15): a close at offset 7 or later replays
    # the step's own inputs; the first close, at offset 0..6, is the leader's ring replay, which reads its
    # ring rows before its deferred stores land on them (a non-leader replaying from the ring raced them).
    "chunks_of_capacity_plus_2_start_at_every_position_mod_8": ([12] * 8, list(range(20, 28)), 10, 12),
    # Request 0 ends at position 6, one before a close; request 1's token 7 closes right after it in the
    # step: request 0's program must not take request 1's close as its own (its first close is past its chunk).
    "request_ends_one_before_the_next_closes": ([1, 1], [7, 8], 8, None),
}


def _assert_step_matches_walk(step, kernel) -> None:
    """Poison the step's summary slots, run it, and compare every byte of the ring's whole storage and of
    the summary cache with the reference walk on copies."""
    poison(step)
    ring_before = step.cache.view(torch.int16).clone()
    summary_before = summary_bytes(step.summary_cache).clone()
    expected_ring, expected_summary = _expected_after(step, ring_before, summary_before)
    run(kernel, step)
    assert torch.equal(step.cache.view(torch.int16).cpu(), expected_ring)
    assert torch.equal(summary_bytes(step.summary_cache).cpu(), expected_summary)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("summary_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", list(STEPS))
def test_step_matches_per_token_walk_and_writes_nothing_else(name, summary_dtype, kernel):
    """Poisoned caches: every byte outside the rows and slots the step may write (gap rows past each
    block's capacity, other blocks, padding tokens' would-be rows) is unchanged; written bytes are exact."""
    query_lens, seq_lens, capacity, rows_per_block = STEPS[name]
    step = make_step(
        query_lens, seq_lens, proxy_dim=16, capacity=capacity, rows_per_block=rows_per_block, num_padding=3,
        summary_dtype=summary_dtype, device=triton_device() if kernel != "torch" else "cpu",
    )  # fmt: skip
    _assert_step_matches_walk(step, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_closing_token_without_a_summary_slot_stores_its_row_and_no_summary(kernel):
    """Slot -1 on a real closing token (its summary block unallocated): its ring row is stored, no summary
    slot changes, and the other request's closes write their own slots."""
    step = make_step([3, 9], [16, 24], proxy_dim=16, capacity=10, num_padding=1,
                     device=triton_device() if kernel != "torch" else "cpu")  # fmt: skip
    position = step.metadata.position
    closing = ((position >= 0) & (position % REGION_SIZE == REGION_SIZE - 1)).nonzero().flatten().tolist()
    assert closing == [2, 3, 11], closing  # position 15 of request 0; positions 15 and 23 of request 1
    step.metadata.summary_slot[2] = -1
    _assert_step_matches_walk(step, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("summary_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_trap_verify_step_whose_first_token_closes_with_capacity_7_plus_k(summary_dtype, kernel):
    """k = 3, capacity exactly 10. A prefill of positions 0..22, then a verify step at 23..26: token 23
    closes region 2 and replays rows 16..22 from the ring while token 26 is stored on row 26 % 10 = 6,
    the row of position 16. A kernel that lets that store land first gets a different summary."""
    k, proxy_dim = 3, 16
    device = triton_device() if kernel != "torch" else torch.device("cpu")
    step = make_step([23], [23], proxy_dim=proxy_dim, capacity=7 + k, summary_dtype=summary_dtype, device=device)
    prefill_k, prefill_z = step.index_k.clone(), step.index_z.clone()
    run(kernel, step)
    verify = make_step([k + 1], [27], proxy_dim=proxy_dim, capacity=7 + k, summary_dtype=summary_dtype)
    step.index_k, step.index_z = verify.index_k.to(device), verify.index_z.to(device)
    step.metadata = build_csa_ring_metadata(
        torch.tensor([0, k + 1], dtype=torch.int32, device=device), torch.tensor([27], dtype=torch.int32, device=device),
        step.ring_blocks, step.rows_per_block, step.summary_block_table, SUMMARY_BLOCK_SIZE, k + 1,
    )  # fmt: skip
    assert step.metadata.summary_slot[0] >= 0 and step.metadata.position[-1] == 26
    run(kernel, step)
    all_k = torch.cat([prefill_k, step.index_k])
    all_z = torch.cat([prefill_z, step.index_z])
    expected = summary_bytes(region_summary(all_k[16:24], all_z[16:24], summary_dtype))
    assert torch.equal(summary_bytes(step.summary_cache)[summary_slot(step, 0, 2)].cpu(), expected)
    base = int(step.ring_blocks[0]) * step.rows_per_block
    assert torch.equal(step.ring[base + 6], torch.cat([all_k[26], all_z[26]]))


# ------------------------------------------------------------------------------------------------------
# Triton kernel vs PyTorch kernel, and the kernel's rounding helpers
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_triton_kernel_matches_torch_kernel_bitwise(sample):
    """Same bits everywhere: both kernels fold with the same IEEE fp32 operations in the same order, the
    exp included (test_csa_ring_update_exp.py)."""
    op, args, kwargs = sample
    triton_args = copy_as_views(args, triton_device())  # the samples' page-strided, guarded layouts too
    op(*args, **kwargs)
    csa_ring_update_triton(*triton_args, **kwargs)
    assert torch.equal(triton_args[2].cpu().view(torch.int16), args[2].view(torch.int16))
    assert torch.equal(triton_args[3].cpu().view(torch.uint8), args[3].view(torch.uint8))



@pytest.mark.parametrize("summary_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_both_kernels_give_nan_summaries_for_nan_and_inf_logits(summary_dtype):
    """A NaN or +inf in ``index_z`` makes its dimension of the region's summary NaN in both kernels, as the
    reference's two-exp fold gives (``0 / 0``); the other dimensions keep the same bits. Before, the
    PyTorch kernel left the row and every later one out of a finite summary, and Triton's default
    ``max``/``min`` (``max.f32`` on a GPU, ``np.fmax`` in the interpreter) gave yet other finite bits."""
    step = make_step([16], [16], proxy_dim=16, capacity=10, summary_dtype=summary_dtype)
    z = step.index_z  # [16 tokens = 2 regions of 8, 16 dims]
    z[0, :4] = float("nan")  # row 0 of region 0: the fold's starting maximum
    z[2, 4:8] = float("nan")  # row 2 of region 0
    z[13, 8:12] = float("inf")  # row 5 of region 1
    z[8:16, 12] = -float("inf")  # a whole column of region 1
    regions = (slice(0, REGION_SIZE), slice(REGION_SIZE, 2 * REGION_SIZE))
    want = [region_summary(step.index_k[rows], z[rows], summary_dtype).float() for rows in regions]
    dims = torch.arange(16)
    nan_dims = [dims < 8, (dims // 4 == 2) | (dims == 12)]
    triton_args = [a.clone().to(triton_device()) if isinstance(a, torch.Tensor) else a for a in step.op_args()]
    torch.ops.stepops.csa_ring_update(*step.op_args())
    csa_ring_update_triton(*triton_args)
    triton_ring, triton_summary_cache = triton_args[2].cpu(), triton_args[3].cpu()
    assert torch.equal(triton_ring.view(torch.int16), step.ring.view(torch.int16))
    for summary_cache in (step.summary_cache, triton_summary_cache.view(summary_dtype)):
        for region in (0, 1):
            got = summary_cache[summary_slot(step, 0, region)].float()
            assert torch.equal(got.isnan(), nan_dims[region])
            torch.testing.assert_close(got, want[region], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_metadata_are_read_by_their_strides(kernel):
    """The five [T] metadata as columns of one [T, 5] table (stride 5): each token's own entries (the
    Triton kernel read `pointer + t`, i.e. other tokens' entries, and wrote wrong rows and summaries)."""
    step = make_step(
        [3, 9, 1], [16, 24, 8], proxy_dim=16, capacity=10, rows_per_block=12, num_padding=2,
        device=triton_device() if kernel != "torch" else "cpu",
    )  # fmt: skip
    table = torch.stack(list(step.metadata), dim=1)  # [T, 5]
    step.metadata = CSARingMetadata(*(table[:, i] for i in range(5)))
    assert step.metadata.position.stride() == (5,)
    _assert_step_matches_walk(step, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_inputs_of_different_row_strides_are_read_by_their_own(kernel):
    """``index_k`` and ``index_z`` as column slices of a [T, 2P] and a [T, 3P] tensor (row strides 32 and
    48): each is read by its own stride (one stride for both read one of them wrong)."""
    step = make_step([3, 9, 1], [16, 24, 8], proxy_dim=16, capacity=10, rows_per_block=12, num_padding=2,
                     device=triton_device() if kernel != "torch" else "cpu")  # fmt: skip
    for name, columns in (("index_k", 2), ("index_z", 3)):
        rows = getattr(step, name)
        wide = torch.zeros(rows.shape[0], columns * rows.shape[1], dtype=rows.dtype, device=rows.device)
        wide[:, rows.shape[1] : 2 * rows.shape[1]] = rows
        setattr(step, name, wide[:, rows.shape[1] : 2 * rows.shape[1]])
    assert (step.index_k.stride(0), step.index_z.stride(0)) == (32, 48)
    _assert_step_matches_walk(step, kernel)


@pytest.mark.parametrize("num_tokens, capacity", [(1, 7), (20, 10), (4, 10)])
def test_a_step_ending_at_the_last_int32_position_stores_every_row(num_tokens, capacity):
    """Positions are int32: a step whose last position is 2**31 - 1 has its end at 2**31. The Triton
    kernel computed it in int32 (-2**31), so the rows its replaying leader was to store were neither
    deferred to it nor kept by their own tokens: never stored."""
    gen = torch.Generator().manual_seed(0)
    k, z = (torch.randn(num_tokens, 4, generator=gen).to(torch.bfloat16) for _ in range(2))
    ring = torch.randn(capacity, 8, generator=gen).to(torch.bfloat16)
    summary = torch.zeros(1, 4, dtype=torch.bfloat16)
    metadata = build_csa_ring_metadata(
        torch.tensor([0, num_tokens]), torch.tensor([2**31], dtype=torch.int64), torch.tensor([0]), capacity,
        torch.tensor([[-1]], dtype=torch.int32), 4, num_tokens,
    )
    want = ring.clone()
    csa_ring_update_torch(k, z, want, summary.clone(), *metadata, capacity)
    for q in range(2**31 - min(num_tokens, capacity), 2**31):  # the step's stored rows, the reference's rule
        assert torch.equal(want[q % capacity], torch.cat([k[q - 2**31 + num_tokens], z[q - 2**31 + num_tokens]]))
    args = copy_as_views((k, z, ring.clone(), summary.clone(), *metadata, capacity), triton_device())
    csa_ring_update_triton(*args)
    assert torch.equal(args[2].cpu().view(torch.int16), want.view(torch.int16))


_ROOT = Path(__file__).resolve().parents[2]
# A leader at position 2**31 - 1 leading a 12-token chunk of padding, its request's ring at rows [7, 14).
_LEADER_PAST_INT32 = """
import torch
T, capacity = 12, 7
k, z = (torch.randn(T, 4).to(torch.bfloat16) for _ in range(2))
ring = torch.randn(2 * capacity, 8).to(torch.bfloat16)
position = torch.full((T,), -1, dtype=torch.int32)
position[0] = 2**31 - 1
metadata = [position] + [torch.full((T,), v, dtype=torch.int32) for v in (0, T, capacity, -1)]
args = (k, z, ring.clone(), torch.zeros(1, 4, dtype=torch.bfloat16), *metadata, capacity)
"""
# Run in its own process: the out-of-range read this guards against is a segfault under the interpreter
# (an illegal address on a GPU), which would end the test session instead of failing one test.
_ON_TRITON = """
from stepops.ops.csa_ring_update.triton_kernel import csa_ring_update_triton
from stepops.testing import StorageSnapshot, copy_as_views

args = copy_as_views(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
snapshot = StorageSnapshot(args)
csa_ring_update_triton(*args)
assert snapshot.changed_outside_views() == 0
assert torch.equal(args[2][:capacity].cpu(), ring[:capacity]), "wrote another request's ring"
print("ok")
"""


def test_a_leader_whose_position_breaks_its_requests_stays_inside_the_step():
    """Metadata the PyTorch kernel accepts (every id in range) but that break the caller's invariants. The
    Triton kernel's first stored position, ``start + chunk_len - capacity``, was int32 and wrapped to
    -2**31 + 4, so the leader loaded its deferred rows ~2**32 rows before the step's inputs. Whatever the
    metadata, it reads only the step's rows and writes only its request's ring."""
    scope: dict = {}
    exec(_LEADER_PAST_INT32, scope)
    csa_ring_update_torch(*scope["args"])  # accepted: no ValueError
    assert torch.equal(scope["args"][2], scope["ring"])  # the leader is not among its chunk's last 7 tokens
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _LEADER_PAST_INT32 + _ON_TRITON], capture_output=True,
                            text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr[-3000:] or f"exit {result.returncode}"


def test_empty_rows_p0_run_on_both_kernels():
    """P = 0 (empty rows) is accepted by the argument checks: the Triton kernel must run, as the PyTorch
    kernel does, rather than fail on an empty arange."""
    step = make_step([3, 9], [16, 24], proxy_dim=16, capacity=8, num_padding=1)
    args = list(step.op_args())
    args[0], args[1], args[3] = args[0][:, :0], args[1][:, :0], args[3][:, :0]
    args[2] = torch.zeros(args[2].shape[0], 0, dtype=torch.bfloat16)
    torch.ops.stepops.csa_ring_update(*args)
    device = triton_device()
    csa_ring_update_triton(*copy_as_views(args, device))


def test_rows_past_tritons_tensor_limit_are_not_implemented_on_triton_and_run_on_cpu():
    """P = 2**17 + 1: the deferred rows' [8, 2**18] tile is past the 2**20 elements of a Triton tensor, and
    Triton's compile error named no argument. The PyTorch kernel (the CPU path) runs it."""
    proxy_dim = 2**17 + 1
    step = make_step([8], [8], proxy_dim=proxy_dim, capacity=8, generator=torch.Generator().manual_seed(0))
    args = list(step.op_args())
    torch.ops.stepops.csa_ring_update(*args)
    with pytest.raises(NotImplementedError, match=r"csa_ring_update: P = 131073 needs a \[8, 262144\] tile per program"):
        csa_ring_update_triton(*copy_as_views(list(step.op_args()), triton_device()))


# ------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------


def _valid_args():
    step = make_step([3, 9], [10, 15], proxy_dim=16, capacity=10, num_padding=1)
    return step, list(step.op_args())


def _replace(index, value):
    def mutate(args):
        args[index] = value(args[index]) if callable(value) else value

    return mutate


BAD_INPUTS = {
    "index_k_float32": (_replace(0, lambda t: t.float()), TypeError, "index_k must be bfloat16"),
    "index_z_float32": (_replace(1, lambda t: t.float()), TypeError, "index_z must be bfloat16"),
    "index_z_shape": (_replace(1, lambda t: t[:, :8]), ValueError, r"must both be \[T, P\]"),
    "ring_row_width": (_replace(2, lambda t: t[:, :24]), ValueError, "ring rows have 24 values"),
    "ring_too_small": (_replace(2, lambda t: t[:9]), ValueError, "fewer than capacity 10"),
    "ring_dtype": (_replace(2, lambda t: t.float()), TypeError, "ring must be bfloat16"),
    "summary_dtype": (_replace(3, lambda t: t.half()), TypeError, "summary_cache must be bfloat16, float8"),
    "summary_width": (_replace(3, lambda t: t[:, :8]), ValueError, r"summary_cache must be \[num_slots, 16\]"),
    "metadata_length": (_replace(4, lambda t: t[:-1]), ValueError, r"token_position must be \[T\]"),
    "metadata_dtype": (_replace(8, lambda t: t.long()), TypeError, "token_summary_slot must be int32"),
    "capacity_below_7": (_replace(9, 6), ValueError, "capacity 6 < 7"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_clear_errors_in_both_kernels_and_the_fake(name):
    mutate, error, message = BAD_INPUTS[name]
    _, args = _valid_args()
    mutate(args)
    with pytest.raises(error, match=message):
        torch.ops.stepops.csa_ring_update(*args)
    with pytest.raises(error, match=message):
        csa_ring_update_triton(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(error, match=message):
            torch.ops.stepops.csa_ring_update(*fake_args)


VALIDATE_CASES = {
    "slot_out_of_range": ("summary_slot", lambda m: torch.where(m >= 0, m + 1000, m), r"token_summary_slot must be -1 or in \[0, 8\)"),
    "slot_minus_2": ("summary_slot", lambda m: torch.where(m >= 0, -2, m), r"token_summary_slot must be -1 or in .*got \[-2"),
    "duplicate_slots": ("summary_slot", lambda m: torch.where(m >= 0, m.clamp(min=0).max(), m), "same summary_slot"),
    "ring_base_out_of_range": ("ring_base", lambda m: torch.where(m >= 0, m + 10_000, m), "ring_base is outside"),
    "chunk_past_T": ("chunk_len", lambda m: torch.where(m >= 0, m + 5, m), "run past T"),
    # The step: request 0 = tokens 0..2, request 1 = tokens 3..11 (rings 10 rows), token 12 padding.
    "rings_share_a_base": ("ring_base", lambda m: torch.where(m >= 0, m[0], m), "rings .* overlap"),
    "rings_overlap_by_one_row": (
        "ring_base", lambda m: torch.where(m >= 0, torch.where(m == m[0], 0, 9), m).int(), "rings at ring_base 0 and 9",
    ),
    "token_before_its_chunk": ("chunk_start", lambda m: torch.where(m > 0, m + 1, m), "token 3 lies outside"),
    "positions_not_consecutive": ("position", lambda m: torch.where(m >= 0, 2 * m, m), "not consecutive"),
    "chunk_len_disagrees": (
        "chunk_len", lambda m: torch.where(torch.arange(m.numel()) == 4, m - 1, m), "tokens 3 and 4 of one chunk",
    ),
    "short_seq_lens": (
        "position", lambda m: torch.where(torch.arange(m.numel()) == 3, -1, m),
        "token 3 belongs to the chunk at 3 but has position -1: its request's seq_lens is shorter",
    ),
    "positions_backwards": (
        "position", lambda m: torch.where(torch.arange(m.numel()) == 4, m[3] - 1, m),
        "positions run backwards in one chunk: token 3 at 6, token 4 at 5",
    ),
    "positions_repeat": (
        "position", lambda m: torch.where(torch.arange(m.numel()) == 4, m[3], m),
        "positions run backwards in one chunk: token 3 at 6, token 4 at 6",
    ),
    # Rings at rows 12 and 30: disjoint, inside the ring, but their bases' gcd 6 < capacity 10 shows
    # metadata built with rows_per_block < capacity (each ring would run into the next block's).
    "capacity_above_rows_per_block": (
        "ring_base", lambda m: torch.where(m >= 0, torch.where(m == m[0], 12, 30), m).int(),
        "capacity 10 exceeds rows_per_block: every ring_base is a multiple of 6 rows",
    ),
    # Caught by later rules too (token 3 outside its chunk, tokens disagreeing), but named here plainly.
    "chunk_start_negative": (
        "chunk_start", lambda m: torch.where(m == 3, -1, m), "token 3 has token_chunk_start -1 and token_chunk_len 9",
    ),
    "chunk_len_zero": ("chunk_len", lambda m: torch.where(m == 9, 0, m), "token 3 has token_chunk_start 3 and token_chunk_len 0"),
    "chunk_covers_padding": ("chunk_len", lambda m: torch.where(m == 9, 10, m), "token 12 is inside the chunk"),
    # Padding writes nothing, but a slot on it is a builder bug; before, it passed, or, when the slot was a
    # real token's, was reported as two tokens writing one summary slot.
    "padding_with_a_summary_slot": (
        "summary_slot", lambda m: torch.where(torch.arange(m.numel()) == 12, 0, m).int(),
        "padding token 12 has token_summary_slot 0; padding carries -1",
    ),
}  # fmt: skip


def test_non_int_capacity_is_a_type_error():
    """The dispatcher rejects it for the op (schema ``SymInt``); the launcher checks it itself."""
    _, args = _valid_args()
    args[9] = 10.0
    with pytest.raises(TypeError, match="capacity must be an int"):
        csa_ring_update_triton(*args)
    with pytest.raises((TypeError, RuntimeError), match="capacity"):
        torch.ops.stepops.csa_ring_update(*args)


@pytest.mark.parametrize("name", list(VALIDATE_CASES))
def test_validate_mode_checks_ranges_on_the_host(name):
    field, change, message = VALIDATE_CASES[name]
    step, _ = _valid_args()
    csa_ring_update(step.index_k, step.index_z, step.ring, step.summary_cache, step.metadata, 10, validate=True)
    metadata = step.metadata._replace(**{field: change(getattr(step.metadata, field))})
    with pytest.raises(ValueError, match=message):
        csa_ring_update(step.index_k, step.index_z, step.ring, step.summary_cache, metadata, 10, validate=True)


@pytest.mark.parametrize("name", list(VALIDATE_CASES))
def test_the_host_validator_itself_rejects_each_case(name):
    """The validator alone, as ``validate=True`` runs it before the Triton kernel on a GPU: there no kernel
    raises after it, so a check it drops (a summary slot past the cache, say) goes unreported, while on
    CPU the PyTorch kernel's own id checks raise the same message and hide the gap. It reads the metadata
    back to the host and checks it there whatever the caller's default device (meta here: a host tensor
    made on it has no data)."""
    field, change, message = VALIDATE_CASES[name]
    step, _ = _valid_args()
    metadata = step.metadata._replace(**{field: change(getattr(step.metadata, field))})
    with torch.device("meta"):
        validate_csa_ring_update_inputs(step.index_k, step.index_z, step.ring, step.summary_cache, step.metadata, 10)
        with pytest.raises(ValueError, match=message):
            validate_csa_ring_update_inputs(step.index_k, step.index_z, step.ring, step.summary_cache, metadata, 10)


def test_validate_given_rows_per_block_keeps_every_ring_inside_its_own_block():
    """The step's two rings in 10-row blocks, moved to rows 15 and 30: they stay disjoint and
    their gcd (15) is not below capacity, so without the ring's rows_per_block the validator passes them,
    while the ring at row 15 runs into block 2, a request's outside this step; with it, named."""
    step, _ = _valid_args()
    args = (step.index_k, step.index_z, step.ring, step.summary_cache)
    validate_csa_ring_update_inputs(*args, step.metadata, 10, rows_per_block=10)
    with pytest.raises(ValueError, match="capacity 10 exceeds rows_per_block 8: every ring runs into"):
        validate_csa_ring_update_inputs(*args, step.metadata, 10, rows_per_block=8)
    base = step.metadata.ring_base
    off_grid = step.metadata._replace(ring_base=torch.where(base < 0, base, torch.tensor([15] * 3 + [30] * 10)).int())
    validate_csa_ring_update_inputs(*args, off_grid, 10)
    with pytest.raises(ValueError, match="ring_base 15 is not a multiple of rows_per_block 10: .* inside block 1"):
        csa_ring_update(*args, off_grid, 10, validate=True, rows_per_block=10)
    with pytest.raises(TypeError, match="rows_per_block must be an int"):
        csa_ring_update(*args, step.metadata, 10, validate=True, rows_per_block=10.0)


def test_validate_reports_its_own_message_under_torch_compile():
    """validate=True runs outside the graph (torch.compiler.disable): its own message under torch.compile,
    not Dynamo's data-dependent guard error."""
    field, change, message = VALIDATE_CASES["positions_backwards"]
    step, _ = _valid_args()
    metadata = step.metadata._replace(**{field: change(getattr(step.metadata, field))})
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: csa_ring_update(*args, validate=True), backend="eager")
    with pytest.raises(ValueError, match=message):
        compiled(step.index_k, step.index_z, step.ring, step.summary_cache, metadata, 10)


# ------------------------------------------------------------------------------------------------------
# The metadata builder
# ------------------------------------------------------------------------------------------------------


def test_metadata_builder_matches_a_python_walk():
    """Zero-length (padded) requests, padding tokens, negative and missing summary blocks."""
    query_lens = [5, 0, 1, 17, 0, 4]
    seq_lens = [13, 0, 40, 17, 0, 56]  # request 5 closes region 6, whose table column 3 is past the width
    num_tokens = sum(query_lens) + 4
    rows_per_block, block_size = 11, 2
    ring_blocks = torch.tensor([7, -1, 3, 1, -1, 5], dtype=torch.int32)  # requests without tokens: no ring
    table = torch.randint(0, 40, (6, 3), dtype=torch.int32)
    table[2, 2] = -1  # region 4 of request 2 (position 39) has no summary block
    qsl = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    metadata = build_csa_ring_metadata(
        qsl, torch.tensor(seq_lens, dtype=torch.int32), ring_blocks, rows_per_block, table, block_size, num_tokens
    )
    expected = {name: [-1] * num_tokens for name in CSARingMetadata._fields}
    flat = 0
    for r, (n, seq_len) in enumerate(zip(query_lens, seq_lens)):
        for t in range(n):
            p = seq_len - n + t
            expected["position"][flat + t] = p
            expected["chunk_start"][flat + t] = flat
            expected["chunk_len"][flat + t] = n
            expected["ring_base"][flat + t] = int(ring_blocks[r]) * rows_per_block
            region = p // 8
            if p % 8 == 7 and region // block_size < table.shape[1] and table[r, region // block_size] >= 0:
                expected["summary_slot"][flat + t] = int(table[r, region // block_size]) * block_size + region % 2
        flat += n
    assert sum(slot >= 0 for slot in expected["summary_slot"]) == 2  # positions 7 and 15 of request 3
    for name in CSARingMetadata._fields:
        got = getattr(metadata, name)
        assert got.dtype == torch.int32 and got.shape == (num_tokens,)
        assert got.tolist() == expected[name], name


def test_metadata_builder_names_a_summary_block_table_without_columns():
    with pytest.raises(ValueError, match=r"build_csa_ring_metadata: summary_block_table must be \[R = 1, max_blocks >= 1\], got \(1, 0\)"):
        build_csa_ring_metadata(
            torch.tensor([0, 1]), torch.tensor([8]), torch.tensor([0]), 8, torch.zeros(1, 0, dtype=torch.int32), 4, 1
        )


def test_validate_finds_a_last_chunk_one_token_past_t():
    """No padding after the last request: its chunk running one row past T is caught by the validator
    itself (the kernels' own id check would hide a validator that only caught longer overruns)."""
    step = make_step([3, 9], [10, 15], proxy_dim=16, capacity=10)
    chunk_len = torch.where(step.metadata.chunk_start == 3, 10, step.metadata.chunk_len).int()
    metadata = step.metadata._replace(chunk_len=chunk_len)
    with pytest.raises(ValueError, match="run past T = 12"):
        validate_csa_ring_update_inputs(step.index_k, step.index_z, step.ring, step.summary_cache, metadata, 10)


def _builder_args():
    """One request of 4 new tokens at positions 23..26, ring in block 1, summaries in blocks 0 and 1."""
    return {
        "query_start_loc": torch.tensor([0, 4], dtype=torch.int32),
        "seq_lens": torch.tensor([27], dtype=torch.int32),
        "ring_blocks": torch.tensor([1], dtype=torch.int32),
        "rows_per_block": 10,
        "summary_block_table": torch.tensor([[0, 1]], dtype=torch.int32),
        "summary_block_size": 4,
        "num_tokens": 4,
    }


@pytest.mark.parametrize(
    "name, value, error, match",
    [
        ("seq_lens", torch.tensor([[27]], dtype=torch.int32), ValueError, r"seq_lens must be \[R\], got \(1, 1\)"),
        ("ring_blocks", torch.tensor([1, 2], dtype=torch.int32), ValueError, r"ring_blocks must be \[R\] = \[1\], got \(2,\)"),
    ],
    ids=["seq_lens_2d", "ring_blocks_per_token"],
)
def test_metadata_builder_names_a_bad_shape(name, value, error, match):
    """Shapes only: wrong types and dtypes are in test_wrapper_arg_types."""
    args = _builder_args() | {name: value}
    with pytest.raises(error, match=f"build_csa_ring_metadata: {match}"):
        build_csa_ring_metadata(**args)


@pytest.mark.parametrize("on_meta", ["seq_lens", "ring_blocks", "summary_block_table"])
def test_metadata_builder_rejects_inputs_on_different_devices(on_meta):
    """``meta`` tensors stand in for a second device on a CPU-only machine."""
    args = _builder_args()
    args[on_meta] = args[on_meta].to("meta")
    with pytest.raises(ValueError, match=f"build_csa_ring_metadata: {on_meta} is on meta, query_start_loc on cpu"):
        build_csa_ring_metadata(**args)


# ------------------------------------------------------------------------------------------------------
# The docs example runs
# ------------------------------------------------------------------------------------------------------


def test_docs_example_runs():
    text = (Path(__file__).parents[2] / "docs" / "ops.md").read_text()
    section = text.split("## `csa_ring_update`", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the csa_ring_update section has a python example"
    for code in blocks:
        exec(compile(code, "docs/ops.md", "exec"), {})


@triton.jit
def _fold_rows(k_ptr, z_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The Triton kernel's fold of 8 ``[n]`` fp32 rows with its own ``fold_step``, stored in fp32 (no
    rounding to bf16): rows 0..7 in order, then ``div_rn(a, s)`` as the kernel divides."""
    d = tl.arange(0, BLOCK)
    mask = d < n
    m = tl.load(z_ptr + d, mask=mask, other=0.0)
    a = tl.load(k_ptr + d, mask=mask, other=0.0)
    s = tl.full([BLOCK], 1.0, dtype=tl.float32)
    for j in tl.static_range(1, 8):
        z = tl.load(z_ptr + j * n + d, mask=mask, other=0.0)
        k = tl.load(k_ptr + j * n + d, mask=mask, other=0.0)
        m, s, a = fold_step(m, s, a, z, k)
    tl.store(out_ptr + d, tl.math.div_rn(a, s), mask=mask)


@pytest.mark.parametrize("z_scale", [1.0, 30.0])
def test_triton_fold_step_is_the_documented_fold_bitwise_in_fp32(z_scale):
    """The Triton kernel's fold step, in fp32 before the bf16/fp8 rounding that hides an ulp, against the
    documented two-exp fold in numpy (``reference.fold``): equal bits, ties and underflow
    included. A changed order, an fp32 library exp or a fused multiply-add in ``fold_step`` fails here."""
    if triton_device().type != "cpu":
        pytest.skip("the interpreter's numpy arithmetic is the reference's; a GPU's exp path is checked by the GPU tests")
    generator = torch.Generator().manual_seed(5)
    z = (torch.randn(8, 1024, generator=generator) * z_scale).bfloat16().float()
    z[3] = z[2]
    k = torch.randn(8, 1024, generator=generator).bfloat16().float()
    out = torch.empty(1024)
    _fold_rows[(1,)](k, z, out, 1024, BLOCK=1024)
    want = fold(k.numpy(), z.numpy())
    assert np.array_equal(out.numpy().view(np.uint32), want.view(np.uint32))


def test_triton_fold_step_is_the_documented_fold_with_nan_and_inf_logits():
    """NaN where the documented fold gives NaN (a NaN or +inf logit, a column of -inf), the same bits
    elsewhere; Triton's default max/min and a factor of exactly 1 both gave finite summaries there."""
    if triton_device().type != "cpu":
        pytest.skip("the interpreter's numpy arithmetic is the reference's; a GPU's exp path is checked by the GPU tests")
    k, z = special_logits()
    out = torch.empty(z.shape[1])
    with np.errstate(invalid="ignore"):  # inf - inf and 0 / 0 in numpy, the interpreter's arithmetic
        _fold_rows[(1,)](k, z, out, z.shape[1], BLOCK=z.shape[1])
        want = fold(k.numpy(), z.numpy())
    assert_same_bits_or_both_nan(out.numpy(), want)


def test_summary_matches_textbook_softmax_within_tolerance():
    """The op's summaries are the softmax-weighted sums they claim to be (independent of their bits).

    A prefill of 50 regions (every summary replayed from the step's inputs) and a decode step closing a
    region from the ring; z is scaled so the softmax is far from uniform."""
    step = make_step([399], [399], proxy_dim=64, capacity=10, num_padding=1)
    step.index_z.mul_(4)
    csa_ring_update(step.index_k, step.index_z, step.ring, step.summary_cache, step.metadata, 10, validate=True)
    k_rows, z_rows = step.index_k[:399], step.index_z[:399]
    decode = make_step([1], [400], proxy_dim=64, capacity=10)
    decode.index_z.mul_(4)
    step.index_k, step.index_z = decode.index_k, decode.index_z
    step.metadata = build_csa_ring_metadata(
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([400], dtype=torch.int32), step.ring_blocks,
        step.rows_per_block, step.summary_block_table, SUMMARY_BLOCK_SIZE, 1,
    )  # fmt: skip
    csa_ring_update(step.index_k, step.index_z, step.ring, step.summary_cache, step.metadata, 10, validate=True)
    k_rows, z_rows = torch.cat([k_rows, step.index_k]), torch.cat([z_rows, step.index_z])
    for region in range(50):
        got = step.summary_cache[summary_slot(step, 0, region)].double()
        want = softmax_summary(k_rows[8 * region : 8 * region + 8], z_rows[8 * region : 8 * region + 8])
        torch.testing.assert_close(
            got, want, atol=_SOFTMAX_TOLERANCE.atol, rtol=_SOFTMAX_TOLERANCE.rtol, msg=f"region {region}"
        )


def test_compiled_wrapper_matches_eager_in_place():
    """fullgraph compile of the wrapper (an fp8 summary cache, the ring as an as_strided view of the cache)
    writes the same bytes into the same tensors as eager. When the wrapper passed the fp8 cache on as a
    uint8 view, torch 2.11's Inductor copied that view back into the cache as values, changing every row."""
    steps = [
        make_step([3, 9], [10, 15], proxy_dim=16, capacity=10, rows_per_block=12, num_padding=1,
                  summary_dtype=torch.float8_e4m3fn, generator=torch.Generator().manual_seed(1))
        for _ in range(2)
    ]  # fmt: skip
    before = steps[0].cache.clone()

    def update(index_k, index_z, ring, summary_cache, metadata):
        csa_ring_update(index_k, index_z, ring, summary_cache, metadata, 10)

    compiled = torch.compile(update, fullgraph=True, backend="inductor")
    compiled(steps[0].index_k, steps[0].index_z, steps[0].ring, steps[0].summary_cache, steps[0].metadata)
    update(steps[1].index_k, steps[1].index_z, steps[1].ring, steps[1].summary_cache, steps[1].metadata)
    assert not torch.equal(steps[0].cache, before)
    assert torch.equal(steps[0].cache, steps[1].cache)
    assert torch.equal(summary_bytes(steps[0].summary_cache), summary_bytes(steps[1].summary_cache))


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_summaries_saturate_at_448_instead_of_overflowing_to_nan(kernel):
    """An fp8 summary past e4m3fn's largest value 448 is stored as +-448 (codes 0x7E / 0xFE), never as the
    NaN code 0x7F that a bare cast gives. Equal logits make the summary exactly the rows' shared k, so the
    expected codes follow by hand: k = +-1000 saturates, k = 1.5 is exact (code 0x3C). No random sample's
    summary comes near 448, so only this test sees a kernel that skips the clamp. For the PyTorch kernel that
    holds where torch's own cast does not saturate (torch 2.11's eager cast gives the NaN code; 2.13's CPU
    cast saturates, so there a missing clamp passes); the Triton kernel's encoder saturates itself."""
    device = triton_device() if kernel != "torch" else torch.device("cpu")
    step = make_step([16], [16], proxy_dim=16, capacity=10, summary_dtype=torch.float8_e4m3fn, device=device)
    step.index_z.zero_()
    step.index_k[:, :4] = 1000.0
    step.index_k[:, 4:8] = -1000.0
    step.index_k[:, 8:] = 1.5
    run(kernel, step)
    want = torch.tensor([0x7E] * 4 + [0xFE] * 4 + [0x3C] * 8, dtype=torch.uint8)
    for region in (0, 1):
        got = summary_bytes(step.summary_cache)[summary_slot(step, 0, region)].cpu()
        assert got.tolist() == want.tolist(), f"region {region}"
