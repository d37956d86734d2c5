"""KV-cache specs: page sizes counted by hand, defaults, validation, immutability."""

import dataclasses

import pytest
import torch

from stepops.layouts import InklingStream
from stepops.specs import CircularBufferSpec, FullAttentionSpec, SlidingWindowSpec


def test_full_attention_page_counts_k_and_v():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    # head_size_v defaults to head_size: 16 tokens * 2 heads * (64 K + 64 V) * 2 bytes.
    assert spec.head_size_v == 64
    assert spec.page_size_bytes == 8192


def test_head_size_v_may_differ_or_be_zero():
    mixed = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=192, head_size_v=128, dtype=torch.float16)
    assert mixed.page_size_bytes == 8 * 320 * 2
    latent = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=576, head_size_v=0, dtype=torch.float8_e4m3fn)
    assert latent.page_size_bytes == 8 * 576


def test_sliding_window_and_circular_buffer_pages():
    swa = SlidingWindowSpec(
        block_size=4, num_kv_heads=2, head_size=128, head_size_v=0, dtype=torch.bfloat16, sliding_window=4
    )
    assert swa.page_size_bytes == 4 * 2 * 128 * 2
    ring = CircularBufferSpec(
        block_size=16, num_kv_heads=1, head_size=512, head_size_v=0, dtype=torch.bfloat16, block_stride_alignment=1024
    )
    assert ring.page_size_bytes == 16 * 1024


def test_with_block_size_keeps_type_and_fields():
    swa = SlidingWindowSpec(
        block_size=4, num_kv_heads=2, head_size=128, head_size_v=0, dtype=torch.bfloat16, sliding_window=4
    )
    bigger = swa.with_block_size(32)
    assert type(bigger) is SlidingWindowSpec
    assert (bigger.block_size, bigger.sliding_window, bigger.head_size_v) == (32, 4, 0)
    assert bigger.page_size_bytes == 8 * swa.page_size_bytes
    with pytest.raises(ValueError, match="does not fit in int64"):  # a page the unifier enlarged past int64
        swa.with_block_size(2**61)


def test_specs_are_frozen_and_keyword_only():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32
    with pytest.raises(TypeError):
        FullAttentionSpec(16, 1, 64, torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_size=0), ValueError, "block_size must be >= 1, got 0"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
        (dict(head_size=-1), ValueError, "head_size must be >= 1"),
        (dict(head_size_v=-1), ValueError, "head_size_v must be >= 0"),
        (dict(block_size=True), TypeError, "block_size must be an int, got bool"),
        # An IntEnum member is an int too: InklingStream.V would be the size 1.
        (dict(block_size=InklingStream.V), TypeError, "block_size must be an int, got InklingStream"),
        (dict(dtype="bfloat16"), TypeError, "dtype must be a torch.dtype, got str"),
        # Every field in int64, the page not: 16 x 2**58 x (64 + 64) x 2 B = 2**70.
        (dict(num_kv_heads=2**58), ValueError, r"page_size_bytes \(block_size 16 x num_kv_heads 2\d+ x \(head_size 64 "
         r"\+ head_size_v 64\) x 2 B\) = 1180591620717411303424 does not fit in int64"),
    ],
)
def test_bad_fields_are_rejected(kwargs, error, match):
    fields = dict(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16) | kwargs
    with pytest.raises(error, match=match):
        FullAttentionSpec(**fields)


def test_subclass_fields_are_checked():
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.bfloat16, sliding_window=0)
    with pytest.raises(ValueError, match="block_stride_alignment must be >= 1, got 0"):
        CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.bfloat16, block_stride_alignment=0)
