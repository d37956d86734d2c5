"""Page unifier, allocator and binding; and the ops running on the caches the allocator makes.

The "done when" of the owners issue: a page-strided CSA tail ring and enlarged / page-strided Inkling conv
blocks, made by :func:`allocate_kv_caches`, give the same results as the ops on a plain contiguous cache
(and a dense recompute), and no byte of any buffer outside the written rows and slots changes. Both the
PyTorch kernel (through the op) and the Triton launcher (interpreter on CPU) run on the allocator's views.
"""

import pytest
import torch

from stepops.allocator import KVCaches, allocate_kv_caches, plan_kv_pages, unify_page_sizes
from stepops.layouts import InklingStream
from stepops.ops.csa_ring_update import csa_ring_update
from stepops.ops.csa_ring_update.triton_kernel import csa_ring_update_triton
from stepops.ops.sconv.triton_kernel import sconv_triton
from stepops.owners import InklingConvState, PagedAttentionBackend, PagedAttentionLayer, Step5CSATailRing
from stepops.specs import CircularBufferSpec, FullAttentionSpec, SlidingWindowSpec
from conftest import triton_device

BF16 = torch.bfloat16
POISON = 0x5A  # a byte pattern no kernel writes by accident


def _full(block_size, num_kv_heads, head_size, **kwargs):
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=BF16, **kwargs
    )


def _conv(block_size, num_kv_heads, head_size):
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=0,
        dtype=BF16,
        sliding_window=4,
    )


def _ring(page_rows):
    return CircularBufferSpec(
        block_size=16, num_kv_heads=1, head_size=page_rows * 32, head_size_v=0, dtype=BF16, block_stride_alignment=1024
    )


# ---------------------------------------------------------------------------------------------------------
# unify_page_sizes
# ---------------------------------------------------------------------------------------------------------


def test_equal_pages_are_kept():
    specs = {"attn": _full(16, 2, 64), "conv": _conv(4, 2, 512)}  # 8192 bytes each
    unified = unify_page_sizes(specs)
    assert unified.page_bytes == 8192
    assert unified.specs == specs


def test_attention_block_scales_to_the_conv_page():
    # The seed's intended case: conv page 4*4*512*2 = 16384, attention 16*2*128*2 = 8192 -> block 32.
    unified = unify_page_sizes({"attn": _full(16, 2, 64), "conv": _conv(4, 4, 512)})
    assert unified.page_bytes == 16384
    assert unified.specs["attn"] == _full(32, 2, 64)
    assert unified.specs["conv"] == _conv(4, 4, 512)
    assert not unified.is_padded("attn")


def test_conv_block_enlarges_next_to_a_larger_attention_page():
    # Conv page 4*2*128*2 = 2048, attention 16*4*128*2 = 16384: N = 4 * 8 = 32, the window stays 4.
    unified = unify_page_sizes({"attn": _full(16, 4, 64), "conv": _conv(4, 2, 128)})
    assert unified.page_bytes == 16384
    assert unified.specs["conv"].block_size == 32
    assert unified.specs["conv"].sliding_window == 4
    assert unified.specs["conv"].page_size_bytes == 16384


def test_a_page_that_does_not_divide_is_padded_when_strided():
    # Conv page 4*4*256*2 = 8192 does not divide 16*3*128*2 = 12288.
    specs = {"attn": _full(16, 3, 64), "conv": _conv(4, 4, 256)}
    unified = unify_page_sizes(specs, strided={"conv"})
    assert unified.page_bytes == 12288
    assert unified.specs["conv"] == specs["conv"]
    assert unified.is_padded("conv") and not unified.is_padded("attn")


def test_a_page_that_cannot_be_padded_is_an_error():
    with pytest.raises(ValueError, match="layer conv: its 8192-byte page does not divide the 12288-byte page"):
        unify_page_sizes({"attn": _full(16, 3, 64), "conv": _conv(4, 4, 256)})


