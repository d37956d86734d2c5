"""The layout contracts: page arithmetic, the seed's error texts, bound views over strided caches.

Expected numbers are worked out by hand in comments or recomputed independently (a brute-force search,
a dense reshape of the raw buffer, a ring simulated with a dict), never read back from the code under test.
"""

import enum
import random

import pytest
import torch

from stepops.layouts import (
    BLOCK_SIZE_CANDIDATES,
    ROW_BYTES,
    CSATailRingLayout,
    InklingConvStateLayout,
    InklingStream,
    smallest_block_size,
)

ROW_ELEMENTS = 512  # 1024 bytes of bf16


def _seed_message(rows: int, page_bytes: int) -> str:
    return (
        f"Step5 CSA tail ring needs {rows} rows of 1024 bytes in one {page_bytes}-byte KV page; "
        "increase --block-size."
    )


def _random_bf16_bits(numel: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct-looking bf16 payload; compared through int16 views so NaN patterns compare exactly."""
    return torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16, generator=generator).view(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# CSATailRingLayout
# ---------------------------------------------------------------------------------------------------------


def test_ring_numbers_for_an_mla_page():
    # 64 tokens x 576 bf16 = 73728 B = 72 rows of 1 KB.
    layout = CSATailRingLayout(page_bytes=73728, block_size=64, num_speculative_tokens=3)
    assert layout.row_bytes == ROW_BYTES == 1024
    assert (layout.required_rows, layout.capacity, layout.head_size, layout.row_elements) == (10, 72, 576, 512)


def test_ring_rejects_too_few_rows_with_the_seed_message():
    # 8 KB page = 8 rows; k = 2 needs 9.
    with pytest.raises(ValueError) as error:
        CSATailRingLayout(page_bytes=8192, block_size=16, num_speculative_tokens=2)
    assert str(error.value) == _seed_message(9, 8192)


def test_ring_rejects_a_page_of_partial_rows_naming_the_cause():
    # 10 KB + 512 B holds 10 whole rows, enough for k = 3, but is not a whole number of rows: the seed's
    # "increase --block-size" would be wrong advice there, so the message names the partial row.
    with pytest.raises(ValueError) as error:
        CSATailRingLayout(page_bytes=10752, block_size=16, num_speculative_tokens=3)
    assert str(error.value) == (
        "Step5 CSA tail ring: a 10752-byte KV page is not a whole number of 1024-byte rows (10.5); the page "
        "must be a multiple of 1024 bytes (choose the block size accordingly)"
    )
    # Too few whole rows as well: the seed's message.
    with pytest.raises(ValueError) as error:
        CSATailRingLayout(page_bytes=9728, block_size=16, num_speculative_tokens=3)
    assert str(error.value) == _seed_message(10, 9728)


def test_ring_fits_exactly_at_seven_plus_k_rows():
    for k in range(0, 9):
        layout = CSATailRingLayout(page_bytes=(7 + k) * 1024, block_size=1, num_speculative_tokens=k)
        assert layout.capacity == 7 + k
        with pytest.raises(ValueError, match=r"^Step5 CSA tail ring needs"):
            CSATailRingLayout(page_bytes=(6 + k) * 1024, block_size=1, num_speculative_tokens=k)


def test_ring_rejects_a_page_that_is_not_whole_bf16_tokens():
    # 10240 B over 3 tokens is 3413.3 bf16 per token: the ring's spec could not reproduce the page size.
    with pytest.raises(ValueError, match="not a whole number of bf16 elements per token for block size 3"):
        CSATailRingLayout(page_bytes=10240, block_size=3, num_speculative_tokens=1)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(page_bytes=0, block_size=16, num_speculative_tokens=0), ValueError),
        (dict(page_bytes=16384, block_size=0, num_speculative_tokens=0), ValueError),
        (dict(page_bytes=16384, block_size=16, num_speculative_tokens=-1), ValueError),
        (dict(page_bytes=16384.0, block_size=16, num_speculative_tokens=0), TypeError),
        (dict(page_bytes=16384, block_size=16, num_speculative_tokens=True), TypeError),
    ],
)
def test_ring_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        CSATailRingLayout(**kwargs)


def test_ring_rejects_rows_of_odd_bytes_by_their_own_rule():
    # 16 rows of 1023 B fit the page with 16 B over: the partial-row rule would raise too, for another reason.
    with pytest.raises(ValueError, match="row_bytes must be a whole number of bf16 elements, got 1023"):
        CSATailRingLayout(page_bytes=16384, block_size=16, num_speculative_tokens=0, row_bytes=1023)


def test_ring_properties_over_random_parameters():
    rng = random.Random(1234)
    for _ in range(2000):
        block_size = rng.choice([1, 2, 3, 8, 16, 32, 48, 64, 128, 256])
        bytes_per_token = rng.choice([2, 64, 100, 128, 512, 576, 1024, 1152, 2048])
        k = rng.randrange(0, 16)
        page_bytes = block_size * bytes_per_token
        whole_rows = page_bytes % 1024 == 0
        fits = whole_rows and page_bytes >= 1024 * (7 + k) and page_bytes % (2 * block_size) == 0
        if not fits:
            with pytest.raises(ValueError):
                CSATailRingLayout(page_bytes=page_bytes, block_size=block_size, num_speculative_tokens=k)
            continue
        layout = CSATailRingLayout(page_bytes=page_bytes, block_size=block_size, num_speculative_tokens=k)
        # The ring's spec (block_size tokens x 1 head x head_size bf16) is exactly the main page.
        assert block_size * layout.head_size * 2 == page_bytes
        assert layout.capacity * 1024 == page_bytes
        assert layout.capacity >= 7 + k


def test_smallest_block_size_examples():
    # 1152 B/token: 16 tokens = 18 rows (fits k <= 11); k = 12 needs 19 rows -> 32 tokens = 36 rows.
    assert smallest_block_size(bytes_per_token=1152, num_speculative_tokens=3) == 16
    assert smallest_block_size(bytes_per_token=1152, num_speculative_tokens=11) == 16
    assert smallest_block_size(bytes_per_token=1152, num_speculative_tokens=12) == 32
    # 64 B/token (one 32-wide bf16 head): 10 rows = 10240 B = 160 tokens.
    assert smallest_block_size(bytes_per_token=64, num_speculative_tokens=3) == 160
    assert smallest_block_size(bytes_per_token=1152, num_speculative_tokens=12, candidates=[64, 8, 16]) == 64
    # Candidates are tried smallest first whatever their order: at 1152 B/token and k = 12 (19 rows) both 32
    # (36 rows) and 64 (72 rows) fit, 16 (18 rows) does not; the answer is 32, not the first listed.
    assert smallest_block_size(bytes_per_token=1152, num_speculative_tokens=12, candidates=[64, 32, 16]) == 32
    # 1 B/token needs 10240 tokens for 10 rows: past every candidate.
    with pytest.raises(ValueError, match="no candidate block size"):
        smallest_block_size(bytes_per_token=1, num_speculative_tokens=3)


def test_smallest_block_size_is_minimal_over_random_parameters():
    assert BLOCK_SIZE_CANDIDATES == tuple(range(16, 4097, 16))
    rng = random.Random(99)
    for _ in range(300):
        bytes_per_token = rng.choice([2, 6, 64, 96, 256, 576, 1000, 1152, 4096])
        k = rng.randrange(0, 20)

        def fits(block_size):
            page = block_size * bytes_per_token
            return page % 1024 == 0 and page // 1024 >= 7 + k and page % (2 * block_size) == 0

        expected = next((b for b in range(16, 4097, 16) if fits(b)), None)
        if expected is None:
            with pytest.raises(ValueError):
                smallest_block_size(bytes_per_token=bytes_per_token, num_speculative_tokens=k)
        else:
            assert smallest_block_size(bytes_per_token=bytes_per_token, num_speculative_tokens=k) == expected


# ---------------------------------------------------------------------------------------------------------
# BoundCSATailRing
# ---------------------------------------------------------------------------------------------------------


def _strided_ring_cache(num_blocks, block_size, capacity, rows_per_block, *, lead_rows=0, seed=0):
    """A raw bf16 buffer and a [num_blocks, block_size, head_size] cache view into it.

    Block b starts ``lead_rows + b * rows_per_block`` rows into the buffer; the buffer ends exactly where
    the last block's page ends, so a view reaching further would fail.
    """
    generator = torch.Generator().manual_seed(seed)
    total_rows = lead_rows + (num_blocks - 1) * rows_per_block + capacity
    raw = _random_bf16_bits(total_rows * ROW_ELEMENTS, generator)
    head_size = capacity * ROW_ELEMENTS // block_size
    cache = raw.as_strided(
        (num_blocks, block_size, head_size), (rows_per_block * ROW_ELEMENTS, head_size, 1), lead_rows * ROW_ELEMENTS
    )
    return raw, cache


def _ring_of(raw, block, capacity, rows_per_block, lead_rows=0):
    start = (lead_rows + block * rows_per_block) * ROW_ELEMENTS
    return raw[start : start + capacity * ROW_ELEMENTS].view(capacity, ROW_ELEMENTS)


@pytest.mark.parametrize("rows_per_block", [12, 13, 20])
@pytest.mark.parametrize("lead_rows", [0, 3])
def test_bound_ring_over_strided_blocks(rows_per_block, lead_rows):
    # 16 tokens x 384 bf16 = 12 KB page = 12 rows; blocks strided to rows_per_block rows.
    layout = CSATailRingLayout(page_bytes=12288, block_size=16, num_speculative_tokens=4)
    num_blocks = 4
    raw, cache = _strided_ring_cache(num_blocks, 16, 12, rows_per_block, lead_rows=lead_rows)
    ring = layout.bind(cache)
    assert (ring.capacity, ring.rows_per_block, ring.num_blocks, ring.row_elements) == (12, rows_per_block, 4, 512)
    assert ring.kv_cache is cache
    assert ring.rows.shape == ((num_blocks - 1) * rows_per_block + 12, 512)
    for block in range(num_blocks):
        expected = _ring_of(raw, block, 12, rows_per_block, lead_rows)
        got = ring.block_rows(block)
        assert got.shape == (12, 512)
        assert got.data_ptr() == expected.data_ptr()
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
        for position in (0, 5, 11, 12, 29):
            row = ring.row_index(block, position)
            assert torch.equal(ring.rows[row].view(torch.int16), expected[position % 12].view(torch.int16))


@pytest.mark.parametrize("rows_per_block", [12, 17])
def test_writes_through_the_ring_api_never_touch_gap_rows(rows_per_block):
    layout = CSATailRingLayout(page_bytes=12288, block_size=16, num_speculative_tokens=4)
    num_blocks = 3
    raw, cache = _strided_ring_cache(num_blocks, 16, 12, rows_per_block, lead_rows=2, seed=7)
    before = raw.clone()
    ring = layout.bind(cache)

    # Write every position of a long stream through row_index (int and tensor forms) and block_rows.
    value = torch.full((512,), 1.5, dtype=torch.bfloat16)
    for block in range(num_blocks):
        for position in range(40):
            ring.rows[ring.row_index(block, position)] = value
    positions = torch.arange(0, 100, dtype=torch.int64)
    ring.rows[ring.row_index(torch.full_like(positions, 1), positions)] = torch.full((512,), 2.5, dtype=torch.bfloat16)
    ring.block_rows(2).fill_(3.5)

    expected = before.clone()
    for block, fill in ((0, 1.5), (1, 2.5), (2, 3.5)):
        _ring_of(expected, block, 12, rows_per_block, lead_rows=2).fill_(fill)
    assert torch.equal(raw.view(torch.int16), expected.view(torch.int16))


def test_row_index_tensor_form_matches_a_simulated_ring():
    layout = CSATailRingLayout(page_bytes=10240, block_size=16, num_speculative_tokens=3)
    raw, cache = _strided_ring_cache(5, 16, 10, 14)
    ring = layout.bind(cache)
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 5, (200,), generator=generator, dtype=torch.int32)
    positions = torch.randint(0, 10_000, (200,), generator=generator, dtype=torch.int32)
    rows = ring.row_index(blocks, positions)
    assert rows.dtype == torch.int32
    for b, p, r in zip(blocks.tolist(), positions.tolist(), rows.tolist()):
        # Independent formulation: block b's ring starts b * 14 rows in; slot cycles every 10 positions.
        assert r == b * 14 + (p - 10 * (p // 10))
        assert r == ring.row_index(b, p)


def test_any_seven_plus_k_consecutive_positions_use_distinct_rows():
    # The reason for 7 + k: one step's k + 1 stores plus 7 replayed rows must never share a row.
    rng = random.Random(5)
    for _ in range(50):
        k = rng.randrange(0, 8)
        capacity = 7 + k + rng.randrange(0, 4)
        layout = CSATailRingLayout(page_bytes=capacity * 1024, block_size=2, num_speculative_tokens=k)
        cache = torch.zeros(2, 2, capacity * 256, dtype=torch.bfloat16)
        ring = layout.bind(cache)
        for start in range(0, 3 * capacity):
            window = [ring.row_index(1, p) for p in range(start, start + 7 + k)]
            assert len(set(window)) == 7 + k
            assert all(capacity <= row < 2 * capacity for row in window)


def test_row_index_and_block_rows_reject_out_of_range_ints():
    layout = CSATailRingLayout(page_bytes=10240, block_size=16, num_speculative_tokens=3)
    ring = layout.bind(torch.zeros(3, 16, 320, dtype=torch.bfloat16))
    for block, position in ((3, 0), (-1, 0), (0, -1)):
        with pytest.raises(ValueError):
            ring.row_index(block, position)
    with pytest.raises(ValueError, match="block 3 out of range for a ring cache of 3 blocks"):
        ring.block_rows(3)
    with pytest.raises(ValueError):
        ring.block_rows(-1)
    with pytest.raises(TypeError):
        ring.row_index(torch.zeros(2), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError):
        ring.row_index(0, 1.0)


def test_bind_rejects_caches_that_do_not_match_the_layout():
    layout = CSATailRingLayout(page_bytes=10240, block_size=16, num_speculative_tokens=3)
    with pytest.raises(TypeError, match="must be bfloat16, got torch.float16"):
        layout.bind(torch.zeros(3, 16, 320, dtype=torch.float16))
    with pytest.raises(TypeError):
        layout.bind([0.0])
    with pytest.raises(ValueError, match="block holds 4608 elements.*is 5120 bf16 elements"):
        layout.bind(torch.zeros(3, 16, 288, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        layout.bind(torch.zeros(0, 16, 320, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        layout.bind(torch.zeros(5120, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous within a block"):
        layout.bind(torch.zeros(3, 320, 16, dtype=torch.bfloat16).transpose(1, 2))
    # Block stride of 5120 + 256 elements: not a whole number of rows.
    with pytest.raises(ValueError, match="block stride 5376 is not a whole number of 512-element rows"):
        layout.bind(torch.zeros(3, 5376, dtype=torch.bfloat16)[:, :5120])
    # Blocks 9 rows apart overlap 10-row pages.
    raw = torch.zeros(40 * 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="blocks overlap"):
        layout.bind(raw.as_strided((3, 5120), (9 * 512, 1)))


def test_bind_of_one_block_ignores_its_stride():
    """A single block has no neighbour to overlap, so its stride(0) (arbitrary in size-1 views) is not read,
    as the attention and conv-state binds treat it; it was refused as "blocks overlap"."""
    layout = CSATailRingLayout(page_bytes=10240, block_size=16, num_speculative_tokens=3)
    page = torch.arange(5120, dtype=torch.float32).to(torch.bfloat16)
    ring = layout.bind(page.as_strided((1, 5120), (7, 1)))
    assert (ring.capacity, ring.rows_per_block, ring.num_blocks) == (10, 10, 1)
    assert ring.rows.data_ptr() == page.data_ptr() and torch.equal(ring.rows.flatten(), page)


# ---------------------------------------------------------------------------------------------------------
# InklingConvStateLayout
# ---------------------------------------------------------------------------------------------------------


def test_inkling_numbers():
    layout = InklingConvStateLayout(num_kv_heads=8, head_dim=128, hidden_size=4096, kernel_size=4)
    assert (layout.local_num_kv_heads, layout.hidden_per_head, layout.local_hidden_size) == (8, 512, 4096)
    # 2*128 + 2*512 = 1280 -> 2048.
    assert (layout.packed_width, layout.head_size) == (1280, 2048)
    assert layout.stream_ranges == ((0, 128), (128, 128), (256, 512), (768, 512))
    assert layout.stream_range(InklingStream.K) == (0, 128)
    assert layout.stream_range(InklingStream.V) == (128, 128)
    assert layout.stream_range(InklingStream.ATTN_OUT) == (256, 512)
    assert layout.stream_range(InklingStream.MLP_OUT) == (768, 512)
    assert layout.cache_shape(10) == (10, 8, 4, 2048)
    assert layout.cache_shape(10, 32) == (10, 8, 32, 2048)
    assert layout.page_bytes() == 8 * 4 * 2048 * 2
    assert layout.page_bytes(32) == 8 * 32 * 2048 * 2
    # An exact power of two is not padded: 2*64 + 2*64 = 256.
    assert InklingConvStateLayout(num_kv_heads=4, head_dim=64, hidden_size=256, kernel_size=4).head_size == 256


def test_inkling_stream_range_of_adjacent_streams():
    """Adjacent streams taken as one: offset of the first, widths summed (K and V 8 wide, ATTN_OUT and MLP_OUT
    12 / 2 = 6 wide), so also where the widths differ (V + ATTN_OUT = 8 + 6)."""
    layout = InklingConvStateLayout(num_kv_heads=2, head_dim=8, hidden_size=12, kernel_size=3)
    assert layout.stream_range((InklingStream.K, InklingStream.V)) == (0, 16)
    assert layout.stream_range((InklingStream.V, InklingStream.ATTN_OUT)) == (8, 14)
    assert layout.stream_range((InklingStream.ATTN_OUT, InklingStream.MLP_OUT)) == (16, 12)
    assert layout.stream_range(tuple(InklingStream)) == (0, 28)  # 2*8 + 2*6, the whole packed width
    assert layout.stream_range((InklingStream.MLP_OUT,)) == (22, 6)
    with pytest.raises(ValueError, match=r"streams \['V', 'K'\] are not adjacent"):
        layout.stream_range((InklingStream.V, InklingStream.K))
    with pytest.raises(ValueError, match=r"streams \['K', 'ATTN_OUT'\] are not adjacent"):
        layout.stream_range((InklingStream.K, InklingStream.ATTN_OUT))
    with pytest.raises(ValueError, match="stream must be one of"):
        layout.stream_range(())


def test_inkling_streams_by_name():
    assert [s.name for s in InklingStream] == ["K", "V", "ATTN_OUT", "MLP_OUT"]
    layout = InklingConvStateLayout(num_kv_heads=2, head_dim=8, hidden_size=12, kernel_size=3)
    assert layout.stream_range(InklingStream["ATTN_OUT"]) == (16, 6)
    assert layout.stream_range(3) == (22, 6)
    with pytest.raises(ValueError, match="stream must be one of"):
        layout.stream_range(4)


class _OtherEnum(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize("bad", ["1", "K", 1.7, True, None, (InklingStream.K, "1"), _OtherEnum.ONE], ids=repr)
def test_inkling_stream_range_refuses_a_stream_that_is_not_an_int(bad):
    """``int(stream)`` took "1", 1.7 and True silently as V, and failed on "K" or None naming no argument.
    Another IntEnum's member (value 1) was still taken as V."""
    layout = InklingConvStateLayout(num_kv_heads=2, head_dim=8, hidden_size=12, kernel_size=3)
    with pytest.raises(TypeError, match=r"stream must be an InklingStream \(or its int value\), got"):
        layout.stream_range(bad)


def test_inkling_stream_range_traces_under_fullgraph_compile():
    layout = InklingConvStateLayout(num_kv_heads=2, head_dim=8, hidden_size=12, kernel_size=3)

    @torch.compile(fullgraph=True, backend="eager")
    def shifted(x):
        offset, width = layout.stream_range(InklingStream.MLP_OUT)
        return x + offset * 100 + width

    assert shifted(torch.zeros(1)).tolist() == [2206.0]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(tp_size=16), ValueError, "sconv SWA cache supports tp_size <= num_kv_heads (8), got 16"),
        (dict(tp_size=3), ValueError, "num_kv_heads (8) divisible by tp_size (3)"),
        (dict(hidden_size=4100, tp_size=2), ValueError, "at tp_size 2 needs hidden_size (4100) divisible by num_kv_heads (8)"),
        (dict(dtype=torch.float16), ValueError, "sconv SWA cache supports bfloat16 only, got torch.float16"),
        (dict(dtype="bfloat16"), TypeError, "dtype must be a torch.dtype"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1, got 0"),
        (dict(head_dim=-1), ValueError, "head_dim must be >= 1, got -1"),
        (dict(kernel_size=0), ValueError, "kernel_size must be >= 1, got 0"),
        (dict(tp_size=0), ValueError, "tp_size must be >= 1, got 0"),
        (dict(hidden_size=4096.0), TypeError, "hidden_size must be an int, got float"),
    ],
)
def test_inkling_rejects_bad_configurations(kwargs, error, message):
    arguments = dict(num_kv_heads=8, head_dim=128, hidden_size=4096, kernel_size=4) | kwargs
    with pytest.raises(error) as raised:
        InklingConvStateLayout(**arguments)
    assert message in str(raised.value)


