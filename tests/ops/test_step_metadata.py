"""build_token_metadata against a plain Python walk over the requests."""

import random

import pytest
import torch

from stepops.ops.step_metadata import build_token_metadata


def _python_metadata(query_lens, seq_lens, num_tokens):
    request, chunk_start, position = [], [], []
    start = 0
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for i in range(q):
            request.append(r)
            chunk_start.append(start)
            position.append(s - q + i)
        start += q
    pad = num_tokens - len(request)
    return request + [-1] * pad, chunk_start + [-1] * pad, position + [-1] * pad


def test_matches_python_walk_with_empty_requests_and_padding():
    rng = random.Random(0)
    for _ in range(50):
        num_requests = rng.randint(1, 6)
        query_lens = [rng.choice([0, 1, 1, 4, 9]) for _ in range(num_requests)]
        seq_lens = [q + rng.randint(0, 20) for q in query_lens]
        num_tokens = sum(query_lens) + rng.randint(0, 5)
        qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()))
        meta = build_token_metadata(qsl, torch.tensor(seq_lens), num_tokens)
        expected = _python_metadata(query_lens, seq_lens, num_tokens)
        assert [t.tolist() for t in meta] == list(expected), (query_lens, seq_lens, num_tokens)
        assert all(t.dtype == torch.int32 and t.shape == (num_tokens,) for t in meta)


def test_a_step_of_padding_only():
    meta = build_token_metadata(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 3)
    assert [t.tolist() for t in meta] == [[-1, -1, -1]] * 3


def test_shape_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match=r"query_start_loc must be \[R \+ 1\]"):
        build_token_metadata(torch.tensor([0, 1]), torch.tensor([1, 2]), 4)


def test_inputs_on_different_devices_are_a_value_error():
    """``meta`` tensors stand in for a second device on a CPU-only machine."""
    with pytest.raises(ValueError, match="build_token_metadata: seq_lens is on meta, query_start_loc on cpu"):
        build_token_metadata(torch.tensor([0, 1]), torch.tensor([1], device="meta"), 4)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "qsl, seq_lens, num_tokens, message",
    [
        ([1, 3], [5], 4, r"build_token_metadata: query_start_loc must start at 0, got 1"),
        ([0, 3, 2], [5, 5], 4, r"query_start_loc decreases at request 1 \(3 -> 2\)"),
        ([0, 3, 6], [5, 9], 4, r"num_tokens = 4 is less than the step's 6 tokens"),
        ([0, 3, 4], [2, 9], 4, r"seq_lens\[0\] = 2 is less than request 0's 3 tokens in this step"),
    ],
)
def test_inconsistent_steps_are_rejected_on_cpu_naming_the_argument(qsl, seq_lens, num_tokens, message):
    with pytest.raises(ValueError, match=message):
        build_token_metadata(_i32(qsl), _i32(seq_lens), num_tokens)


def test_num_tokens_and_dtypes_are_checked():
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        build_token_metadata(_i32([0]), _i32([]), -1)
    with pytest.raises(TypeError, match="build_token_metadata: num_tokens must be an int, got float"):
        build_token_metadata(_i32([0]), _i32([]), 2.0)
    with pytest.raises(TypeError, match="seq_lens must be an integer tensor, got torch.float32"):
        build_token_metadata(_i32([0, 1]), torch.tensor([3.0]), 2)


@pytest.mark.parametrize("num_tokens", [0, 3])
def test_no_requests_and_no_tokens_in_every_builder(num_tokens):
    """R = 0 (and T = 0): all padding, from the shared builder and both op builders."""
    from stepops.ops.csa_ring_update import build_csa_ring_metadata
    from stepops.ops.sconv import build_sconv_metadata

    qsl, seq_lens = _i32([0]), _i32([])
    pad = [[-1] * num_tokens]
    assert [t.tolist() for t in build_token_metadata(qsl, seq_lens, num_tokens)] == pad * 3
    sconv = build_sconv_metadata(qsl, seq_lens, torch.zeros(0, 2, dtype=torch.int32), 4, num_tokens)
    assert [t.tolist() for t in sconv] == pad * 4
    ring = build_csa_ring_metadata(qsl, seq_lens, _i32([]), 10, torch.zeros(0, 1, dtype=torch.int32), 4, num_tokens)
    assert [t.tolist() for t in ring] == pad * 5
    # T = 0 with requests: every request has zero tokens in this step.
    assert [t.tolist() for t in build_token_metadata(_i32([0, 0, 0]), _i32([4, 7]), 0)] == [[]] * 3


def test_csa_builder_rejects_a_negative_ring_block_on_cpu():
    from stepops.ops.csa_ring_update import build_csa_ring_metadata

    with pytest.raises(ValueError, match=r"build_csa_ring_metadata: ring_blocks\[1\] = -1 for a request with tokens"):
        build_csa_ring_metadata(_i32([0, 1, 3]), _i32([4, 9]), _i32([0, -1]), 10, torch.zeros(2, 1, dtype=torch.int32), 4, 4)