def test_circular_buffers_pad_on_whole_rows():
    # A 16-row ring next to a 24 KB page: padded, 24576 is whole 1 KB rows.
    unified = unify_page_sizes({"ring": _ring(16), "big": _full(16, 3, 128)})
    assert unified.page_bytes == 24576 and unified.is_padded("ring")
    # 49 tokens * 256 * 2 = 25088 bytes: not whole 1 KB rows.
    with pytest.raises(ValueError) as info:
        unify_page_sizes({"ring": _ring(16), "big": _full(49, 1, 128)})
    assert str(info.value) == "layer ring: a padded block stride of 25088 bytes is not a multiple of its 1024-byte alignment"


def test_a_scaled_ring_keeps_its_alignment_too():
    """A 512-byte ring page divides a 1536-byte page, so it was scaled to a 1536-byte block stride, across
    which its 1024-byte rows are misaligned; padded, the same stride was refused. Both are refused now."""
    ring = CircularBufferSpec(block_size=1, num_kv_heads=1, head_size=256, head_size_v=0, dtype=BF16, block_stride_alignment=1024)
    with pytest.raises(ValueError, match="layer ring: a scaled block stride of 1536 bytes is not a multiple of its 1024-byte alignment"):
        unify_page_sizes({"ring": ring, "big": _full(3, 1, 128)})
    assert unify_page_sizes({"ring": ring, "big": _full(4, 1, 128)}).specs["ring"].page_size_bytes == 2048


def test_padding_keeps_whole_elements():
    odd = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=2049, head_size_v=0, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block stride of 2049 bytes is not a multiple of its 2-byte alignment"):
        unify_page_sizes({"odd": odd, "attn": _full(4, 2, 64)}, strided={"attn"})


def test_unify_rejects_empty_and_foreign_specs():
    with pytest.raises(ValueError, match="at least one layer spec"):
        unify_page_sizes({})
    with pytest.raises(TypeError, match="spec of layer x must be an AttentionSpec, got dict"):
        unify_page_sizes({"x": {}})
    # A string is a collection of characters: "layers.1" in "layers.10" let layers.1 be padded.
    with pytest.raises(TypeError, match="strided must be a collection of layer names, got 'layers.10'"):
        unify_page_sizes({"layers.1": _full(4, 2, 64)}, strided="layers.10")
    # each passed while no layer needed padding
    with pytest.raises(TypeError, match="strided must be a collection of layer names, got None"):
        unify_page_sizes({"layers.1": _full(4, 2, 64)}, strided=None)
    with pytest.raises(TypeError, match="specs must be a mapping of layer name to AttentionSpec, got list"):
        unify_page_sizes([_full(4, 2, 64)])  # an AttributeError on .items()
    with pytest.raises(ValueError, match=r"no layer 'ring' among the unified layers \['attn'\]"):  # a KeyError
        unify_page_sizes({"attn": _full(4, 2, 64)}).is_padded("ring")


# ---------------------------------------------------------------------------------------------------------
# allocate_kv_caches: shapes, strides, one buffer per layer, binding
# ---------------------------------------------------------------------------------------------------------


def _inkling_context(attention_heads):
    # Conv: H = 2, head_dim 32, hidden 64 -> hph 32, D = 128; page 2*4*128*2 = 2048 bytes at N = W = 4.
    context = {}
    attn = PagedAttentionLayer(
        prefix="layers.0.attn",
        num_kv_heads=attention_heads,
        head_size=64,
        block_size=16,
        static_forward_context=context,
    )
    conv = InklingConvState(
        num_kv_heads=2,
        head_dim=32,
        hidden_size=64,
        kernel_size=4,
        prefix="layers.0.sconv",
        static_forward_context=context,
    )
    return context, attn, conv