def test_inkling_tp_exact_message():
    with pytest.raises(ValueError) as raised:
        InklingConvStateLayout(num_kv_heads=4, head_dim=64, hidden_size=1024, kernel_size=4, tp_size=8)
    assert str(raised.value) == "sconv SWA cache supports tp_size <= num_kv_heads (4), got 8"


def test_inkling_block_size_below_the_kernel_is_rejected():
    layout = InklingConvStateLayout(num_kv_heads=8, head_dim=128, hidden_size=4096, kernel_size=4)
    with pytest.raises(ValueError, match="block size 3 is smaller than the kernel size 4"):
        layout.cache_shape(2, 3)
    with pytest.raises(ValueError, match="block size 2 is smaller than the kernel size 4"):
        layout.page_bytes(2)
    with pytest.raises(ValueError):
        layout.cache_shape(0)


def test_inkling_d_is_tp_invariant():
    for heads, head_dim, hidden in ((8, 128, 4096), (16, 64, 2048), (12, 96, 3072)):
        base = InklingConvStateLayout(num_kv_heads=heads, head_dim=head_dim, hidden_size=hidden, kernel_size=4)
        for tp in [t for t in range(1, heads + 1) if heads % t == 0]:
            layout = InklingConvStateLayout(
                num_kv_heads=heads, head_dim=head_dim, hidden_size=hidden, kernel_size=4, tp_size=tp
            )
            assert layout.head_size == base.head_size
            assert layout.stream_ranges == base.stream_ranges
            assert layout.local_num_kv_heads * tp == heads
            # The hidden-sharded attn/MLP streams: this rank's hidden chunk spread over its own heads.
            assert layout.local_hidden_size * tp == hidden
            assert layout.local_hidden_size == layout.local_num_kv_heads * layout.hidden_per_head
            assert layout.page_bytes(32) * tp == base.page_bytes(32)


