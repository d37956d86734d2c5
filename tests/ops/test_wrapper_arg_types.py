"""The public wrappers and metadata builders with arguments of the wrong Python type: a ``TypeError`` that
names the argument, never the dispatcher's ``RuntimeError``, an ``AttributeError`` from inside the checks,
or a bool silently taken as the int ``1``."""

import numpy as np
import pytest
import torch

import stepops
from stepops import (
    CSARingMetadata,
    CSATailRingLayout,
    InklingConvStateLayout,
    InklingStream,
    SconvMetadata,
    build_csa_ring_metadata,
    build_sconv_metadata,
    csa_ring_update,
    paged_kv_write,
    sconv,
)

BF16, I32 = torch.bfloat16, torch.int32


def _paged_kv_write_args():
    key = torch.randn(3, 2, 8, dtype=BF16)
    cache = torch.zeros(4, 16, 2, 8, dtype=BF16)
    return dict(
        key=key, value=key.clone(), key_cache=cache, value_cache=cache.clone(),
        slot_mapping=torch.tensor([17, 18, -1], dtype=I32),
    )  # fmt: skip


def _sconv_args():
    layout = InklingConvStateLayout(num_kv_heads=2, head_dim=8, hidden_size=32, kernel_size=4)
    cache = torch.zeros(layout.cache_shape(num_blocks=8), dtype=BF16)
    offset, width = layout.stream_range(InklingStream.K)
    block_table = torch.tensor([[3, 5]], dtype=I32)
    metadata = build_sconv_metadata(torch.tensor([0, 5]), torch.tensor([5]), block_table, cache.shape[2], 8)
    return dict(
        x=torch.randn(8, 2 * width).to(BF16), weight=torch.randn(2 * width, 4).to(BF16), cache=cache,
        block_table=block_table, metadata=metadata, stream_offset=offset,
    )  # fmt: skip


def _csa_args():
    layout = CSATailRingLayout(page_bytes=16 * 1024, block_size=16, num_speculative_tokens=3)
    ring = layout.bind(torch.zeros(4, 16, 1, layout.head_size, dtype=BF16))
    metadata = build_csa_ring_metadata(
        torch.tensor([0, 15], dtype=I32), torch.tensor([15], dtype=I32), torch.tensor([2], dtype=I32),
        ring.rows_per_block, torch.tensor([[1, 0]], dtype=I32), 4, 16,
    )  # fmt: skip
    return dict(
        index_k=torch.randn(16, 256).to(BF16), index_z=torch.randn(16, 256).to(BF16), ring=ring.rows,
        summary_cache=torch.zeros(8, 256, dtype=BF16), metadata=metadata, capacity=ring.capacity,
    )  # fmt: skip