def test_allocator_enlarges_conv_blocks_and_binds_every_owner():
    context, attn, conv = _inkling_context(attention_heads=4)  # attention page 16*4*128*2 = 16384
    caches = allocate_kv_caches(context, num_blocks=3)
    assert isinstance(caches, KVCaches)
    assert (caches.page_bytes, caches.num_blocks) == (16384, 3)
    assert caches.specs["layers.0.sconv"].block_size == 32
    assert conv.kv_cache.shape == (3, 2, 32, 128) and conv.kv_cache.stride() == (8192, 4096, 128, 1)
    assert attn.kv_cache.shape == (3, 16, 4, 128) and attn.kv_cache.stride() == (8192, 512, 128, 1)
    assert caches.kv_caches == {"layers.0.attn": attn.kv_cache, "layers.0.sconv": conv.kv_cache}
    assert conv.metadata_builder().block_size == 32
    for layer in caches.layers.values():
        assert layer.buffer.dtype == torch.uint8 and layer.buffer.numel() == 3 * 16384
        assert layer.kv_cache.untyped_storage().data_ptr() == layer.buffer.untyped_storage().data_ptr()
        assert not layer.buffer.any()
    # Each layer has its own base (a shared base makes Inductor clone it).
    pointers = {layer.buffer.untyped_storage().data_ptr() for layer in caches.layers.values()}
    assert len(pointers) == 2


def test_allocator_pads_conv_pages_with_a_wider_stride():
    # Attention page 16*3*128*2 = 12288; a 4-head conv of D = 256 (hidden 256 over 4 heads -> hph 64,
    # 2*32 + 2*64 = 192 -> 256) has an 8192-byte page, which does not divide it.
    context = {}
    PagedAttentionLayer(prefix="attn", num_kv_heads=3, head_size=64, block_size=16, static_forward_context=context)
    conv = InklingConvState(
        num_kv_heads=4, head_dim=32, hidden_size=256, kernel_size=4, prefix="sconv", static_forward_context=context
    )
    caches = allocate_kv_caches(context, num_blocks=2)
    assert caches.page_bytes == 12288
    assert conv.kv_cache.shape == (2, 4, 4, 256)
    assert conv.kv_cache.stride() == (6144, 1024, 256, 1)  # 12288 bytes between blocks, 8192 used


def test_allocator_strides_the_ring_wider_than_its_page():
    context = {}
    main = PagedAttentionLayer(
        prefix="attn", num_kv_heads=1, head_size=256, block_size=16, static_forward_context=context
    )
    ring = Step5CSATailRing(
        prefix="ring", main_layer_name="attn", num_speculative_tokens=2, static_forward_context=context
    )
    PagedAttentionLayer(prefix="big", num_kv_heads=3, head_size=128, block_size=16, static_forward_context=context)
    caches = allocate_kv_caches(context, num_blocks=3)
    assert caches.page_bytes == 24576
    assert (ring.capacity, ring.rows_per_block) == (16, 24)
    assert ring.rows.shape == (2 * 24 + 16, 512)
    assert main.kv_cache.stride(0) == 12288
    assert caches.specs["ring"].page_size_bytes == 16384


def test_allocator_errors():
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        allocate_kv_caches({}, 0)
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        allocate_kv_caches({}, 2.0)
    with pytest.raises(TypeError, match="num_blocks must be an int, got InklingStream"):
        allocate_kv_caches({}, InklingStream.V)  # an IntEnum member was taken as 1 block
    with pytest.raises(ValueError, match="no layer with get_kv_cache_spec"):
        allocate_kv_caches({"mlp": object()}, 2)

    class SpecOnly:
        def get_kv_cache_spec(self):
            return _full(16, 1, 64)

    with pytest.raises(TypeError, match="layer x has get_kv_cache_spec\\(\\) but no get_attn_backend\\(\\)"):
        allocate_kv_caches({"x": SpecOnly()}, 2)