def test_inkling_properties_over_random_parameters():
    rng = random.Random(2026)
    for _ in range(2000):
        heads = rng.choice([1, 2, 4, 6, 8, 16, 32])
        tp = rng.choice([t for t in range(1, heads + 1) if heads % t == 0])
        head_dim = rng.choice([8, 64, 96, 128, 256])
        # Unsharded, any hidden size: the last head's chunks are padded to the others' width.
        hidden = heads * rng.randrange(1, 700) if tp > 1 else rng.randrange(1, 700 * heads)
        kernel = rng.randrange(1, 9)
        layout = InklingConvStateLayout(
            num_kv_heads=heads, head_dim=head_dim, hidden_size=hidden, kernel_size=kernel, tp_size=tp
        )
        chunk = (hidden + heads - 1) // heads
        assert (chunk - 1) * heads < hidden <= layout.local_hidden_size * tp == chunk * heads
        assert layout.hidden_padding == chunk * heads - hidden
        packed = 2 * head_dim + 2 * chunk
        d = 1
        while d < packed:
            d *= 2
        assert layout.head_size == d
        # The four streams tile [0, packed) in order without overlap.
        end = 0
        for stream in InklingStream:
            offset, width = layout.stream_range(stream)
            assert offset == end and width > 0
            end = offset + width
        assert end == packed <= layout.head_size
        block_size = kernel + rng.randrange(0, 40)
        shape = layout.cache_shape(3, block_size)
        assert shape == (3, heads // tp, block_size, d)
        assert layout.page_bytes(block_size) * 3 == torch.empty(shape, dtype=torch.bfloat16, device="meta").nbytes


# ---------------------------------------------------------------------------------------------------------
# BoundInklingConvState
# ---------------------------------------------------------------------------------------------------------


def test_inkling_bind_takes_one_block_with_any_block_stride():
    """One block has no neighbour to overlap: its stride(0) may be anything, as for the ring."""
    layout = InklingConvStateLayout(num_kv_heads=2, head_dim=8, hidden_size=16, kernel_size=4)
    cache = torch.zeros(layout.cache_shape(1), dtype=torch.bfloat16)
    for stride in (0, 1):
        view = cache.as_strided(cache.shape, (stride, *cache.stride()[1:]))
        assert layout.bind(view).num_blocks == 1


@pytest.mark.parametrize("block_size", [4, 32])
def test_inkling_bind_reads_the_block_size_from_a_page_strided_view(block_size):
    layout = InklingConvStateLayout(num_kv_heads=4, head_dim=8, hidden_size=16, kernel_size=4, tp_size=2)
    heads, d = 2, 32  # 2*8 + 2*4 = 24 -> 32
    page = heads * block_size * d
    padded_page = page + 3 * d  # the engine's page is larger than this layer's block
    raw = torch.zeros(5, padded_page, dtype=torch.bfloat16)
    cache = raw[:, :page].view(5, heads, block_size, d)
    assert cache.stride(0) == padded_page
    bound = layout.bind(cache)
    assert (bound.block_size, bound.num_blocks) == (block_size, 5)
    assert bound.kv_cache is cache


def test_inkling_bind_rejects_mismatched_caches():
    layout = InklingConvStateLayout(num_kv_heads=4, head_dim=8, hidden_size=16, kernel_size=4, tp_size=2)
    bf16 = torch.bfloat16
    with pytest.raises(TypeError, match="kv_cache must be a torch.Tensor, got list"):
        layout.bind([0.0])
    with pytest.raises(TypeError, match="supports bfloat16 only, got torch.float32"):
        layout.bind(torch.zeros(3, 2, 4, 32))
    with pytest.raises(ValueError, match=r"must have H = 2 and D = 32, got shape \(3, 4, 4, 32\)"):
        layout.bind(torch.zeros(3, 4, 4, 32, dtype=bf16))
    with pytest.raises(ValueError, match="H = 2 and D = 32"):
        layout.bind(torch.zeros(3, 2, 4, 24, dtype=bf16))
    with pytest.raises(ValueError, match="block size 3 is smaller than the kernel size 4"):
        layout.bind(torch.zeros(3, 2, 3, 32, dtype=bf16))
    with pytest.raises(ValueError, match=r"must be \[num_blocks, H, N, D\]"):
        layout.bind(torch.zeros(3, 8, 32, dtype=bf16))
    with pytest.raises(ValueError, match="at least one block"):
        layout.bind(torch.zeros(0, 2, 4, 32, dtype=bf16))
    with pytest.raises(ValueError, match="contiguous within a block"):
        layout.bind(torch.zeros(3, 4, 2, 32, dtype=bf16).transpose(1, 2))  # NHD, not HND
    with pytest.raises(ValueError, match="blocks overlap"):
        layout.bind(torch.zeros(3 * 256, dtype=bf16).as_strided((3, 2, 4, 32), (200, 128, 32, 1)))
    with pytest.raises(ValueError, match="block stride 255 elements is less than one 256-element page"):
        layout.bind(torch.zeros(3 * 256, dtype=bf16).as_strided((3, 2, 4, 32), (255, 128, 32, 1)))  # one shared