def test_op_builders_derive_from_given_token_metadata():
    """A model step builds the token metadata once and hands them to each op's builder: same results as the
    builders building their own, and token metadata of another step size are refused."""
    from stepops.ops.csa_ring_update.metadata import build_csa_ring_metadata
    from stepops.ops.sconv.metadata import build_sconv_metadata

    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    seq_lens = torch.tensor([10, 8, 21], dtype=torch.int32)
    num_tokens = 12
    ring_blocks = torch.tensor([2, 0, 1], dtype=torch.int32)
    summary_table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    conv_table = torch.arange(3 * 6, dtype=torch.int32).view(3, 6)
    token = build_token_metadata(qsl, seq_lens, num_tokens)
    builders = {
        "ring": lambda **kw: build_csa_ring_metadata(qsl, seq_lens, ring_blocks, 16, summary_table, 2, num_tokens, **kw),
        "sconv": lambda **kw: build_sconv_metadata(qsl, seq_lens, conv_table, 4, num_tokens, **kw),
    }
    for name, build in builders.items():
        for got, want in zip(build(token=token), build()):
            assert torch.equal(got, want), name
        short = build_token_metadata(qsl, seq_lens, num_tokens + 1)
        with pytest.raises(ValueError, match=rf"token.request must be int32 \[{num_tokens}\]"):
            build(token=short)
        with pytest.raises(ValueError, match=rf"token.request must be int32 \[{num_tokens}\] \(num_tokens\), got torch.int64"):
            build(token=type(token)(*(t.long() for t in token)))


def test_ids_past_int32_saturate_and_the_ops_refuse_them():
    """The builders compute ids in int64 and hand the ops int32: an id past int32 (a garbage block-table
    entry or ring block) becomes 2**31 - 1, outside every cache, which the op refuses. Before, it wrapped:
    block 2**30 of N = 4 became slot 0 and the sconv op overwrote block 0, another request's."""
    from stepops.ops.csa_ring_update import build_csa_ring_metadata
    from stepops.ops.sconv import build_sconv_metadata, sconv

    int32_max = 2**31 - 1
    qsl, seq_lens = torch.tensor([0, 2]), torch.tensor([2])
    garbage_table = torch.tensor([[2**30]], dtype=torch.int32)
    meta = build_sconv_metadata(qsl, seq_lens, garbage_table, 4, 2)
    assert meta.slot_mapping.tolist() == [int32_max, int32_max]
    cache = torch.zeros(4, 1, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"sconv: slot_mapping must be -1 or in \[0, 16\)"):
        sconv(torch.ones(2, 8, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16), cache, garbage_table, meta, 0)
    assert not cache.any(), "a refused call writes nothing"

    ring = build_csa_ring_metadata(torch.tensor([0, 1]), torch.tensor([8]), torch.tensor([2**29]), 8,
                                   torch.tensor([[2**29]]), 16, 1)  # fmt: skip
    assert ring.ring_base.tolist() == [int32_max] and ring.summary_slot.tolist() == [int32_max]


def test_a_sequence_length_past_int32_positions_is_refused_on_cpu():
    """A saturated position is no out-of-range id: positions 2**31 - 1 and "2**31" became one, so two tokens
    stored one ring row and sconv convolved positions that did not step, with no error. On a GPU (no host
    check) they saturate inside the request's own rows, and validate=True names the repeated position."""
    from stepops.ops.csa_ring_update import build_csa_ring_metadata
    from stepops.ops.sconv import build_sconv_metadata

    qsl, table = torch.tensor([0, 2]), torch.zeros(1, 1, dtype=torch.int32)
    assert build_token_metadata(qsl, torch.tensor([2**31]), 2).position.tolist() == [2**31 - 2, 2**31 - 1]
    for build in (
        lambda lens: build_token_metadata(qsl, lens, 2),
        lambda lens: build_sconv_metadata(qsl, lens, table, 4, 2),
        lambda lens: build_csa_ring_metadata(qsl, lens, torch.tensor([0]), 8, table, 16, 2),
    ):
        with pytest.raises(ValueError, match=r"seq_lens\[0\] = 2147483649 puts positions past 2\*\*31 - 1"):
            build(torch.tensor([2**31 + 1]))


def test_sizes_past_int64_are_a_value_error_in_every_builder():
    """Before: torch's ``OverflowError: int too big to convert`` from deep inside the build."""
    from stepops.ops.csa_ring_update import build_csa_ring_metadata
    from stepops.ops.sconv import build_sconv_metadata

    qsl, seq_lens, table = torch.tensor([0, 3]), torch.tensor([3]), torch.zeros(1, 2, dtype=torch.int32)
    huge = 2**70
    for build in (
        lambda: build_token_metadata(qsl, seq_lens, huge),
        lambda: build_sconv_metadata(qsl, seq_lens, table, huge, 3),
        lambda: build_csa_ring_metadata(qsl, seq_lens, torch.tensor([0]), huge, table, 16, 3),
        lambda: build_csa_ring_metadata(qsl, seq_lens, torch.tensor([0]), 16, table, huge, 3),
    ):
        with pytest.raises(ValueError, match=rf"= {huge} does not fit in int64"):
            build()