def test_allocator_checks_the_backend_shape():
    class Backend:
        order = (0, 1, 2, 3)
        shape = None

        @staticmethod
        def get_name():
            return "TEST"

        @staticmethod
        def indexes_kv_by_block_stride():
            return False

        @classmethod
        def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            return cls.shape or (num_blocks, block_size, num_kv_heads, head_size)

        @classmethod
        def get_kv_cache_stride_order(cls, include_num_layers_dimension=False):
            return cls.order

    class Owner:
        def get_kv_cache_spec(self):
            return _full(16, 1, 64)

        def get_attn_backend(self):
            return Backend

        def bind_kv_cache(self, kv_cache):
            self.kv_cache = kv_cache

    Backend.order = (0, 2, 1, 3)
    with pytest.raises(ValueError, match=r"TEST: only identity stride orders are supported .* got \(0, 2, 1, 3\)"):
        allocate_kv_caches({"x": Owner()}, 2)
    Backend.order, Backend.shape = (0, 1, 2, 3), (2, 16, 1, 64)
    with pytest.raises(ValueError, match=r"TEST: cache shape \(2, 16, 1, 64\) is not 2 blocks of one 4096-byte page"):
        allocate_kv_caches({"x": Owner()}, 2)
    # Every view is made before any layer binds: a bad shape in a later layer leaves the earlier one (whose
    # backend is good) unbound (it was bound to a buffer of the allocation that failed).
    class GoodBackend(Backend):
        shape = None

    class GoodOwner(Owner):
        def get_attn_backend(self):
            return GoodBackend

    allocate_kv_caches({"good": GoodOwner()}, 2)
    first = GoodOwner()
    with pytest.raises(ValueError, match=r"TEST: cache shape"):
        allocate_kv_caches({"first": first, "x": Owner()}, 2)
    assert not hasattr(first, "kv_cache")


def test_allocator_reads_a_backend_as_vllm_does_and_names_what_it_lacks():
    """A vLLM-style backend has no indexes_kv_by_block_stride() and may leave get_kv_cache_stride_order() to
    the base class, which raises NotImplementedError (vLLM then takes the identity order): an
    AttributeError and an empty NotImplementedError before. A backend without get_kv_cache_shape() is named
    with its layer, and a shape of negative sizes whose product fits the page is refused."""

    class VllmLike:
        shape = None

        @classmethod
        def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            return cls.shape or (num_blocks, block_size, num_kv_heads, head_size)

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            raise NotImplementedError

    class Owner:
        backend = VllmLike

        def get_kv_cache_spec(self):
            return _full(16, 1, 64)

        def get_attn_backend(self):
            return self.backend

        def bind_kv_cache(self, kv_cache):
            self.kv_cache = kv_cache

    owner = Owner()
    allocate_kv_caches({"x": owner}, 2)
    assert owner.kv_cache.shape == (2, 16, 1, 128) and owner.kv_cache.is_contiguous()  # K and V packed

    class Larger(Owner):  # a 6144-byte page, which x's 4096 bytes do not divide
        def get_kv_cache_spec(self):
            return _full(16, 1, 96)

    # Without the declaration x's blocks may only be scaled, never padded (vLLM reads it so).
    with pytest.raises(ValueError, match="layer x: its 4096-byte page does not divide .* neither scaled nor padded"):
        allocate_kv_caches({"x": Owner(), "larger": Larger()}, 2)
    VllmLike.shape = (2, -16, 1, -128)  # -> as_strided's "Negative strides are not supported"
    with pytest.raises(ValueError, match=r"VllmLike: cache shape \(2, -16, 1, -128\) must be positive ints"):
        allocate_kv_caches({"x": Owner()}, 2)
    Owner.backend = object()
    with pytest.raises(TypeError, match="layer x: its backend object has no get_kv_cache_shape"):
        allocate_kv_caches({"x": Owner()}, 2)