_PAD = torch.full((8,), -1, dtype=I32)
_CASES = [
    # (op, make_args, argument, bad value, message)
    (paged_kv_write, _paged_kv_write_args, "key", None, "key must be a torch.Tensor, got NoneType"),
    (paged_kv_write, _paged_kv_write_args, "value_cache", [[0.0]], "value_cache must be a torch.Tensor, got list"),
    (paged_kv_write, _paged_kv_write_args, "slot_mapping", [17, 18, -1], "slot_mapping must be a torch.Tensor"),
    (paged_kv_write, _paged_kv_write_args, "errors", [0], "errors must be a torch.Tensor, got list"),
    (paged_kv_write, _paged_kv_write_args, "validate", "yes", "validate must be a bool, got str"),
    (sconv, _sconv_args, "x", None, "sconv: x must be a torch.Tensor, got NoneType"),
    (sconv, _sconv_args, "weight", None, "sconv: weight must be a torch.Tensor, got NoneType"),
    (sconv, _sconv_args, "block_table", [[3, 5]], "sconv: block_table must be a torch.Tensor, got list"),
    (sconv, _sconv_args, "metadata", tuple([_PAD] * 4), "sconv: metadata must be an SconvMetadata, got tuple"),
    (sconv, _sconv_args, "metadata", SconvMetadata(None, _PAD, _PAD, _PAD),
     "metadata.token_request must be a torch.Tensor"),
    (sconv, _sconv_args, "stream_offset", True, "sconv: stream_offset must be an int, got bool"),
    (sconv, _sconv_args, "stream_offset", 0.0, "sconv: stream_offset must be an int, got float"),
    (sconv, _sconv_args, "stream_offset", None, "sconv: stream_offset must be an int, got NoneType"),
    # The dispatcher takes a NumPy integer; the wrappers' size checks take Python ints alone (docs/ops.md).
    (sconv, _sconv_args, "stream_offset", np.int64(0), "sconv: stream_offset must be an int, got int64"),
    (sconv, _sconv_args, "stream_offset", torch.tensor(0), "sconv: stream_offset must be an int, got Tensor"),
    # An IntEnum is an int: InklingStream.V was taken as the offset 1, while V starts at head_dim.
    (sconv, _sconv_args, "stream_offset", InklingStream.V, "sconv: stream_offset must be an int, got InklingStream"),
    (sconv, _sconv_args, "residual", None, "sconv: residual must be a bool, got NoneType"),
    (sconv, _sconv_args, "silu", "yes", "sconv: silu must be a bool, got str"),
    (sconv, _sconv_args, "errors", [0], "sconv: errors must be a torch.Tensor, got list"),
    (csa_ring_update, _csa_args, "index_k", None, "csa_ring_update: index_k must be a torch.Tensor, got NoneType"),
    (csa_ring_update, _csa_args, "summary_cache", None, "summary_cache must be a torch.Tensor, got NoneType"),
    (csa_ring_update, _csa_args, "metadata", tuple([_PAD] * 5), "metadata must be a CSARingMetadata"),
    (csa_ring_update, _csa_args, "metadata", SconvMetadata(*[_PAD] * 4), "metadata must be a CSARingMetadata"),
    (csa_ring_update, _csa_args, "metadata", CSARingMetadata(None, *[_PAD] * 4),
     "metadata.position must be a torch.Tensor"),
    (csa_ring_update, _csa_args, "capacity", True, "csa_ring_update: capacity must be an int, got bool"),
    (csa_ring_update, _csa_args, "capacity", 16.0, "csa_ring_update: capacity must be an int, got float"),
    (csa_ring_update, _csa_args, "capacity", np.int32(10), "csa_ring_update: capacity must be an int, got int32"),
    (csa_ring_update, _csa_args, "errors", [0], "csa_ring_update: errors must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize(
    "op, make_args, name, bad, message", _CASES, ids=[f"{c[0].__name__}-{c[2]}-{type(c[3]).__name__}" for c in _CASES]
)
def test_wrong_python_type_is_a_type_error_naming_the_argument(op, make_args, name, bad, message):
    args = make_args()
    args[name] = bad
    caches = [t.clone() for t in args.values() if isinstance(t, torch.Tensor)]
    with pytest.raises(TypeError, match=message):
        op(**args)
    # Nothing was written before the error.
    assert all(torch.equal(a, b) for a, b in zip(caches, [t for t in args.values() if isinstance(t, torch.Tensor)]))


_WRITTEN_CASES = [
    (paged_kv_write, _paged_kv_write_args, "key_cache"), (paged_kv_write, _paged_kv_write_args, "value_cache"),
    (sconv, _sconv_args, "cache"), (csa_ring_update, _csa_args, "ring"), (csa_ring_update, _csa_args, "summary_cache"),
]  # fmt: skip


@pytest.mark.parametrize("op, make_args, name", _WRITTEN_CASES, ids=[f"{c[0].__name__}-{c[2]}" for c in _WRITTEN_CASES])
def test_a_negative_view_of_a_written_tensor_is_a_value_error_naming_it(op, make_args, name):
    """The dispatcher's fallback for the negative bit fails with "Expected Tensor but got None" on a written
    argument; through the wrapper, the op names it and writes nothing (the tensor under the view is
    unchanged)."""
    args = make_args()
    base = args[name]
    before = base.clone()
    args[name] = torch._neg_view(base)
    with pytest.raises(ValueError, match=f"{op.__name__}: {name} is a negative view"):
        op(**args)
    assert torch.equal(base, before)


def test_a_conjugate_cache_is_refused_and_a_conjugate_input_is_written_resolved():
    """paged_kv_write copies any dtype of at most 8 bytes, complex64 too: a conjugate view of the cache is
    refused by name; a conjugate view of the key is resolved by the dispatcher, so its conjugate is stored."""
    args = {name: t.to(torch.complex64) if t.is_floating_point() else t for name, t in _paged_kv_write_args().items()}
    args["key"] = torch.complex(args["key"].real, torch.randn(args["key"].shape))
    cache = args["key_cache"]
    with pytest.raises(ValueError, match="paged_kv_write: key_cache is a conjugate view"):
        paged_kv_write(**{**args, "key_cache": cache.conj()})
    assert not cache.any()
    paged_kv_write(**{**args, "key": args["key"].conj()})
    assert torch.equal(cache[1, 1:3], args["key"][:2].conj().resolve_conj())


@pytest.mark.parametrize("op, make_args, name", [(sconv, _sconv_args, "stream_offset"), (csa_ring_update, _csa_args, "capacity")])
@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1])
def test_an_int_outside_int64_is_a_value_error_naming_the_argument(op, make_args, name, bad):
    """The schema's SymInt is int64; the dispatcher's own error reads "Expected a value of type 'int' ... found
    type 'int'"."""
    args = make_args()
    args[name] = bad
    with pytest.raises(ValueError, match=f"{op.__name__}: {name} = {bad} does not fit in int64"):
        op(**args)


@pytest.mark.parametrize("op, make_args", [(paged_kv_write, _paged_kv_write_args), (sconv, _sconv_args), (csa_ring_update, _csa_args)])
def test_the_wrappers_hand_their_errors_counter_to_the_op(op, make_args):
    """A counter of the wrong shape reaches the op's check (a wrapper that dropped it would leave a GPU
    caller's counter at 0 whatever the ids)."""
    with pytest.raises(ValueError, match=rf"{op.__name__}: errors must be an int32 \[1\] tensor"):
        op(**make_args(), errors=torch.zeros(2, dtype=I32))


