"""``stepops::sconv``: its per-token reference, poisoned caches, streams, bad input, the Triton kernel bitwise.

Multi-step behaviour (chunk and batch invariance, speculative decoding against ``nn.Conv1d``) is in
``test_sconv_steps.py``.
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import triton_device
from stepops.layouts import InklingStream
from stepops.ops.sconv import SconvMetadata, build_sconv_metadata, sconv
from stepops.ops.sconv.reference import sconv_reference
from stepops.ops.sconv.samples import SAMPLE_LAYOUT, random_block_table, sample_cache, step_metadata
from stepops.ops.sconv.torch_kernel import silu_fp32
from stepops.ops.sconv.triton_kernel import sconv_triton, silu_fp32 as triton_silu_fp32
from stepops.ops.sconv.validate import validate_sconv_inputs
from stepops.ops.bounds import error_counter
from stepops.testing import TOLERANCES, copy_as_views, op_samples

_SAMPLES = list(op_samples(op_name="sconv"))
_DOCS = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def _split(args):
    """A sample's positional args as (x, weight, cache, block_table, metadata, stream_offset)."""
    x, weight, cache, block_table, *metadata, stream_offset = args
    return x, weight, cache, block_table, SconvMetadata(*metadata), stream_offset


def _base(cache: torch.Tensor) -> torch.Tensor:
    """The whole storage behind a (possibly page-strided) cache view, as int16 so NaN bits compare too."""
    flat = torch.as_strided(cache, (cache.untyped_storage().nbytes() // cache.element_size(),), (1,), 0)
    return flat.view(torch.int16)


def _poison(cache: torch.Tensor) -> None:
    """Fill the cache's whole storage (the gaps of a page-strided view too) with random bits, NaNs included."""
    base = _base(cache)
    base.copy_(torch.randint(-(2**15), 2**15, base.shape, dtype=torch.int16))


def _reference(x, weight, cache, block_table, metadata: SconvMetadata, stream_offset, **flags):
    """``sconv_reference`` on a CPU copy of the cache's whole storage: ``(y, that storage as int16)``."""
    base = _base(cache).cpu().clone()
    copy = torch.as_strided(base.view(torch.bfloat16), cache.shape, cache.stride(), cache.storage_offset())
    cpu = [t.cpu() for t in (x, weight, block_table, *metadata)]
    y = sconv_reference(cpu[0], cpu[1], copy, cpu[2], *cpu[3:], stream_offset, **flags)
    return y, base


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_matches_per_token_reference_and_stores_only_its_slots(sample):
    """Same arithmetic order as the reference, so bitwise; the whole storage outside the slots is unchanged."""
    x, weight, cache, block_table, metadata, offset = _split(sample.args)
    want_y, want_storage = _reference(x, weight, cache, block_table, metadata, offset, **sample.kwargs)
    y = sconv(x, weight, cache, block_table, metadata, offset, validate=True, **sample.kwargs)
    assert torch.equal(y, want_y)
    assert torch.equal(_base(cache), want_storage)


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_triton_kernel_matches_torch_kernel(sample):
    """Interpreter (or GPU, FMA contraction off) vs the PyTorch kernel: the same bits, SiLU within one ulp.

    Without SiLU both kernels do the same fp32 operations in the same order and round once with RNE, so
    the outputs must be bitwise equal. With SiLU the interpreter's exp is numpy's (a GPU's is ex2.approx),
    which differs from PyTorch's in the last fp32 bits: ``TOLERANCES["sconv_silu"]``.
    """
    device = triton_device()
    x, weight, cache, block_table, metadata, offset = _split(sample.args)
    cache_want = cache.clone()
    y_want = torch.ops.stepops.sconv(x, weight, cache_want, block_table, *metadata, offset, **sample.kwargs)
    cache_got, *moved = copy_as_views((cache, x, weight, block_table, *metadata), device)
    y_got = sconv_triton(moved[0], moved[1], cache_got, moved[2], *moved[3:], offset, **sample.kwargs).cpu()
    assert torch.equal(cache_got.cpu(), cache_want)
    if sample.kwargs["silu"]:
        tol = TOLERANCES["sconv_silu"]
        torch.testing.assert_close(y_got.float(), y_want.float(), atol=tol.atol, rtol=tol.rtol)
    else:
        assert torch.equal(y_got, y_want)


def _step(stream, *, prior_lens, new_lens, num_tokens, block_size=None, block_gap=0, seed=0, device=None):
    """One random step of the sample layout: (x, weight, cache, block_table, metadata, offset), on ``device``
    (CPU by default)."""
    generator = torch.Generator().manual_seed(seed)
    offset, width = SAMPLE_LAYOUT.stream_range(stream)
    shape = SAMPLE_LAYOUT.cache_shape(num_blocks=32, block_size=block_size)
    n = shape[2]
    max_blocks = max(-(-(p + k) // n) for p, k in zip(prior_lens, new_lens))
    device = device or torch.device("cpu")
    block_table = random_block_table(len(new_lens), max_blocks, shape[0], generator=generator, device=device)
    metadata = step_metadata(prior_lens, new_lens, block_table, n, num_tokens)
    channels = SAMPLE_LAYOUT.local_num_kv_heads * width
    x = torch.randn(num_tokens, channels, generator=generator).to(device=device, dtype=torch.bfloat16)
    weight = torch.randn(channels, SAMPLE_LAYOUT.kernel_size, generator=generator).to(device=device, dtype=torch.bfloat16)
    cache = sample_cache(shape, block_gap=block_gap, generator=generator, device=device)
    return x, weight, cache, block_table, metadata, offset


_KERNELS = {
    "torch": lambda x, w, c, bt, m, o, **kw: torch.ops.stepops.sconv(x, w, c, bt, *m, o, **kw),
    "triton": lambda x, w, c, bt, m, o, **kw: sconv_triton(x, w, c, bt, *m, o, **kw),
}


# The poison holds Inf/NaN bit patterns that taps read; numpy (the interpreter) warns on the Inf products.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_four_streams_never_overwrite_each_other_and_padding_writes_nothing(kernel):
    """All four streams of one step into one poisoned, page-strided cache; every byte is accounted for.

    The step has padding tokens (NaN inputs) and one real token with slot -1 (computed, not stored). Every
    output matches the per-token reference over the cache as it was before the stream's call; taps that
    read poison (NaN, Inf) must give NaN where the reference does.
    """
    run = _KERNELS[kernel]
    device = triton_device() if kernel == "triton" else torch.device("cpu")
    _, _, cache, block_table, metadata, _ = _step(
        InklingStream.K, prior_lens=[6, 0, 3], new_lens=[3, 5, 1], num_tokens=12, block_gap=40, device=device
    )
    _poison(cache)
    slot_mapping = metadata.slot_mapping.clone()
    slot_mapping[4] = -1  # a real token of request 1 that the engine does not store
    metadata = metadata._replace(slot_mapping=slot_mapping)
    padding = metadata.token_request < 0
    for stream in InklingStream:
        offset, width = SAMPLE_LAYOUT.stream_range(stream)
        channels = SAMPLE_LAYOUT.local_num_kv_heads * width
        x = torch.randn(metadata.token_request.numel(), channels).to(device=device, dtype=torch.bfloat16)
        x[padding] = float("nan")
        weight = torch.randn(channels, SAMPLE_LAYOUT.kernel_size).to(device=device, dtype=torch.bfloat16)
        want_y, want = _reference(x, weight, cache, block_table, metadata, offset)
        y = run(x, weight, cache, block_table, metadata, offset)
        assert torch.equal(_base(cache).cpu(), want), stream.name
        assert torch.equal(y[padding], torch.zeros_like(y[padding])), stream.name
        assert not y[4].isnan().any() and not y[~padding].eq(0).all(), stream.name
        torch.testing.assert_close(y.cpu(), want_y, atol=0, rtol=0, equal_nan=True, msg=stream.name)


def test_block_smaller_than_kernel_reads_across_several_blocks():
    """N = 2 < W - 1: a token's taps span three blocks; the op needs no relation between N and W."""
    shape = (16, SAMPLE_LAYOUT.local_num_kv_heads, 2, SAMPLE_LAYOUT.head_size)
    cache = torch.randn(shape).to(torch.bfloat16)
    offset, width = SAMPLE_LAYOUT.stream_range(InklingStream.MLP_OUT)
    block_table = random_block_table(2, 6, 16, generator=torch.Generator().manual_seed(1), device=torch.device("cpu"))
    metadata = step_metadata([5, 9], [2, 1], block_table, 2, 4)
    x = torch.randn(4, 2 * width).to(torch.bfloat16)
    weight = torch.randn(2 * width, 4).to(torch.bfloat16)
    want, _ = _reference(x, weight, cache, block_table, metadata, offset)
    assert torch.equal(sconv(x, weight, cache, block_table, metadata, offset, validate=True), want)



@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_strided_metadata_are_read_by_their_strides(kernel):
    """The four [T] metadata as columns of one [T, 4] table (stride 4): each token's own entries, in both
    kernels (the Triton kernel read `pointer + t`, i.e. other tokens' entries, and stored to wrong slots)."""
    device = triton_device() if kernel == "triton" else torch.device("cpu")
    x, weight, cache, block_table, metadata, offset = _step(
        InklingStream.V, prior_lens=[2, 5], new_lens=[3, 1], num_tokens=6, device=device
    )
    want_y, want_storage = _reference(x, weight, cache, block_table, metadata, offset)
    table = torch.stack(list(metadata), dim=1)  # [T, 4]
    strided = SconvMetadata(*(table[:, i] for i in range(4)))
    assert strided.slot_mapping.stride() == (4,)
    y = _KERNELS[kernel](x, weight, cache, block_table, strided, offset)
    assert torch.equal(y.cpu(), want_y)
    assert torch.equal(_base(cache).cpu(), want_storage)


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_an_empty_cache_serves_a_step_that_neither_reads_nor_stores_it(kernel):
    """num_blocks = 0 (the argument checks accept it): a prefill from position 0 with slot -1 reads no
    cache slot, so both kernels return the conv of x (the PyTorch kernel gathered block 0: an IndexError)."""
    device = triton_device() if kernel == "triton" else torch.device("cpu")
    cache = torch.zeros(0, 2, 4, 8, dtype=torch.bfloat16, device=device)
    x = torch.randn(3, 6).to(device=device, dtype=torch.bfloat16)
    weight = torch.randn(6, 4).to(device=device, dtype=torch.bfloat16)
    block_table = torch.full((1, 1), -1, dtype=torch.int32, device=device)
    metadata = SconvMetadata(*(torch.tensor(v, dtype=torch.int32, device=device)
                               for v in ([0, 0, -1], [0, 0, -1], [-1, -1, -1], [0, 1, -1])))  # fmt: skip
    want_y, _ = _reference(x, weight, cache, block_table, metadata, 0)
    y = _KERNELS[kernel](x, weight, cache, block_table, metadata, 0)
    assert torch.equal(y.cpu(), want_y)


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_taps_before_position_zero_are_zero_even_when_the_chunk_starts_below_it(kernel):
    """Short ``seq_lens`` (only ``validate=True`` names them): token 2 of a 3-token chunk at position 1, so
    ``p0 = -1``. Its taps at positions -2 and -1 are zero as the docs say, not rows 0 and -1 of ``x``
    (the kernels took ``q >= p0`` before ``q < 0``)."""
    device = triton_device() if kernel == "triton" else torch.device("cpu")
    cache = torch.zeros(2, 2, 4, 8, dtype=torch.bfloat16, device=device)
    x = torch.randn(3, 6).to(device=device, dtype=torch.bfloat16)
    weight = torch.randn(6, 4).to(device=device, dtype=torch.bfloat16)
    block_table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    metadata = SconvMetadata(*(torch.tensor(v, dtype=torch.int32, device=device)
                               for v in ([0, 0, 0], [0, 0, 0], [-1, 0, 1], [0, 0, 1])))  # fmt: skip
    want_y, want_storage = _reference(x, weight, cache, block_table, metadata, 0)
    y = _KERNELS[kernel](x, weight, cache, block_table, metadata, 0)
    assert torch.equal(y.cpu(), want_y)
    assert torch.equal(_base(cache).cpu(), want_storage)


def _unallocated_step(device):
    """A step whose earlier taps hit unallocated blocks, in a cache with a NaN block on either side.

    Request 0 (block table ``[2, -1]``, N = 4) decodes position 9: taps 6, 7 sit in the ``-1`` block and
    tap 8 in column 2, past the table's two columns; its own position is past the table too (slot -1).
    A read of block -1 would hit the NaN block before the cache; column 2 of row 0 is, in memory, row 1's
    first entry (block 5), so an out-of-table read would show as a wrong value. Request 1 is ordinary.
    """
    offset, width = SAMPLE_LAYOUT.stream_range(InklingStream.V)
    shape = SAMPLE_LAYOUT.cache_shape(num_blocks=10, block_size=4)
    buffer = torch.randn(shape).to(device=device, dtype=torch.bfloat16)
    buffer[0] = buffer[-1] = float("nan")
    cache = buffer[1:-1]
    block_table = torch.tensor([[2, -1], [5, 6]], dtype=torch.int32, device=device)
    metadata = step_metadata([9, 5], [1, 2], block_table, 4, 4)
    channels = SAMPLE_LAYOUT.local_num_kv_heads * width
    x = torch.randn(4, channels).to(device=device, dtype=torch.bfloat16)
    weight = torch.randn(channels, SAMPLE_LAYOUT.kernel_size).to(device=device, dtype=torch.bfloat16)
    return x, weight, cache, block_table, metadata, offset


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_unallocated_blocks_of_earlier_taps_read_as_zero_in_both_kernels(kernel):
    device = triton_device() if kernel == "triton" else torch.device("cpu")
    x, weight, cache, block_table, metadata, offset = _unallocated_step(device)
    assert metadata.slot_mapping.tolist()[0] == -1  # request 0's own position 9 has no block either
    want_y, want_storage = _reference(x, weight, cache, block_table, metadata, offset)
    y = _KERNELS[kernel](x, weight, cache, block_table, metadata, offset)
    assert torch.equal(y.cpu(), want_y)
    assert torch.equal(_base(cache).cpu(), want_storage.cpu())


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_an_earlier_tap_past_the_block_table_reads_zero_when_the_last_column_is_allocated(kernel):
    """Request 0 (table ``[2, 3]``, N = 4) decodes position 9: taps 6, 7 in block 3, tap 8 in column 2,
    past the table's two columns, so a zero tap. A kernel that clamps the column into the table instead
    of masking it reads block 3's slot 0 there; ``_unallocated_step`` cannot show that, because its last
    column is ``-1`` and the clamped read is masked as unallocated anyway."""
    device = triton_device() if kernel == "triton" else torch.device("cpu")
    x, weight, cache, _, _, offset = _unallocated_step(device)
    cache[3].normal_()  # block 3's slot 0 must not be a zero row by chance
    block_table = torch.tensor([[2, 3], [5, 6]], dtype=torch.int32, device=device)
    metadata = step_metadata([9, 5], [1, 2], block_table, 4, 4)
    assert metadata.slot_mapping.tolist()[0] == -1  # position 9 is past the table too
    want_y, want_storage = _reference(x, weight, cache, block_table, metadata, offset)
    y = _KERNELS[kernel](x, weight, cache, block_table, metadata, offset)
    assert torch.equal(y.cpu(), want_y)
    assert torch.equal(_base(cache).cpu(), want_storage.cpu())


def test_validate_rejects_unallocated_blocks_among_the_earlier_taps():
    x, weight, cache, block_table, metadata, offset = _unallocated_step(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"request 0 position 6 \(read\) maps to block -1"):
        sconv(x, weight, cache, block_table, metadata, offset, validate=True)
    # Request 0 at position 5 with a one-column table: taps 2, 3 in block 2, tap 4 past the table.
    narrow = block_table[:, :1].clone()
    metadata = step_metadata([5, 3], [1, 1], narrow, 4, 4)
    with pytest.raises(ValueError, match=r"position 4 of request 0 \(read\) lies past its block table"):
        sconv(x, weight, cache, narrow, metadata, offset, validate=True)


def test_padding_rows_are_zero_and_an_all_padding_step_changes_nothing():
    x, weight, cache, block_table, metadata, offset = _step(
        InklingStream.V, prior_lens=[4], new_lens=[0], num_tokens=3
    )
    x.fill_(float("nan"))
    before = _base(cache).clone()
    y = sconv(x, weight, cache, block_table, metadata, offset, validate=True)
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.equal(_base(cache), before)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in the interpreter
@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_padding_rows_are_zero_whatever_the_weights(kernel):
    """Padding rows of y are zero in both kernels even with inf/NaN weights (the Triton kernel's masked taps
    are 0, and inf * 0 made its padding rows NaN); real rows agree between the kernels as NaN or as bits."""
    device = triton_device() if kernel == "triton" else torch.device("cpu")
    x, weight, cache, block_table, metadata, offset = _step(
        InklingStream.K, prior_lens=[5], new_lens=[2], num_tokens=4, device=device
    )
    weight[::3, 0] = float("inf")
    weight[1::3, 1] = float("nan")
    y = _KERNELS[kernel](x, weight, cache.clone(), block_table, metadata, offset)
    want = _KERNELS["torch"](*(t.cpu() for t in (x, weight, cache, block_table)), [m.cpu() for m in metadata], offset)
    assert torch.equal(y[2:].cpu(), torch.zeros_like(y[2:].cpu()))
    assert y[:2].isnan().any()
    torch.testing.assert_close(y.cpu(), want, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------


def _bad(name, exc, match, edit):
    return pytest.param(edit, exc, match, id=name)


def _with(index, make):
    def edit(args):
        args = list(args)
        args[index] = make(args[index])
        return args

    return edit


_X, _WEIGHT, _CACHE, _TABLE, _REQUEST, _START, _SLOT, _POSITION, _OFFSET = range(9)
_BAD_INPUTS = [
    _bad("x_fp32", TypeError, "x must be bfloat16", _with(_X, lambda x: x.float())),
    _bad("cache_fp16", TypeError, "cache must be bfloat16", _with(_CACHE, lambda c: c.half())),
    _bad("weight_int", TypeError, "weight must be bfloat16 or float32", _with(_WEIGHT, lambda w: w.int())),
    _bad("x_3d", ValueError, r"x must be \[T, H \* width\]", _with(_X, lambda x: x.view(x.shape[0], 2, -1))),
    _bad("cache_3d", ValueError, r"cache must be \[num_blocks, H, N, D\]", _with(_CACHE, lambda c: c[0])),
    _bad("x_not_divisible_by_heads", ValueError, "not a positive multiple", _with(_X, lambda x: x[:, :-1])),
    _bad("stream_past_d", ValueError, "lies outside the cache's D = 64", _with(_OFFSET, lambda o: 60)),
    _bad("stream_negative", ValueError, "lies outside", _with(_OFFSET, lambda o: -1)),
    _bad("weight_rows", ValueError, r"weight must be \[H \* width, W\]", _with(_WEIGHT, lambda w: w[:-2])),
    _bad("weight_conv1d_shape", ValueError, "weight must be", _with(_WEIGHT, lambda w: w[:, None, :])),
    _bad("weight_no_taps", ValueError, "W >= 1", _with(_WEIGHT, lambda w: w[:, :0])),
    _bad("block_table_int64", TypeError, "block_table must be int32", _with(_TABLE, lambda b: b.long())),
    _bad("block_table_1d", ValueError, r"block_table must be \[R, max_blocks\]", _with(_TABLE, lambda b: b[0])),
    _bad("slot_mapping_int64", TypeError, "slot_mapping must be int32", _with(_SLOT, lambda s: s.long())),
    _bad("token_position_short", ValueError, r"token_position must be \[T\]", _with(_POSITION, lambda p: p[:-1])),
    _bad("token_request_2d", ValueError, "token_request must be", _with(_REQUEST, lambda r: r[:, None])),
    _bad("chunk_start_float", TypeError, "token_chunk_start must be int32", _with(_START, lambda s: s.float())),
    _bad("offset_float", TypeError, "stream_offset must be an int", _with(_OFFSET, lambda o: 1.0)),
]


def _bad_args(edit):
    x, weight, cache, block_table, metadata, offset = _step(
        InklingStream.V, prior_lens=[2, 5], new_lens=[3, 1], num_tokens=6
    )
    return edit([x, weight, cache, block_table, *metadata, offset])


@pytest.mark.parametrize(("edit", "exc", "match"), _BAD_INPUTS)
def test_bad_input_is_rejected_by_the_op_the_fake_and_the_triton_launcher(edit, exc, match):
    args = _bad_args(edit)
    if isinstance(args[_OFFSET], float):
        # The dispatcher's schema check rejects a float for an int argument before any stepops code runs.
        with pytest.raises(RuntimeError, match="Expected a value of type 'int' for argument 'stream_offset'"):
            torch.ops.stepops.sconv(*args)
    else:
        with pytest.raises(exc, match=match):
            torch.ops.stepops.sconv(*args)
        with FakeTensorMode() as mode, pytest.raises(exc, match=match):
            torch.ops.stepops.sconv(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    with pytest.raises(exc, match=match):
        sconv_triton(*args)


def _validate_error(*, prior_lens=(6, 2), new_lens=(3, 2), edit_metadata=None, edit_table=None):
    """Run sconv(validate=True) on a step spoiled by the edits; return the ValueError's message, which the
    validator alone must raise too (on a GPU no kernel raises after it; on CPU the PyTorch kernel's id
    checks would raise for some cases and hide a check the validator dropped)."""
    x, weight, cache, block_table, metadata, offset = _step(
        InklingStream.K, prior_lens=prior_lens, new_lens=new_lens, num_tokens=7
    )
    if edit_table is not None:
        edit_table(block_table)
        metadata = step_metadata(prior_lens, new_lens, block_table, cache.shape[2], 7)
    if edit_metadata is not None:
        metadata = SconvMetadata(*(m.clone() for m in metadata))
        edit_metadata(metadata)
    before = _base(cache).clone()
    with pytest.raises(ValueError) as info:
        sconv(x, weight, cache, block_table, metadata, offset, validate=True)
    assert torch.equal(_base(cache), before), "validate=True must raise before the op writes"
    with pytest.raises(ValueError) as alone:
        validate_sconv_inputs(x, weight, cache, block_table, metadata, offset)
    assert str(alone.value) == str(info.value)
    return str(info.value)


def _set(name, index, value):
    return lambda metadata: getattr(metadata, name).__setitem__(index, value)


def test_validate_rejects_inconsistent_metadata():
    # Step: request 0 at positions 6..8 (tokens 0-2), request 1 at positions 2..3 (tokens 3-4), 2 padding.
    assert "block table gives" in _validate_error(edit_metadata=_set("slot_mapping", 1, 0))
    assert "must carry -1" in _validate_error(edit_metadata=_set("slot_mapping", 6, 3))
    assert "positions run with a gap" in _validate_error(edit_metadata=_set("token_position", 2, 20))
    assert "not contiguous" in _validate_error(edit_metadata=_set("token_request", 2, 1))
    assert "chunk start" in _validate_error(edit_metadata=_set("token_chunk_start", 0, 3))

    def start_one_past_a_slotless_token(metadata):  # no slot, so only the chunk-start rule can catch it
        metadata.slot_mapping[0], metadata.token_chunk_start[0] = -1, 1

    assert "chunk start 1; expected one in [0, 0]" in _validate_error(edit_metadata=start_one_past_a_slotless_token)
    assert "has slot -2" in _validate_error(edit_metadata=_set("slot_mapping", 4, -2))

    def request_1_from_position_minus_1(metadata):  # seq_lens one short: consistent otherwise, slotless at -1
        first_slot = int(metadata.slot_mapping[3])  # position 2, so position 0's slot is 2 below it
        metadata.token_position[3:5] = torch.tensor([-1, 0])
        metadata.slot_mapping[3:5] = torch.tensor([-1, first_slot - 2])

    assert "token 3 of request 1 has position -1" in _validate_error(edit_metadata=request_1_from_position_minus_1)
    assert "block_table row in [0, 2)" in _validate_error(edit_metadata=_set("token_request", 0, 2))
    # The mismatch message tried every block size up to the slot (2**31 - 1 never answered).
    assert "token 0 has slot 2147483647, but its block table gives" in _validate_error(
        edit_metadata=_set("slot_mapping", 0, 2**31 - 1)
    )

    def wrong_slot_then_a_request_past_the_table(metadata):  # the message read token 3's row: IndexError
        metadata.slot_mapping[0], metadata.token_request[3:5] = 0, 99

    assert "token 0 has slot 0, but its block table gives" in _validate_error(
        edit_metadata=wrong_slot_then_a_request_past_the_table
    )
    assert "past its block table" in _validate_error(edit_metadata=_set("token_position", 0, 12))


def test_validate_rejects_bad_block_tables():
    assert "outside [0, 32)" in _validate_error(edit_table=lambda b: b[0].__setitem__(1, 40))

    def share_stored_block(table):  # request 1's positions 0..3 land on request 0's positions 4..7
        table[1, 0] = table[0, 1]

    assert "store the same slot" in _validate_error(edit_table=share_stored_block)
    # Request 0 stores positions 6..8; request 1 (position 4) reads positions 1..3 of the same block.
    message = _validate_error(prior_lens=(6, 4), new_lens=(3, 1), edit_table=share_stored_block)
    assert re.search(r"stores slot \d+, which token 3 reads", message), message


# ---------------------------------------------------------------------------------------------------------
# Metadata builder and docs
# ---------------------------------------------------------------------------------------------------------


def test_build_sconv_metadata_matches_plain_python():
    generator = torch.Generator().manual_seed(7)
    for block_size, num_tokens in ((4, 20), (32, 16), (1, 12)):
        new_lens = [3, 0, 1, 5, 0, 2]
        prior_lens = torch.randint(0, 40, (len(new_lens),), generator=generator).tolist()
        max_blocks = max(-(-(p + n) // block_size) for p, n in zip(prior_lens, new_lens))
        table = torch.randint(0, 1000, (len(new_lens), max_blocks), generator=generator, dtype=torch.int32)
        got = step_metadata(prior_lens, new_lens, table, block_size, num_tokens)
        want = [[-1] * num_tokens for _ in range(4)]
        t = 0
        for r, (prior, new) in enumerate(zip(prior_lens, new_lens)):
            start = t
            for p in range(prior, prior + new):
                slot = int(table[r, p // block_size]) * block_size + p % block_size
                for field, value in enumerate((r, start, slot, p)):
                    want[field][t] = value
                t += 1
        assert [m.tolist() for m in got] == want
        assert all(m.dtype == torch.int32 for m in got)


def test_build_sconv_metadata_gives_unallocated_blocks_slot_minus_one():
    """A position past the table, or in a -1 block, is not stored: never another position's slot.

    Request 1's positions 1 and 2 lie in block -1: computed without the mask they would get slots
    -1 * 4 + 1 = -3 and -2, so the test fails if a -1 block is not masked (position 3 would give -1 either
    way and could not tell)."""
    table = torch.tensor([[3, 5], [-1, 7]], dtype=torch.int32)
    # Request 0 at positions 7..9 (7 in block 5, 8 and 9 past the table); request 1 at 1..4 (1..3 in block -1).
    qsl, seq_lens = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([10, 5], dtype=torch.int32)
    got = build_sconv_metadata(qsl, seq_lens, table, 4, 8)
    assert got.token_position.tolist() == [7, 8, 9, 1, 2, 3, 4, -1]
    assert got.slot_mapping.tolist() == [5 * 4 + 3, -1, -1, -1, -1, -1, 7 * 4 + 0, -1]


def _silu_values() -> torch.Tensor:
    """fp32 values across SiLU's range: both tails, around 0, and random ones."""
    generator = torch.Generator().manual_seed(11)
    return torch.cat([torch.linspace(-30, 30, 601), torch.randn(4000, generator=generator) * 4]).float()


def test_silu_of_the_torch_kernel_is_the_documented_formula_bitwise_in_fp32():
    """``silu_fp32`` against ``a / (1 + exp(-a))`` done in numpy fp32 with the same ``exp`` values: equal
    bits. ``a * sigmoid(a)`` (two roundings) differs on these values, so that rewrite fails here."""
    a = _silu_values()
    e = torch.exp(-a).numpy()  # the platform's exp, the one primitive both sides share
    want = torch.from_numpy(a.numpy() / (np.float32(1.0) + e))
    assert torch.equal(silu_fp32(a).view(torch.int32), want.view(torch.int32))
    assert not torch.equal((a * torch.sigmoid(a)).view(torch.int32), want.view(torch.int32))


@triton.jit
def _apply_silu(a_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, triton_silu_fp32(tl.load(a_ptr + i, mask=i < n)), mask=i < n)


def test_silu_of_the_triton_kernel_is_the_documented_formula_bitwise_in_fp32():
    """The Triton kernel's ``silu_fp32`` under the interpreter (numpy's ``exp``) against the same formula in
    numpy fp32: equal bits; ``a * sigmoid(a)`` would not be."""
    if triton_device().type != "cpu":
        pytest.skip("runs the interpreter's numpy exp; on a GPU the exp is the device's")
    a = _silu_values()
    out = torch.empty_like(a)
    _apply_silu[(1,)](a, out, a.numel(), BLOCK=triton.next_power_of_2(a.numel()))
    a_np = a.numpy()
    want = torch.from_numpy(a_np / (np.float32(1.0) + np.exp(-a_np)))
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    sigmoid = np.float32(1.0) / (np.float32(1.0) + np.exp(-a_np))
    assert not torch.equal(torch.from_numpy(a_np * sigmoid).view(torch.int32), want.view(torch.int32))


def test_build_sconv_metadata_rejects_bad_block_size_and_table():
    qsl, seq_lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        build_sconv_metadata(qsl, seq_lens, table, 0, 4)
    with pytest.raises(ValueError, match="int32"):
        build_sconv_metadata(qsl, seq_lens, table.long(), 4, 4)
    with pytest.raises(ValueError, match="rows"):
        build_sconv_metadata(qsl, seq_lens, torch.zeros(2, 2, dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match=r"max_blocks >= 1, got torch.int32 \(1, 0\)"):
        build_sconv_metadata(qsl, seq_lens, torch.zeros(1, 0, dtype=torch.int32), 4, 4)
    # meta tensors stand in for a second device on a CPU-only machine.
    with pytest.raises(ValueError, match="build_sconv_metadata: query_start_loc is on cpu, block_table on meta"):
        build_sconv_metadata(qsl, seq_lens, table.to("meta"), 4, 4)
    with pytest.raises(ValueError, match="build_sconv_metadata: seq_lens is on meta, block_table on cpu"):
        build_sconv_metadata(qsl, seq_lens.to("meta"), table, 4, 4)


def test_docs_worked_example_runs():
    """The sconv section of docs/ops.md carries one python block; run it as a user would paste it."""
    text = _DOCS.read_text()
    section = text[text.index("## `sconv`") :]
    section = section[: section.find("\n## ", 4)] if "\n## " in section[4:] else section
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(_DOCS), "exec"), {})


def test_compiles_fullgraph_and_matches_eager():
    """Metadata builder + two streams into one cache under torch.compile(fullgraph=True): eager's bits."""

    # Offsets come from the layout outside the compiled region (Dynamo cannot trace InklingStream(stream)).
    k_offset, _ = SAMPLE_LAYOUT.stream_range(InklingStream.K)
    v_offset, _ = SAMPLE_LAYOUT.stream_range(InklingStream.V)

    def layer(x_k, x_v, w_k, w_v, cache, block_table, query_start_loc, seq_lens):
        metadata = build_sconv_metadata(query_start_loc, seq_lens, block_table, cache.shape[2], x_k.shape[0])
        y_k = sconv(x_k, w_k, cache, block_table, metadata, k_offset)
        y_v = sconv(x_v, w_v, cache, block_table, metadata, v_offset, silu=True)
        return y_k, y_v

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    for new_lens, num_tokens in (([3, 1], 6), ([1, 1], 3)):
        _, _, cache, block_table, _, _ = _step(InklingStream.K, prior_lens=[5, 2], new_lens=new_lens, num_tokens=9)
        query_start_loc = torch.tensor([0, new_lens[0], sum(new_lens)], dtype=torch.int32)
        seq_lens = torch.tensor([5 + new_lens[0], 2 + new_lens[1]], dtype=torch.int32)
        args = [torch.randn(num_tokens, 16).to(torch.bfloat16) for _ in range(2)]
        args += [torch.randn(16, 4).to(torch.bfloat16) for _ in range(2)]
        cache_eager = cache.clone()
        want = layer(*args, cache_eager, block_table, query_start_loc, seq_lens)
        # A second token count reuses the first graph: T is dynamic, the grid depends on sizes only.
        with torch.compiler.set_stance("fail_on_recompile" if num_tokens == 3 else "default"):
            got = compiled(*args, cache, block_table, query_start_loc, seq_lens)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert torch.equal(cache, cache_eager)


def _metadata_for_another_block_size():
    """A step on a cache with N = 16 whose metadata were built with N = 4 (one block table, 8 columns)."""
    x, weight, cache, _, _, offset = _step(InklingStream.K, prior_lens=(5, 2), new_lens=(2, 1), num_tokens=4, block_size=16)
    block_table = random_block_table(2, 8, cache.shape[0], generator=torch.Generator().manual_seed(1), device="cpu")
    metadata = step_metadata((5, 2), (2, 1), block_table, 4, 4)
    return x, weight, cache, block_table, metadata, offset


def test_validate_names_metadata_built_for_another_block_size():
    x, weight, cache, block_table, metadata, offset = _metadata_for_another_block_size()
    before = _base(cache).clone()
    message = "the metadata were built for block size 4, but the cache's block size N is 16"
    with pytest.raises(ValueError, match=message):
        sconv(x, weight, cache, block_table, metadata, offset, validate=True)
    assert torch.equal(_base(cache), before)


def test_validate_reports_its_own_message_under_torch_compile():
    """validate=True syncs, so it runs outside the graph (torch.compiler.disable): under torch.compile it
    raises its own message, not Dynamo's data-dependent guard error."""
    x, weight, cache, block_table, metadata, offset = _metadata_for_another_block_size()
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: sconv(*args, validate=True), backend="eager")
    with pytest.raises(ValueError, match="the metadata were built for block size 4"):
        compiled(x, weight, cache, block_table, metadata, offset)


def test_validate_names_backwards_positions():
    assert "positions run backwards" in _validate_error(edit_metadata=_set("token_position", 1, 5))


def test_triton_counts_a_bad_token_once_when_its_row_spans_several_programs():
    """width 512: one head per program, so H = 2 heads are 2 programs of one token. A token with a slot
    past the cache is one error (the PyTorch kernel raises for it), not one per program; its good
    neighbour is stored and the bad one writes nothing."""
    device = triton_device()
    heads, width, block_size = 2, 512, 4
    cache = torch.zeros(2, heads, block_size, width, dtype=torch.bfloat16, device=device)
    x = torch.randn(2, heads * width).to(device=device, dtype=torch.bfloat16)
    weight = torch.randn(heads * width, 4).to(device=device, dtype=torch.bfloat16)
    block_table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    metadata = SconvMetadata(*(torch.tensor(v, dtype=torch.int32, device=device)
                               for v in ([0, 0], [0, 0], [0, 10**6], [0, 1])))  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping"):
        torch.ops.stepops.sconv(x.cpu(), weight.cpu(), cache.cpu(), block_table.cpu(), *(m.cpu() for m in metadata), 0)
    errors = error_counter(device)
    sconv_triton(x, weight, cache, block_table, *metadata, 0, errors=errors)
    assert errors.tolist() == [1]
    assert torch.equal(cache[0, :, 0].cpu(), x[0].view(heads, width).cpu())
    assert int(torch.count_nonzero(cache[:, :, 1:].cpu())) == 0 and int(torch.count_nonzero(cache[1].cpu())) == 0


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_a_padding_token_stores_nothing_whatever_its_slot(kernel):
    """Padding is ``token_request == -1``: a padding token whose ``slot_mapping`` entry still holds a real
    slot (a stale step buffer) stores nothing there, and its row of y is 0."""
    device = triton_device() if kernel == "triton" else torch.device("cpu")
    x, weight, cache, block_table, metadata, offset = _step(
        InklingStream.K, prior_lens=[5], new_lens=[2], num_tokens=4, device=device
    )
    stale = metadata.slot_mapping.clone()
    stale[2:] = torch.tensor([0, 1], dtype=stale.dtype)  # slots 0 and 1: rows no real token of the step writes
    assert metadata.token_request[2:].eq(-1).all() and not set(stale[2:].tolist()) & set(stale[:2].tolist())
    want_cache = cache.clone()
    want_y = _KERNELS[kernel](x, weight, want_cache, block_table, metadata, offset)
    y = _KERNELS[kernel](x, weight, cache, block_table, metadata._replace(slot_mapping=stale), offset)
    assert torch.equal(_base(cache), _base(want_cache)) and torch.equal(y, want_y)
    assert y[2:].eq(0).all()


def test_triton_never_reads_x_rows_before_x_for_a_bad_chunk_start():
    """A token whose chunk start is below 0 (a bad id: counted) has taps that would reach rows before x's
    first; they read 0, not the memory before x (here NaN): y = x * w_last + x = 2."""
    device = triton_device()
    heads, width, block_size = 1, 8, 4
    cache = torch.zeros(2, heads, block_size, width, dtype=torch.bfloat16, device=device)
    buffer = torch.full((7, heads * width), float("nan"), dtype=torch.bfloat16, device=device)
    buffer[6] = 1.0
    x = buffer[6:]
    weight = torch.ones(heads * width, 4, dtype=torch.bfloat16, device=device)
    block_table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    metadata = [torch.tensor([v], dtype=torch.int32, device=device) for v in (0, -3, 5, 5)]  # chunk start -3
    errors = error_counter(device)
    y = sconv_triton(x, weight, cache, block_table, *metadata, 0, errors=errors)
    assert errors.tolist() == [1]
    assert torch.equal(y.cpu(), torch.full((1, heads * width), 2.0, dtype=torch.bfloat16))