def test_a_view_an_owner_refuses_leaves_every_layer_with_the_cache_it_had():
    """Every owner checks its view (``check_kv_cache``) before any layer is bound: the last layer's refusal,
    by its own bind check, leaves the layers before it bound to their earlier caches, not to buffers of an
    allocation that failed."""

    class FlatBackend(PagedAttentionBackend):
        @classmethod
        def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            return (num_blocks, block_size * num_kv_heads, 1, head_size)  # the page's bytes, one head

    class FlatAttentionLayer(PagedAttentionLayer):
        def get_attn_backend(self):
            return FlatBackend

    context, attn, conv = _inkling_context(attention_heads=4)
    allocate_kv_caches(context, num_blocks=3)
    bound = {name: layer.kv_cache for name, layer in context.items()}
    FlatAttentionLayer(prefix="layers.1.attn", num_kv_heads=2, head_size=64, block_size=16, static_forward_context=context)
    with pytest.raises(ValueError, match=r"^layers.1.attn: kv_cache must be \[num_blocks, N, 2, 128\] .* got shape \(3, 64, 1, 128\)$"):
        allocate_kv_caches(context, num_blocks=3)
    for name, cache in bound.items():
        assert context[name].kv_cache is cache
    assert context["layers.1.attn"].kv_cache.numel() == 0


@pytest.mark.parametrize("model", ["inkling", "step5"])
def test_the_plan_is_what_the_allocator_gives_and_allocates_nothing(model):
    """``plan_kv_pages`` of a model built on the meta device (how ``python -m stepops plan`` sizes a
    checkpoint) gives the page and every layer's spec that ``allocate_caches`` binds on CPU, and the model
    keeps its unbound placeholders."""
    from stepops.models.inkling import InklingConfig, InklingModel
    from stepops.models.step5 import Step5Model

    build = (lambda: InklingModel(InklingConfig())) if model == "inkling" else Step5Model
    with torch.device("meta"):
        planned_model = build()
    placeholders = {name: owner.kv_cache for name, owner in planned_model.static_forward_context.items()}
    plan = plan_kv_pages(planned_model.static_forward_context)
    allocated = build()
    caches = allocated.allocate_caches(2, device="cpu") if model == "inkling" else allocated.allocate_caches(2, 1, "cpu")
    assert plan.page_bytes == caches.page_bytes
    assert plan.specs == caches.specs
    assert all(owner.kv_cache is placeholders[name] for name, owner in planned_model.static_forward_context.items())


def test_plan_refuses_what_the_allocator_refuses():
    with pytest.raises(TypeError, match="static_forward_context must be a mapping of layer name to layer, got list"):
        plan_kv_pages([1, 2])
    with pytest.raises(ValueError, match="no layer with get_kv_cache_spec"):
        plan_kv_pages({"mlp": object()})


def test_allocator_refuses_what_is_not_a_context_and_sizes_past_int64():
    """Before: AttributeError (no .items()), and a TypeError from inside torch for the buffer size."""
    with pytest.raises(TypeError, match="static_forward_context must be a mapping of layer name to layer, got list"):
        allocate_kv_caches([1, 2], 1)
    context, _, _ = _inkling_context(attention_heads=1)
    with pytest.raises(ValueError, match=r"num_blocks \* page bytes \(1152921504606846976 x 4096\) = .* does not fit in int64"):
        allocate_kv_caches(context, 2**60)


# ---------------------------------------------------------------------------------------------------------
# The ops on the allocator's caches
# ---------------------------------------------------------------------------------------------------------


def _poison(caches: KVCaches) -> dict[str, torch.Tensor]:
    for layer in caches.layers.values():
        layer.buffer.fill_(POISON)
    return {name: layer.buffer.clone() for name, layer in caches.layers.items()}


def _step5_model(device):
    context = {}
    PagedAttentionLayer(prefix="attn", num_kv_heads=1, head_size=256, block_size=16, static_forward_context=context)
    ring = Step5CSATailRing(
        prefix="ring", main_layer_name="attn", num_speculative_tokens=2, static_forward_context=context
    )
    PagedAttentionLayer(prefix="big", num_kv_heads=3, head_size=128, block_size=16, static_forward_context=context)
    return ring, allocate_kv_caches(context, num_blocks=3, device=device)


