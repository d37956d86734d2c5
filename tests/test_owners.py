"""The seeds' cache owners, engine-neutral: every method and error of the two seeds, plus the attention owner.

Expected values are counted by hand from the seeds (page sizes, rows, slots), never taken from the code.
"""

from types import MappingProxyType

import pytest
import torch
import torch.nn.functional as F

from stepops.layouts import InklingStream
from stepops.ops.csa_ring_update import CSARingMetadata
from stepops.owners import (
    InklingConvState,
    InklingSconvBackend,
    InklingSconvMetadataBuilder,
    PagedAttentionBackend,
    PagedAttentionLayer,
    Step5CSATailRing,
    Step5CSATailRingBackend,
    Step5CSATailRingMetadataBuilder,
)
from stepops.specs import CircularBufferSpec, FullAttentionSpec, SlidingWindowSpec


def _main_layer(context, block_size=16, head_size=256, prefix="layers.0.attn"):
    # One KV head of 256 K + 256 V bf16: 1 KB per token, so a page of block_size tokens holds block_size rows.
    return PagedAttentionLayer(
        prefix=prefix, num_kv_heads=1, head_size=head_size, block_size=block_size, static_forward_context=context
    )


def _ring(context, k=2, prefix="layers.0.ring", main="layers.0.attn"):
    return Step5CSATailRing(
        prefix=prefix, main_layer_name=main, num_speculative_tokens=k, static_forward_context=context
    )


# ---------------------------------------------------------------------------------------------------------
# PagedAttentionLayer
# ---------------------------------------------------------------------------------------------------------


def test_paged_attention_layer_specs_and_registration():
    context = {}
    full = PagedAttentionLayer(prefix="a", num_kv_heads=2, head_size=64, block_size=16, static_forward_context=context)
    swa = PagedAttentionLayer(
        prefix="b", num_kv_heads=2, head_size=64, block_size=16, static_forward_context=context, sliding_window=128
    )
    assert context == {"a": full, "b": swa}
    assert full.get_kv_cache_spec() == FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    assert swa.get_kv_cache_spec() == SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    assert full.get_attn_backend() is PagedAttentionBackend
    with pytest.raises(ValueError, match="^Duplicate layer name: a$"):
        PagedAttentionLayer(prefix="a", num_kv_heads=1, head_size=8, block_size=16, static_forward_context=context)


