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