# Two requests (ring blocks 2 and 0) over three steps: prefill, then verify-sized chunks (k + 1 = 3). Request 0
# closes regions at 7 and 15; request 1 at 7, where the step's first position (5) replays rows 0..4 from the ring.
_RING_STEPS = [((10, 5), (10, 5)), ((3, 3), (13, 8)), ((3, 3), (16, 11))]


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_csa_ring_update_on_a_page_strided_ring(kernel):
    device = torch.device("cpu") if kernel == "torch" else triton_device()
    ring, caches = _step5_model(device)
    assert (ring.capacity, ring.rows_per_block) == (16, 24)
    before = _poison(caches)
    plain = torch.full((3 * 16, 512), -3.0, dtype=BF16, device=device)  # contiguous: 16 rows per block
    summaries = torch.zeros(8, 256, dtype=BF16, device=device)
    plain_summaries = summaries.clone()
    ring_blocks = torch.tensor([2, 0], device=device)
    summary_block_table = torch.tensor([[1], [0]], device=device)
    strided_builder = ring.metadata_builder(summary_block_size=4)
    plain_builder = type(strided_builder)(16, 4)
    history = [[], []]
    for (len0, len1), seq_lens in _RING_STEPS:
        index_k = torch.randn(len0 + len1 + 2, 256, device=device).to(BF16)  # + 2 padding tokens
        index_z = torch.randn(len0 + len1 + 2, 256, device=device).to(BF16)
        history[0] += [(index_k[t], index_z[t]) for t in range(len0)]
        history[1] += [(index_k[t], index_z[t]) for t in range(len0, len0 + len1)]
        step = dict(
            query_start_loc=torch.tensor([0, len0, len0 + len1], device=device),
            seq_lens=torch.tensor(seq_lens, device=device),
            ring_blocks=ring_blocks,
            summary_block_table=summary_block_table,
            num_tokens=len0 + len1 + 2,
        )
        metadata = strided_builder.build(**step)
        plain_metadata = plain_builder.build(**step)
        if kernel == "torch":
            ring.update(index_k, index_z, summaries, metadata, validate=True)
        else:
            csa_ring_update_triton(index_k, index_z, ring.rows, summaries, *metadata, ring.capacity)
        csa_ring_update(index_k, index_z, plain, plain_summaries, plain_metadata, 16)

    assert torch.equal(summaries, plain_summaries)
    assert summaries[[4, 5, 0]].ne(0).all(dim=1).all()  # both of request 0's regions and request 1's region 0
    # Each ring holds its request's last 16 positions' rows (as the plain cache does); the gap rows between
    # rings, the unused rows and the other layers' buffers keep their poison.
    expected = before["ring"].clone().view(BF16).view(-1, 512)
    for request, block in enumerate((2, 0)):
        rows = history[request]
        for position in range(max(0, len(rows) - 16), len(rows)):
            row = torch.cat(rows[position])
            expected[24 * block + position % 16] = row
            assert torch.equal(plain[16 * block + position % 16], row)
    assert torch.equal(caches.layers["ring"].buffer, expected.view(-1).view(torch.uint8))
    for name in ("attn", "big"):
        assert torch.equal(caches.layers[name].buffer, before[name])