def test_the_wrappers_still_take_their_documented_types():
    """The type checks let the ordinary calls through (the docs' examples use exactly these)."""
    args = _sconv_args()
    assert sconv(**args, residual=False, silu=True, errors=None, validate=True).shape == args["x"].shape
    paged_kv_write(**_paged_kv_write_args(), errors=None, validate=True)
    csa_ring_update(**_csa_args(), validate=True)


_Q, _S = torch.tensor([0, 15], dtype=I32), torch.tensor([15], dtype=I32)
_BUILDER_CASES = [
    (lambda: build_sconv_metadata([0, 15], _S, torch.zeros(1, 4, dtype=I32), 4, 16), TypeError,
     "build_sconv_metadata: query_start_loc must be a torch.Tensor, got list"),
    (lambda: build_sconv_metadata(_Q, _S, None, 4, 16), TypeError,
     "build_sconv_metadata: block_table must be a torch.Tensor, got NoneType"),
    # A plain tuple where a TokenMetadata goes is a wrong type, like every other argument's (was a ValueError).
    (lambda: build_sconv_metadata(_Q, _S, torch.zeros(1, 4, dtype=I32), 4, 16, token=(_S, _S, _S)), TypeError,
     r"build_sconv_metadata: token must be a TokenMetadata \(build_token_metadata\), got tuple"),
    # Sizes of the wrong type are a TypeError like the wrappers' ints (they were a ValueError), 0 a ValueError.
    (lambda: build_sconv_metadata(_Q, _S, torch.zeros(1, 4, dtype=I32), 4.0, 16), TypeError,
     r"build_sconv_metadata: block_size \(the cache's N, cache.shape\[2\]\) must be an int, got float"),
    (lambda: build_sconv_metadata(_Q, _S, torch.zeros(1, 4, dtype=I32), 0, 16), ValueError,
     r"build_sconv_metadata: block_size \(the cache's N, cache.shape\[2\]\) must be >= 1, got 0"),
    (lambda: build_csa_ring_metadata(_Q, _S, torch.tensor([2], dtype=I32), 16.0, torch.zeros(1, 2, dtype=I32), 4, 16),
     TypeError, "build_csa_ring_metadata: rows_per_block must be an int, got float"),
    (lambda: build_csa_ring_metadata(_Q, _S, torch.tensor([2], dtype=I32), 16, torch.zeros(1, 2, dtype=I32), True, 16),
     TypeError, "build_csa_ring_metadata: summary_block_size must be an int, got bool"),
    (lambda: build_csa_ring_metadata(_Q, _S, torch.tensor([2], dtype=I32), 16, torch.zeros(1, 2, dtype=I32), 0, 16),
     ValueError, "build_csa_ring_metadata: summary_block_size must be >= 1, got 0"),
    (lambda: build_csa_ring_metadata(_Q, _S, torch.tensor([2], dtype=I32), 16, torch.zeros(1, 2, dtype=I32), 4, 16.0),
     TypeError, "build_csa_ring_metadata: num_tokens must be an int, got float"),
    (lambda: build_csa_ring_metadata(_Q, None, torch.tensor([2], dtype=I32), 16, torch.zeros(1, 2, dtype=I32), 4, 16),
     TypeError, "build_csa_ring_metadata: seq_lens must be a torch.Tensor, got NoneType"),
    # A float block id was truncated by .long() (2.7 -> ring block 2), a bool one read as 0/1: both silently.
    (lambda: build_csa_ring_metadata(_Q, _S, torch.tensor([2.7]), 16, torch.zeros(1, 2, dtype=I32), 4, 16),
     TypeError, "build_csa_ring_metadata: ring_blocks must be an integer tensor .*float32"),
    (lambda: build_csa_ring_metadata(_Q, _S, torch.tensor([True]), 16, torch.zeros(1, 2, dtype=I32), 4, 16),
     TypeError, "build_csa_ring_metadata: ring_blocks must be an integer tensor .*bool"),
    (lambda: build_csa_ring_metadata(_Q, _S, torch.tensor([2], dtype=I32), 16, torch.tensor([[1.5, 0.0]]), 4, 16),
     TypeError, "build_csa_ring_metadata: summary_block_table must be an integer tensor .*float32"),
]


@pytest.mark.parametrize(
    "call, error, message", _BUILDER_CASES, ids=[f"{m.split()[1]}{i}" for i, (_, _, m) in enumerate(_BUILDER_CASES)]
)
def test_builders_name_a_non_tensor_or_non_integer_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_public_names_are_the_ones_tested():
    assert {"sconv", "paged_kv_write", "csa_ring_update", "build_sconv_metadata", "build_csa_ring_metadata"} <= set(
        stepops.__all__
    )