def test_paged_attention_layer_binds_strided_nhd_cache():
    context = {}
    layer = PagedAttentionLayer(
        prefix="a", num_kv_heads=2, head_size=8, head_size_v=4, block_size=4, static_forward_context=context
    )
    page = 8 * 2 * 12  # N = 8 tokens of 2 heads * 12
    base = torch.arange(3 * (page + 8), dtype=torch.bfloat16)
    cache = base.as_strided((3, 8, 2, 12), (page + 8, 24, 12, 1))  # N = 8: a scaled block, strided pages
    layer.bind_kv_cache(cache)
    assert layer.kv_cache is cache
    assert torch.equal(layer.key_cache, cache[..., :8]) and torch.equal(layer.value_cache, cache[..., 8:])
    with pytest.raises(ValueError, match=r"must be \[num_blocks, N, 2, 12\] with num_blocks >= 1 and N a positive multiple of 4"):
        layer.bind_kv_cache(torch.zeros(3, 6, 2, 12, dtype=torch.bfloat16))
    # One head where the spec has two (N = 8 is a multiple of 4, the width is right): not this layer's cache.
    with pytest.raises(ValueError, match=r"must be \[num_blocks, N, 2, 12\] .*got shape \(3, 8, 1, 12\)"):
        layer.bind_kv_cache(torch.zeros(3, 8, 1, 12, dtype=torch.bfloat16))
    # No block: a ValueError as for the ring and the conv state (it was an IndexError reading block 0).
    with pytest.raises(ValueError, match=r"num_blocks >= 1 and N a positive multiple of 4, got shape \(0, 8, 2, 12\)"):
        layer.bind_kv_cache(torch.zeros(0, 8, 2, 12, dtype=torch.bfloat16))
    # Blocks of no token (0 is a multiple of 4): paged_kv_write refused them only at the first step.
    with pytest.raises(ValueError, match=r"N a positive multiple of 4, got shape \(3, 0, 2, 12\)"):
        layer.bind_kv_cache(torch.zeros(3, 0, 2, 12, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="must be torch.bfloat16, got torch.float32"):
        layer.bind_kv_cache(torch.zeros(3, 4, 2, 12))
    for blocks in (3, 2):  # two blocks are enough to overlap
        with pytest.raises(ValueError, match="blocks overlap"):
            layer.bind_kv_cache(base.as_strided((blocks, 8, 2, 12), (page // 2, 24, 12, 1)))
    # Wider than head_size + head_size_v: the value view would take the extra columns.
    with pytest.raises(ValueError, match=r"must be \[num_blocks, N, 2, 12\] .*got shape \(3, 8, 2, 16\)"):
        layer.bind_kv_cache(torch.zeros(3, 8, 2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous within a block"):
        layer.bind_kv_cache(torch.zeros(3, 2, 4, 12, dtype=torch.bfloat16).transpose(1, 2))


@pytest.mark.parametrize("prefix", ["", None, 3])
def test_a_layer_needs_a_non_empty_name(prefix):
    with pytest.raises(TypeError, match="prefix must be a non-empty str"):
        PagedAttentionLayer(prefix=prefix, num_kv_heads=1, head_size=8, block_size=4, static_forward_context={})


def test_paged_attention_layer_with_one_packed_latent_has_no_value_columns():
    """``head_size_v=0`` (an MLA-style latent): the keys are the whole last dim, the values an empty slice."""
    layer = PagedAttentionLayer(
        prefix="a", num_kv_heads=1, head_size=576, head_size_v=0, block_size=4, static_forward_context={}
    )
    cache = torch.randn(2, 4, 1, 576).to(torch.bfloat16)
    layer.bind_kv_cache(cache)
    assert torch.equal(layer.key_cache, cache)
    assert layer.value_cache.shape == (2, 4, 1, 0)


# ---------------------------------------------------------------------------------------------------------
# Step5CSATailRing
# ---------------------------------------------------------------------------------------------------------


def test_ring_registers_and_starts_unbound():
    context = {}
    _main_layer(context)
    ring = _ring(context, k=3)
    assert context["layers.0.ring"] is ring
    assert ring.layer_name == "layers.0.ring" and ring.main_layer_name == "layers.0.attn"
    assert ring.required_rows == 10
    assert ring.kv_cache.numel() == 0 and ring.rows.numel() == 0
    assert (ring.capacity, ring.rows_per_block) == (0, 0)
    assert isinstance(ring, torch.nn.Module)


def test_ring_duplicate_name_is_the_seeds_error():
    context = {}
    _main_layer(context)
    _ring(context)
    with pytest.raises(ValueError, match="^Duplicate layer name: layers.0.ring$"):
        _ring(context)
    with pytest.raises(ValueError, match="^Duplicate layer name: layers.0.attn$"):
        _ring(context, prefix="layers.0.attn")


@pytest.mark.parametrize(
    "num_kv_heads, head_size, ring_head_size, page_bytes, capacity",
    [
        # One KV head of 256 K + 256 V bf16: 1 KB per token, 16 tokens = 16384 B = 16 rows of 512 bf16.
        (1, 256, 512, 16384, 16),
        # 8 KV heads of 128 K + 128 V bf16: 8 * 256 * 2 = 4096 B per token, 16 tokens = 65536 B = 64 rows. The
        # ring declares 1 KV head of 65536 / (16 * 2) = 2048 bf16 per token (not one 512-element row, not the
        # main layer's 8 heads), so its page is the main page.
        (8, 128, 2048, 65536, 64),
    ],
    ids=["one_head", "eight_heads"],
)
def test_ring_spec_is_one_main_page_of_rows(num_kv_heads, head_size, ring_head_size, page_bytes, capacity):
    context = {}
    main = PagedAttentionLayer(
        prefix="layers.0.attn", num_kv_heads=num_kv_heads, head_size=head_size, block_size=16,
        static_forward_context=context,
    )
    ring = _ring(context, k=2)
    spec = ring.get_kv_cache_spec()
    assert spec == CircularBufferSpec(
        block_size=16, num_kv_heads=1, head_size=ring_head_size, head_size_v=0, dtype=torch.bfloat16,
        block_stride_alignment=1024,
    )
    assert spec.page_size_bytes == main.get_kv_cache_spec().page_size_bytes == page_bytes
    assert page_bytes // 1024 == capacity
    assert (ring.capacity, ring.rows_per_block) == (0, 0), "the spec sizes the page; only a bind sets these"


@pytest.mark.parametrize(
    "block_size, head_size, k, message",
    [
        # 4 tokens * 1 KB = 4 rows < 7 + 2.
        (4, 256, 2, "Step5 CSA tail ring needs 9 rows of 1024 bytes in one 4096-byte KV page; increase --block-size."),
        # 16 tokens * (100 + 100) * 2 B = 6400 bytes: not whole rows.
        (16, 100, 0, "Step5 CSA tail ring needs 7 rows of 1024 bytes in one 6400-byte KV page; increase --block-size."),
    ],
)
def test_ring_spec_too_small_page_is_the_seeds_error(block_size, head_size, k, message):
    context = {}
    _main_layer(context, block_size=block_size, head_size=head_size)
    ring = _ring(context, k=k)
    with pytest.raises(ValueError) as info:
        ring.get_kv_cache_spec()
    assert str(info.value) == message


def test_ring_spec_needs_its_main_layer():
    context = {}
    ring = _ring(context, main="nowhere")
    with pytest.raises(ValueError, match="main layer 'nowhere' is not in the forward context"):
        ring.get_kv_cache_spec()
    context["nowhere"] = object()
    with pytest.raises(TypeError, match="has no get_kv_cache_spec"):
        ring.get_kv_cache_spec()


def test_ring_rejects_bad_arguments_before_registering():
    context = {}
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0, got -1"):
        _ring(context, k=-1)
    with pytest.raises(TypeError, match="num_speculative_tokens must be an int"):
        _ring(context, k=1.0)
    with pytest.raises(TypeError, match=r"main_layer_name must be a layer name \(str\), got list"):
        _ring(context, main=["layers.0.attn"])  # failed at allocation: "unhashable type: 'list'"
    assert context == {}


def _fill_rows(kv_cache: torch.Tensor) -> None:
    # Every element of the whole storage gets a distinct value, so aliasing is visible.
    storage = kv_cache.as_strided((kv_cache.untyped_storage().nbytes() // 2,), (1,), 0)
    storage.copy_(torch.arange(storage.numel(), dtype=torch.float32).to(torch.bfloat16))


def test_ring_binds_contiguous_blocks():
    context = {}
    _main_layer(context)
    ring = _ring(context)
    cache = torch.empty(3, 16, 1, 512, dtype=torch.bfloat16)
    _fill_rows(cache)
    ring.bind_kv_cache(cache)
    assert (ring.capacity, ring.rows_per_block) == (16, 16)
    assert ring.kv_cache is cache
    assert ring.rows.shape == (48, 512)
    assert torch.equal(ring.rows, cache.reshape(48, 512))


def test_a_spec_asked_again_after_binding_leaves_the_bound_ring_alone():
    """An engine may ask for specs again after binding. The spec set ``capacity`` from the main page (18 rows
    here) while the bound cache's blocks hold 16, so update() passed 18 and the ring at block 0 wrote row 16:
    block 1's, another request's, even with validate=True."""
    context = {}
    PagedAttentionLayer(
        prefix="layers.0.attn", num_kv_heads=1, head_size=576, head_size_v=0, block_size=16,
        static_forward_context=context,
    )  # fmt: skip
    ring = _ring(context, k=0)
    buffer = torch.full((3 * 16 * 512,), -7.0, dtype=torch.bfloat16)
    ring.bind_kv_cache(buffer.view(3, 16, 1, 512))
    ring.get_kv_cache_spec()
    assert (ring.capacity, ring.rows_per_block) == (16, 16)
    metadata = ring.metadata_builder(summary_block_size=4).build(
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([17], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), 1,
    )  # fmt: skip
    rows = torch.ones(1, 256, dtype=torch.bfloat16)
    ring.update(rows, rows, torch.zeros(16, 256, dtype=torch.bfloat16), metadata, validate=True)
    written = (buffer.view(-1, 512) != -7).any(1).nonzero().flatten().tolist()
    assert written == [0], "position 16 is row 16 % 16 of block 0's ring (capacity 18 made it row 16, block 1's)"


def test_ring_update_validates_metadata_against_its_own_block_stride():
    """Metadata built for 16-row blocks on a ring whose blocks are 24 rows apart: block 1's ring would start
    at row 16, inside block 0, and its 16 rows run into block 1's ring. One base alone shows no stride, so
    only the bound ring's rows_per_block (the owner passes it) catches it; nothing is written."""
    context = {}
    _main_layer(context)
    ring = _ring(context, k=0)
    buffer = torch.full((3 * 24 * 512,), -7.0, dtype=torch.bfloat16)
    ring.bind_kv_cache(buffer.as_strided((3, 16, 1, 512), (24 * 512, 512, 512, 1)))
    assert (ring.capacity, ring.rows_per_block) == (16, 24)
    metadata = Step5CSATailRingMetadataBuilder(16, 4).build(
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), 1,
    )  # fmt: skip
    rows = torch.ones(1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ring_base 16 is not a multiple of rows_per_block 24"):
        ring.update(rows, rows, torch.zeros(16, 256, dtype=torch.bfloat16), metadata, validate=True)
    assert bool((buffer == -7.0).all())


@pytest.mark.parametrize("main", ["layers.0.ring", "layers.0.other_ring"], ids=["itself", "another_ring"])
def test_a_ring_whose_main_layer_is_a_ring_is_a_value_error(main):
    """Before: RecursionError (the ring asked itself, or two rings asked each other, for their specs)."""
    context = {}
    _main_layer(context)
    ring = _ring(context, main=main)
    _ring(context, prefix="layers.0.other_ring", main="layers.0.ring")
    with pytest.raises(ValueError, match=rf"main layer '{main}' is a CSA tail ring; name the attention layer"):
        ring.get_kv_cache_spec()


def test_ring_binds_page_strided_blocks():
    context = {}
    _main_layer(context)
    ring = _ring(context)
    buffer = torch.empty(3 * 24 * 512, dtype=torch.bfloat16)  # 24 rows between blocks, 16 in each page
    cache = buffer.as_strided((3, 16, 1, 512), (24 * 512, 512, 512, 1))
    _fill_rows(cache)
    ring.bind_kv_cache(cache)
    assert (ring.capacity, ring.rows_per_block) == (16, 24)
    # Seed: (num_blocks - 1) * rows_per_block + capacity rows, block b's ring at rows [24 b, 24 b + 16).
    assert ring.rows.shape == (2 * 24 + 16, 512)
    for block in range(3):
        assert torch.equal(ring.rows[24 * block : 24 * block + 16], cache[block].reshape(16, 512))
    assert torch.equal(ring.rows, buffer[: 64 * 512].view(64, 512))


def test_ring_bind_rejects_bad_caches_with_value_errors():
    context = {}
    _main_layer(context)
    ring = _ring(context, k=2)
    buffer = torch.zeros(4 * 16 * 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^Step5 CSA tail ring layers.0.ring: .*block stride 8448 is not a whole number of 512-element rows"):
        ring.bind_kv_cache(buffer.as_strided((3, 16, 1, 512), (16 * 512 + 256, 512, 512, 1)))
    with pytest.raises(ValueError, match="blocks overlap"):
        ring.bind_kv_cache(buffer.as_strided((3, 16, 1, 512), (8 * 512, 512, 512, 1)))
    # A wrong tensor, not a wrong --block-size: the message says so (the seed's advice is for the spec).
    with pytest.raises(ValueError) as info:
        ring.bind_kv_cache(torch.zeros(3, 4, 1, 512, dtype=torch.bfloat16))
    assert str(info.value) == (
        "Step5 CSA tail ring layers.0.ring: a bound cache block of 4096 bytes (shape (4, 1, 512), "
        "torch.bfloat16) is not 9 or more whole 1024-byte rows; bind the cache allocated for this ring's "
        "get_kv_cache_spec()"
    )
    # 8 whole rows, one short of 7 + 2: still the bound tensor's message, not the seed's --block-size advice.
    with pytest.raises(ValueError) as info:
        ring.bind_kv_cache(torch.zeros(3, 8, 1, 512, dtype=torch.bfloat16))
    assert str(info.value).startswith(
        "Step5 CSA tail ring layers.0.ring: a bound cache block of 8192 bytes (shape (8, 1, 512), "
        "torch.bfloat16) is not 9 or more whole 1024-byte rows"
    )
    with pytest.raises(ValueError, match=r"block of 19200 bytes \(shape \(32, 1, 300\), torch.bfloat16\) is not 9 "):
        ring.bind_kv_cache(torch.zeros(3, 32, 1, 300, dtype=torch.bfloat16))
    # Refused before the page is sized from it: 16 x 512 fp16 elements would pass for 16 KiB of bf16 rows.
    with pytest.raises(TypeError, match=r"^Step5 CSA tail ring layers.0.ring: kv_cache must be bfloat16, got torch.float16$"):
        ring.bind_kv_cache(torch.zeros(3, 16, 1, 512, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^Step5 CSA tail ring layers.0.ring: kv_cache must be \[num_blocks, ...\]"):
        ring.bind_kv_cache(torch.zeros(0, 16, 1, 512, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="^Step5 CSA tail ring layers.0.ring: kv_cache must be a torch.Tensor, got list$"):
        ring.bind_kv_cache([0.0])
    with pytest.raises(TypeError, match="must be bfloat16"):
        ring.bind_kv_cache(torch.zeros(3, 16, 1, 256))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        ring.bind_kv_cache([0.0])
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        ring.bind_kv_cache(torch.zeros(0, 16, 1, 512, dtype=torch.bfloat16))


def _ring_metadata(position, ring_base, summary_slot=None):
    n = len(position)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return CSARingMetadata(
        position=i32(position),
        chunk_start=i32([0] * n),
        chunk_len=i32([n] * n),
        ring_base=i32(ring_base),
        summary_slot=i32(summary_slot if summary_slot is not None else [-1] * n),
    )


def test_ring_metadata_lookup():
    context = {}
    _main_layer(context)
    ring = _ring(context)
    metadata = _ring_metadata([0], [0])
    assert ring.metadata({"layers.0.ring": metadata, "other": None}) is metadata
    with pytest.raises(ValueError, match="no entry for layer layers.0.ring"):
        ring.metadata({})
    with pytest.raises(TypeError, match="must be CSARingMetadata"):
        ring.metadata({"layers.0.ring": {}})
    with pytest.raises(TypeError, match="must be a mapping"):
        ring.metadata([metadata])


def test_ring_update_writes_rows_of_its_block_only():
    context = {}
    _main_layer(context)
    ring = _ring(context, k=0)
    buffer = torch.full((3 * 24 * 512,), -7.0, dtype=torch.bfloat16)
    ring.bind_kv_cache(buffer.as_strided((3, 16, 1, 512), (24 * 512, 512, 512, 1)))
    before = buffer.clone()
    index_k = torch.randn(4, 256).to(torch.bfloat16)
    index_z = torch.randn(4, 256).to(torch.bfloat16)
    summary_cache = torch.full((4, 256), 3.0, dtype=torch.bfloat16)
    # One request in block 1, positions 17..20 (17 % 16 = 1): rows 24 + 1 .. 24 + 4; no region closes.
    ring.update(index_k, index_z, summary_cache, _ring_metadata([17, 18, 19, 20], [24] * 4))
    expected = before.view(-1, 512).clone()
    expected[25:29] = torch.cat([index_k, index_z], dim=1)
    assert torch.equal(buffer.view(-1, 512), expected)
    assert torch.equal(summary_cache, torch.full((4, 256), 3.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("num_tokens, num_requests", [(0, 1), (3, 0), (0, 0)])
def test_ring_runs_an_empty_step(num_tokens, num_requests):
    """T = 0 and R = 0 through the owner's builder and update: nothing is written."""
    context = {}
    _main_layer(context)
    ring = _ring(context, k=0)
    buffer = torch.full((3 * 24 * 512,), -7.0, dtype=torch.bfloat16)
    ring.bind_kv_cache(buffer.as_strided((3, 16, 1, 512), (24 * 512, 512, 512, 1)))
    metadata = ring.metadata_builder(summary_block_size=4).build(
        query_start_loc=torch.zeros(num_requests + 1, dtype=torch.int32),
        seq_lens=torch.full((num_requests,), 9, dtype=torch.int32),
        ring_blocks=torch.zeros(num_requests, dtype=torch.int32),
        summary_block_table=torch.zeros(num_requests, 1, dtype=torch.int32),
        num_tokens=num_tokens,
    )
    summary_cache = torch.full((4, 256), 3.0, dtype=torch.bfloat16)
    index = torch.randn(num_tokens, 256).to(torch.bfloat16)
    ring.update(index, index, summary_cache, metadata, validate=True)
    assert bool((buffer == -7.0).all()) and bool((summary_cache == 3.0).all())


def test_ring_update_and_builder_need_a_bound_cache():
    context = {}
    _main_layer(context)
    ring = _ring(context)
    with pytest.raises(ValueError, match="has no cache bound yet"):
        ring.update(torch.zeros(1, 256), torch.zeros(1, 256), torch.zeros(1, 256), _ring_metadata([0], [0]))
    with pytest.raises(ValueError, match="has no cache bound yet"):
        ring.metadata_builder(summary_block_size=4)


def test_ring_metadata_builder_carries_rows_per_block():
    context = {}
    _main_layer(context)
    ring = _ring(context)
    buffer = torch.zeros(3 * 24 * 512, dtype=torch.bfloat16)
    ring.bind_kv_cache(buffer.as_strided((3, 16, 1, 512), (24 * 512, 512, 512, 1)))
    builder = ring.metadata_builder(summary_block_size=4)
    assert isinstance(builder, Step5CSATailRingMetadataBuilder)
    # Two requests, rings in blocks 2 and 0; request 0 has 3 new tokens at positions 5..7 (7 closes region 0,
    # summary slot block_table[0, 0] * 4 + 0 = 12), request 1 one token at position 0.
    metadata = builder.build(
        query_start_loc=torch.tensor([0, 3, 4]),
        seq_lens=torch.tensor([8, 1]),
        ring_blocks=torch.tensor([2, 0]),
        summary_block_table=torch.tensor([[3], [1]]),
        num_tokens=6,
    )
    assert metadata.ring_base.tolist() == [48, 48, 48, 0, -1, -1]
    assert metadata.position.tolist() == [5, 6, 7, 0, -1, -1]
    assert metadata.summary_slot.tolist() == [-1, -1, 12, -1, -1, -1]


def test_ring_backend():
    backend = _ring({}, main="x").get_attn_backend()
    assert backend is Step5CSATailRingBackend
    assert backend.get_name() == "STEP5_CSA_TAIL_RING"
    assert backend.indexes_kv_by_block_stride() is True
    assert backend.get_kv_cache_shape(5, 16, 1, 512) == (5, 16, 1, 512)
    assert backend.get_kv_cache_stride_order() == (0, 1, 2, 3)
    assert backend.get_kv_cache_stride_order(include_num_layers_dimension=True) == (0, 1, 2, 3, 4)
    assert backend.get_builder_cls() is Step5CSATailRingMetadataBuilder
    with pytest.raises(NotImplementedError, match="has no attention impl"):
        backend.get_impl_cls()


# ---------------------------------------------------------------------------------------------------------
# InklingConvState
# ---------------------------------------------------------------------------------------------------------


def _conv_state(context, tp_size=1, dtype=torch.bfloat16, prefix="layers.0.sconv", num_kv_heads=4):
    # head_dim 16, hidden 128 over 4 KV heads: hph = 32, packed 2*16 + 2*32 = 96 -> D = 128.
    return InklingConvState(
        num_kv_heads=num_kv_heads,
        head_dim=16,
        hidden_size=128,
        kernel_size=4,
        prefix=prefix,
        tp_size=tp_size,
        dtype=dtype,
        static_forward_context=context,
    )


def test_conv_state_geometry():
    context = {}
    conv = _conv_state(context, tp_size=2)
    assert context == {"layers.0.sconv": conv}
    assert conv.prefix == "layers.0.sconv"
    assert conv.num_kv_heads == 2  # per rank
    assert conv.head_size == 128
    assert conv.stream_ranges == ((0, 16), (16, 16), (32, 32), (64, 32))
    assert conv.sliding_window == conv.block_size == 4
    assert conv.kv_cache.numel() == 0
    assert conv.forward() is None
    assert conv.get_kv_cache_spec() == SlidingWindowSpec(
        block_size=4, num_kv_heads=2, head_size=128, head_size_v=0, dtype=torch.bfloat16, sliding_window=4
    )
    assert conv.get_kv_cache_spec().page_size_bytes == 2 * 4 * 128 * 2


def test_conv_state_guardrails_are_the_seeds_errors():
    context = {}
    with pytest.raises(ValueError) as info:
        _conv_state(context, tp_size=8)
    assert str(info.value) == "sconv SWA cache supports tp_size <= num_kv_heads (4), got 8"
    with pytest.raises(ValueError) as info:
        _conv_state(context, dtype=torch.float16)
    assert str(info.value) == "sconv SWA cache supports bfloat16 only, got torch.float16"
    assert context == {}  # rejected layers are not registered
    _conv_state(context)
    with pytest.raises(ValueError) as info:
        _conv_state(context)
    assert str(info.value) == "Duplicate layer name: layers.0.sconv"


def test_sconv_backend():
    backend = _conv_state({}).get_attn_backend()
    assert backend is InklingSconvBackend
    assert backend.get_name() == "INKLING_SCONV_SWA"
    assert backend.indexes_kv_by_block_stride() is True
    assert backend.get_kv_cache_shape(7, 32, 2, 128) == (7, 2, 32, 128)
    assert backend.get_kv_cache_shape(7, 32, 2, 128, cache_dtype_str="auto") == (7, 2, 32, 128)
    assert backend.get_kv_cache_stride_order() == (0, 1, 2, 3)
    assert backend.get_kv_cache_stride_order(include_num_layers_dimension=False) == (0, 1, 2, 3)
    assert backend.get_kv_cache_stride_order(include_num_layers_dimension=True) == (0, 1, 2, 3, 4)
    with pytest.raises(NotImplementedError) as info:
        backend.get_impl_cls()
    assert str(info.value) == "InklingSconvBackend has no attention impl; the conv runs out-of-band."
    assert backend.get_builder_cls() is InklingSconvMetadataBuilder


def test_sconv_metadata_builder_slots():
    # One request of 6 tokens at positions 0..5, blocks [5, 2] of N = 4: slots 20..23 then 8, 9.
    metadata = InklingSconvBackend.get_builder_cls()(4).build(
        query_start_loc=torch.tensor([0, 6]),
        seq_lens=torch.tensor([6]),
        block_table=torch.tensor([[5, 2]], dtype=torch.int32),
        num_tokens=8,
    )
    assert metadata.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, -1, -1]
    assert metadata.token_position.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]


def test_conv_state_bind_reads_n_from_the_cache():
    context = {}
    conv = _conv_state(context)
    with pytest.raises(ValueError, match="has no cache bound yet"):
        conv.metadata_builder()
    page = 4 * 32 * 128
    buffer = torch.zeros(3 * (page + 64), dtype=torch.bfloat16)
    cache = buffer.as_strided((3, 4, 32, 128), (page + 64, 32 * 128, 128, 1))
    conv.bind_kv_cache(cache)
    assert conv.kv_cache is cache
    assert conv.block_size == 4  # the declared block; the bound N is the cache's
    assert conv.metadata_builder().block_size == 32
    with pytest.raises(ValueError, match="^Inkling conv state layers.0.sconv: sconv SWA cache block size 2 is smaller than the kernel size 4"):
        conv.bind_kv_cache(torch.zeros(3, 4, 2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"must have H = 4 and D = 128"):
        conv.bind_kv_cache(torch.zeros(3, 4, 4, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["attention", "ring", "conv"])
def test_check_kv_cache_refuses_what_bind_refuses_and_binds_nothing(kind):
    """The allocator asks every owner's ``check_kv_cache`` before it binds any layer, so the check must refuse
    exactly what the bind would, with the same error, and leave the owner as it was."""
    context = {}
    main = _main_layer(context)  # 1 KB per token: a 16-token page holds 16 ring rows
    if kind == "attention":
        owner, good, bad = main, torch.zeros(3, 16, 1, 512, dtype=torch.bfloat16), torch.zeros(3, 16, 1, 512)
    elif kind == "ring":
        owner = _ring(context, k=2)
        good, bad = (torch.zeros(3, rows, 1, 512, dtype=torch.bfloat16) for rows in (16, 8))  # 8 < 7 + 2
    else:
        owner = _conv_state(context)
        good, bad = (torch.zeros(3, 4, n, 128, dtype=torch.bfloat16) for n in (8, 2))  # N = 2 < kernel 4
    before = dict(vars(owner))
    owner.check_kv_cache(good)
    with pytest.raises((ValueError, TypeError)) as checked:
        owner.check_kv_cache(bad)
    assert vars(owner).keys() == before.keys() and all(vars(owner)[k] is v for k, v in before.items())
    with pytest.raises(type(checked.value)) as bound:
        owner.bind_kv_cache(bad)
    assert str(bound.value) == str(checked.value)
    owner.bind_kv_cache(good)
    assert owner.kv_cache.data_ptr() == good.data_ptr()


@pytest.mark.parametrize("kind", ["attention", "conv"])  # the ring's: test_ring_bind_rejects_bad_caches_with_value_errors
def test_bind_refuses_a_cache_that_is_not_a_tensor(kind):
    owner = _main_layer({}) if kind == "attention" else _conv_state({})
    with pytest.raises(TypeError, match="kv_cache must be a torch.Tensor, got list"):
        owner.bind_kv_cache([[0.0]])


@pytest.mark.parametrize("context", [(), MappingProxyType({})], ids=["tuple", "read_only_mapping"])
def test_a_layer_registers_only_in_a_mutable_mapping(context):
    with pytest.raises(TypeError, match="static_forward_context must be a mutable mapping, got"):
        _main_layer(context)


def _dense_conv(x_seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x + sum_j w[:, j] * x[t - (W-1) + j]`` over a whole sequence ``[L, C]`` in fp32, taps before 0 zero."""
    width = weight.shape[1]
    x32 = x_seq.float()
    padded = F.pad(x32, (0, 0, width - 1, 0))
    acc = torch.zeros_like(x32)
    for j in range(width):
        acc = acc + weight.float()[:, j] * padded[j : j + x32.shape[0]]
    return (acc + x32).to(torch.bfloat16)


def test_conv_runs_one_stream_at_its_offset():
    context = {}
    conv = _conv_state(context)  # H = 4, V stream at [16, 32) of D = 128
    cache = torch.full((2, 4, 4, 128), -5.0, dtype=torch.bfloat16)
    conv.bind_kv_cache(cache)
    before = cache.clone()
    x = torch.randn(3, 4 * 16).to(torch.bfloat16)
    weight = torch.randn(4 * 16, 4).to(torch.bfloat16)
    block_table = torch.tensor([[1]], dtype=torch.int32)
    metadata = conv.metadata_builder().build(torch.tensor([0, 3]), torch.tensor([3]), block_table, 3)
    y = conv.conv(InklingStream.V, x, weight, block_table, metadata)
    assert torch.equal(y, _dense_conv(x, weight))
    expected = before.clone()
    expected[1, :, 0:3, 16:32] = x.view(3, 4, 16).transpose(0, 1)
    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match=r"K stream input must be \[T, 64\]"):
        conv.conv(InklingStream.K, x[:, :32], weight, block_table, metadata)
    with pytest.raises(TypeError, match="streams must be an InklingStream or a tuple of them, got 1"):
        conv.conv(1, x, weight, block_table, metadata)


def test_conv_runs_adjacent_streams_in_one_call_as_the_separate_calls():
    """K and V in one call (head h owns [k_h | v_h]): the outputs and cache bytes of a K call and a V call."""
    fused, separate = _conv_state({}), _conv_state({})  # H = 4, K at [0, 16), V at [16, 32) of D = 128
    for state in (fused, separate):
        state.bind_kv_cache(torch.full((2, 4, 4, 128), -5.0, dtype=torch.bfloat16))
    k, v = torch.randn(2, 3, 4, 16).to(torch.bfloat16)
    w_k, w_v = torch.randn(2, 4, 16, 4)
    block_table = torch.tensor([[1]], dtype=torch.int32)
    metadata = fused.metadata_builder().build(torch.tensor([0, 3]), torch.tensor([3]), block_table, 3)
    x_kv = torch.stack([k, v], 2).reshape(3, 4 * 32)  # per head: its 16 K channels, then its 16 V channels
    w_kv = torch.stack([w_k, w_v], 1).reshape(4 * 32, 4)
    y = fused.conv((InklingStream.K, InklingStream.V), x_kv, w_kv, block_table, metadata).view(3, 4, 2, 16)
    y_k = separate.conv(InklingStream.K, k.flatten(1), w_k.flatten(0, 1), block_table, metadata)
    y_v = separate.conv(InklingStream.V, v.flatten(1), w_v.flatten(0, 1), block_table, metadata)
    assert torch.equal(y[:, :, 0].flatten(1), y_k) and torch.equal(y[:, :, 1].flatten(1), y_v)
    assert torch.equal(fused.kv_cache, separate.kv_cache)
    with pytest.raises(ValueError, match=r"streams \['K', 'ATTN_OUT'\] are not adjacent"):
        fused.conv((InklingStream.K, InklingStream.ATTN_OUT), x_kv, w_kv, block_table, metadata)
    with pytest.raises(ValueError, match=r"K\+V stream input must be \[T, 128\]"):
        fused.conv((InklingStream.K, InklingStream.V), k.flatten(1), w_kv, block_table, metadata)


@pytest.mark.parametrize("num_tokens, num_requests", [(0, 1), (2, 0), (0, 0)])
def test_conv_runs_an_empty_step(num_tokens, num_requests):
    """T = 0 and R = 0 through the owner: an all-padding (or empty) step writes nothing, y is zeros."""
    conv = _conv_state({})
    cache = torch.full((2, 4, 4, 128), -5.0, dtype=torch.bfloat16)
    conv.bind_kv_cache(cache)
    block_table = torch.ones(num_requests, 1, dtype=torch.int32)
    qsl, seq_lens = torch.zeros(num_requests + 1, dtype=torch.int32), torch.full((num_requests,), 3, dtype=torch.int32)
    metadata = conv.metadata_builder().build(qsl, seq_lens, block_table, num_tokens)
    x, weight = torch.randn(num_tokens, 64).to(torch.bfloat16), torch.randn(64, 4).to(torch.bfloat16)
    y = conv.conv(InklingStream.K, x, weight, block_table, metadata, validate=True)
    assert y.shape == (num_tokens, 64) and not y.any()
    assert bool((cache == -5.0).all())


def test_conv_out_of_range_slot_raises_before_writing_naming_op_and_argument():
    conv = _conv_state({})
    cache = torch.full((2, 4, 4, 128), -5.0, dtype=torch.bfloat16)
    conv.bind_kv_cache(cache)
    block_table = torch.tensor([[1]], dtype=torch.int32)
    metadata = conv.metadata_builder().build(torch.tensor([0, 3]), torch.tensor([3]), block_table, 3)
    metadata = metadata._replace(slot_mapping=metadata.slot_mapping.clone().index_fill_(0, torch.tensor([2]), 8))
    x, weight = torch.randn(3, 64).to(torch.bfloat16), torch.randn(64, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"sconv: slot_mapping must be -1 or in \[0, 8\); got \[8\] at tokens \[2\]"):
        conv.conv(InklingStream.K, x, weight, block_table, metadata)
    assert bool((cache == -5.0).all())


def test_conv_needs_a_bound_cache():
    conv = _conv_state({})
    with pytest.raises(ValueError, match="has no cache bound yet"):
        conv.conv(InklingStream.K, torch.zeros(1, 64), torch.zeros(64, 4), torch.zeros(1, 1), None)


# ---------------------------------------------------------------------------------------------------------
# Under torch.compile(fullgraph=True): the owners' op calls trace without graph breaks and mutate in place
# ---------------------------------------------------------------------------------------------------------


def test_conv_compiles_fullgraph_on_a_strided_cache():
    context = {}
    conv = _conv_state(context)
    page = 4 * 4 * 128
    buffer = torch.zeros(3 * (page + 512), dtype=torch.bfloat16)
    conv.bind_kv_cache(buffer.as_strided((3, 4, 4, 128), (page + 512, 4 * 128, 128, 1)))
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)
    metadata = conv.metadata_builder().build(torch.tensor([0, 6]), torch.tensor([6]), block_table, 7)
    x = torch.randn(7, 4 * 32).to(torch.bfloat16)
    weight = torch.randn(4 * 32, 4).to(torch.bfloat16)

    def step(x):
        return conv.conv(InklingStream.ATTN_OUT, x, weight, block_table, metadata)

    eager = step(x)
    eager_buffer = buffer.clone()
    buffer.zero_()
    with torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, backend="inductor")(x)
    assert torch.equal(compiled, eager)
    assert torch.equal(buffer, eager_buffer)


def test_ring_update_compiles_fullgraph_on_a_strided_ring():
    context = {}
    _main_layer(context)
    ring = _ring(context, k=2)
    buffer = torch.zeros(3 * 24 * 512, dtype=torch.bfloat16)
    ring.bind_kv_cache(buffer.as_strided((3, 16, 1, 512), (24 * 512, 512, 512, 1)))
    metadata = ring.metadata_builder(summary_block_size=4).build(
        query_start_loc=torch.tensor([0, 10]),
        seq_lens=torch.tensor([10]),
        ring_blocks=torch.tensor([1]),
        summary_block_table=torch.tensor([[1]]),
        num_tokens=12,
    )
    index_k = torch.randn(12, 256).to(torch.bfloat16)
    index_z = torch.randn(12, 256).to(torch.bfloat16)
    summaries = torch.zeros(8, 256, dtype=torch.bfloat16)

    def step(index_k, index_z):
        ring.update(index_k, index_z, summaries, metadata)

    step(index_k, index_z)
    eager_summaries, eager_buffer = summaries.clone(), buffer.clone()
    assert eager_summaries[4].ne(0).all()  # position 7 closed region 0 into slot 1 * 4 + 0
    summaries.zero_()
    buffer.zero_()
    with torch.no_grad():
        torch.compile(step, fullgraph=True, backend="aot_eager")(index_k, index_z)
    assert torch.equal(summaries, eager_summaries)
    assert torch.equal(buffer, eager_buffer)