def _dense_conv(x_seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x + sum_j w[:, j] * x[t - (W-1) + j]`` over a whole sequence ``[L, C]`` in fp32, taps before 0 zero."""
    width = weight.shape[1]
    x32 = x_seq.float()
    padded = torch.cat([torch.zeros(width - 1, x32.shape[1], dtype=torch.float32, device=x32.device), x32])
    acc = torch.zeros_like(x32)
    for j in range(width):
        acc = acc + weight.float()[:, j] * padded[j : j + x32.shape[0]]
    return (acc + x32).to(BF16)


def _inkling_model(case, device):
    context = {}
    if case == "enlarged":  # 16 KB attention page: conv N = 32
        PagedAttentionLayer(prefix="attn", num_kv_heads=4, head_size=64, block_size=16, static_forward_context=context)
        conv = InklingConvState(
            num_kv_heads=2, head_dim=32, hidden_size=64, kernel_size=4, prefix="sconv", static_forward_context=context
        )
    else:  # 12 KB attention page, 8 KB conv page: padded, N = 4
        PagedAttentionLayer(prefix="attn", num_kv_heads=3, head_size=64, block_size=16, static_forward_context=context)
        conv = InklingConvState(
            num_kv_heads=4, head_dim=32, hidden_size=256, kernel_size=4, prefix="sconv", static_forward_context=context
        )
    return conv, allocate_kv_caches(context, num_blocks=6, device=device)


# Two requests: prefill 5 and 3 tokens, decode 1 each, verify 3 each (seq lens after each step).
_CONV_STEPS = [((5, 3), (5, 3)), ((1, 1), (6, 4)), ((3, 3), (9, 7))]


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("case", ["enlarged", "padded"])
def test_sconv_on_allocated_caches(case, kernel):
    device = torch.device("cpu") if kernel == "torch" else triton_device()
    conv, caches = _inkling_model(case, device)
    block_size = conv.kv_cache.shape[2]
    assert block_size == (32 if case == "enlarged" else 4)
    assert (caches.layers["sconv"].spec.page_size_bytes < caches.page_bytes) == (case == "padded")
    before = _poison(caches)
    heads = conv.num_kv_heads
    # Blocks out of order, with request 1's blocks interleaved with request 0's.
    block_table = torch.tensor([[4, 1, 5], [0, 3, 2]], dtype=torch.int32, device=device)
    streams = (InklingStream.K, InklingStream.MLP_OUT)
    weights = {s: torch.randn(heads * conv.stream_ranges[s][1], 4, device=device).to(BF16) for s in streams}
    history = {s: [[], []] for s in streams}
    builder = conv.metadata_builder()
    for (len0, len1), seq_lens in _CONV_STEPS:
        metadata = builder.build(
            torch.tensor([0, len0, len0 + len1], device=device),
            torch.tensor(seq_lens, device=device),
            block_table,
            len0 + len1 + 1,
        )
        for stream in streams:
            width = conv.stream_ranges[stream][1]
            x = torch.randn(len0 + len1 + 1, heads * width, device=device).to(BF16)
            if kernel == "torch":
                y = conv.conv(stream, x, weights[stream], block_table, metadata, validate=True)
            else:
                offset = conv.stream_ranges[stream][0]
                y = sconv_triton(x, weights[stream], conv.kv_cache, block_table, *metadata, offset)
            history[stream][0].append(x[:len0])
            history[stream][1].append(x[len0 : len0 + len1])
            for request, (start, length) in enumerate(((0, len0), (len0, len1))):
                sequence = torch.cat(history[stream][request])
                dense = _dense_conv(sequence, weights[stream])[-length:]
                assert torch.equal(y[start : start + length], dense), (stream, request)
            assert not y[len0 + len1 :].any()  # the padding row

    # Every stored input sits at its slot and stream range; every other byte of the buffer is untouched.
    expected_buffer = before["sconv"].clone()
    expected = expected_buffer.view(BF16).as_strided(conv.kv_cache.shape, conv.kv_cache.stride())
    for stream in streams:
        offset, width = conv.stream_ranges[stream]
        for request in range(2):
            sequence = torch.cat(history[stream][request]).view(-1, heads, width)
            for position in range(sequence.shape[0]):
                block = block_table[request, position // block_size]
                expected[block, :, position % block_size, offset : offset + width] = sequence[position]
    assert torch.equal(caches.layers["sconv"].buffer, expected_buffer)
    assert torch.equal(caches.layers["attn"].buffer, before["attn"])
