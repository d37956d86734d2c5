"""From specs to bound caches: the page unifier, the allocator and the binding.

A hybrid model's layers ask for pages of different sizes (an Inkling conv-state page, an attention page,
a Step5 CSA tail ring sized to its main layer's page). A paged cache manager hands out blocks of one size,
so :func:`unify_page_sizes` makes every layer's page the size of the largest one (``page_bytes``):

- a page that divides ``page_bytes`` is scaled: the layer's ``block_size`` is multiplied by the ratio (an
  attention layer holds more tokens per block; an Inkling conv state gets ``N > W``, e.g. ``W = 4`` becomes
  ``N = 32`` next to a page eight times larger);
- a page that does not divide it is padded: the layer keeps its spec, and its blocks are ``page_bytes``
  apart, wider than its page. Only layers that index blocks through the block stride may be padded (the
  backend's ``indexes_kv_by_block_stride()``, and every :class:`CircularBufferSpec`), and the stride must
  be a whole number of the layer's elements and of a ring's ``block_stride_alignment``.

:func:`allocate_kv_caches` then gives every layer its own buffer of ``num_blocks * page_bytes`` bytes (one
base per layer: a base shared by layers makes Inductor clone it), shapes the backend's view of it with
``stride(0) = page_bytes`` and binds it to the layer's owner. See ``docs/caches.md``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stepops.specs import AttentionSpec, CircularBufferSpec, check_int, is_int


@dataclass(frozen=True)
class UnifiedPages:
    """Every layer's spec after unification; each layer's blocks are ``page_bytes`` apart.

    ``specs[name].page_size_bytes`` is ``page_bytes`` for scaled layers and smaller for padded ones.
    """

    page_bytes: int
    specs: dict[str, AttentionSpec]

    def is_padded(self, layer_name: str) -> bool:
        """Whether the layer's page is smaller than its block stride."""
        if layer_name not in self.specs:
            raise ValueError(f"no layer {layer_name!r} among the unified layers {sorted(self.specs)}")
        return self.specs[layer_name].page_size_bytes < self.page_bytes


def unify_page_sizes(specs: Mapping[str, AttentionSpec], *, strided: Collection[str] = ()) -> UnifiedPages:
    """Give every layer in ``specs`` (layer name -> spec) the same block stride, the largest page.

    ``strided`` names the layers whose backend reads blocks through the block stride (so they may be
    padded); :class:`CircularBufferSpec` layers may always be padded. Raises ``ValueError`` when a page
    neither divides the largest page nor may be padded, or when the padded stride breaks the layer's
    alignment. A ring's block stride is a multiple of its ``block_stride_alignment`` whether scaled or
    padded: its rows are addressed across blocks.
    """
    if not isinstance(specs, Mapping):
        raise TypeError(f"specs must be a mapping of layer name to AttentionSpec, got {type(specs).__name__}")
    if not specs:
        raise ValueError("unify_page_sizes needs at least one layer spec")
    # `name in "layers.10"` would be true for "layers.1"; None failed only once a layer needed padding
    if isinstance(strided, str) or not isinstance(strided, Collection):
        raise TypeError(f"strided must be a collection of layer names, got {strided!r}")
    for name, spec in specs.items():
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec of layer {name} must be an AttentionSpec, got {type(spec).__name__}")
    page_bytes = max(spec.page_size_bytes for spec in specs.values())
    unified: dict[str, AttentionSpec] = {}
    for name, spec in specs.items():
        size = spec.page_size_bytes
        scaled = page_bytes % size == 0
        if not (scaled or isinstance(spec, CircularBufferSpec) or name in strided):
            raise ValueError(
                f"layer {name}: its {size}-byte page does not divide the {page_bytes}-byte page of the largest "
                "layer, and its backend does not index blocks by stride, so it can be neither scaled nor padded"
            )
        # A scaled page is a whole number of the layer's elements; a ring's alignment holds either way.
        alignment = spec.dtype.itemsize
        if isinstance(spec, CircularBufferSpec):
            alignment = math.lcm(alignment, spec.block_stride_alignment)
        if page_bytes % alignment:
            raise ValueError(
                f"layer {name}: a {'scaled' if scaled else 'padded'} block stride of {page_bytes} bytes is not a "
                f"multiple of its {alignment}-byte alignment"
            )
        unified[name] = spec.with_block_size(spec.block_size * (page_bytes // size)) if scaled else spec
    return UnifiedPages(page_bytes=page_bytes, specs=unified)


@dataclass(frozen=True)
class LayerKVCache:
    """One layer's cache: its unified spec, its own byte buffer and the view bound to its owner."""

    spec: AttentionSpec
    buffer: torch.Tensor  # uint8 [num_blocks * page_bytes]: the layer's whole allocation
    kv_cache: torch.Tensor  # the backend's shape over ``buffer``; block b starts at byte b * page_bytes


@dataclass(frozen=True)
class KVCaches:
    """What :func:`allocate_kv_caches` made: ``num_blocks`` blocks of ``page_bytes`` for every layer."""

    page_bytes: int
    num_blocks: int
    layers: dict[str, LayerKVCache]

    @property
    def specs(self) -> dict[str, AttentionSpec]:
        """Layer name -> spec after unification."""
        return {name: layer.spec for name, layer in self.layers.items()}

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        """Layer name -> the view bound to the layer's owner."""
        return {name: layer.kv_cache for name, layer in self.layers.items()}


def _optional(backend: Any, method: str, default: Any) -> Any:
    """``backend.method()``, or ``default`` for a backend without it or whose method raises
    ``NotImplementedError`` (as vLLM's base class does for the optional ones, and as vLLM reads them)."""
    call = getattr(backend, method, None)
    if not callable(call):
        return default
    try:
        return call()
    except NotImplementedError:
        return default


def _backend_name(backend: Any) -> str:
    """The backend's ``get_name()``, else its class's name (it only names errors)."""
    return _optional(backend, "get_name", getattr(backend, "__name__", type(backend).__name__))


def _cache_view(
    buffer: torch.Tensor, spec: AttentionSpec, backend: Any, num_blocks: int, page_bytes: int
) -> torch.Tensor:
    # The backend's logical shape with the packed K + V width as head_size (head_size_v = 0 for packed
    # layers), contiguous inside a block, blocks page_bytes apart.
    shape = tuple(
        backend.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size + spec.head_size_v)
    )
    if not all(is_int(size) and size >= 1 for size in shape):
        raise ValueError(f"{_backend_name(backend)}: cache shape {shape} must be positive ints")
    order = tuple(_optional(backend, "get_kv_cache_stride_order", range(len(shape))))
    if order != tuple(range(len(shape))):
        raise ValueError(
            f"{_backend_name(backend)}: only identity stride orders are supported (blocks outermost), got {order}"
        )
    itemsize = spec.dtype.itemsize
    if shape[0] != num_blocks or math.prod(shape[1:]) * itemsize != spec.page_size_bytes:
        raise ValueError(
            f"{_backend_name(backend)}: cache shape {shape} is not {num_blocks} blocks of one "
            f"{spec.page_size_bytes}-byte page"
        )
    inner = [1]
    for size in reversed(shape[2:]):
        inner.insert(0, inner[0] * size)
    return buffer.view(spec.dtype).as_strided(shape, (page_bytes // itemsize, *inner))


def _cache_owners(static_forward_context: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The context's layers that own a cache (those with ``get_kv_cache_spec()``) and their backends, by
    layer name; ``ValueError``/``TypeError`` for a context without one, an owner without ``get_attn_backend()``
    or ``bind_kv_cache()``, or a backend without ``get_kv_cache_shape()``."""
    if not isinstance(static_forward_context, Mapping):
        raise TypeError(
            f"static_forward_context must be a mapping of layer name to layer, got {type(static_forward_context).__name__}"
        )
    owners = {
        name: layer
        for name, layer in static_forward_context.items()
        if callable(getattr(layer, "get_kv_cache_spec", None))
    }
    if not owners:
        raise ValueError("the forward context has no layer with get_kv_cache_spec()")
    for name, owner in owners.items():
        for method in ("get_attn_backend", "bind_kv_cache"):
            if not callable(getattr(owner, method, None)):
                raise TypeError(f"layer {name} has get_kv_cache_spec() but no {method}()")
    backends = {name: owner.get_attn_backend() for name, owner in owners.items()}
    for name, backend in backends.items():
        if not callable(getattr(backend, "get_kv_cache_shape", None)):
            raise TypeError(f"layer {name}: its backend {_backend_name(backend)} has no get_kv_cache_shape()")
    return owners, backends


def _unified_pages(owners: Mapping[str, Any], backends: Mapping[str, Any]) -> UnifiedPages:
    return unify_page_sizes(
        {name: owner.get_kv_cache_spec() for name, owner in owners.items()},
        # Without the declaration a backend's blocks are only ever scaled, never padded.
        strided=[name for name, b in backends.items() if _optional(b, "indexes_kv_by_block_stride", False)],
    )


def plan_kv_pages(static_forward_context: Mapping[str, Any]) -> UnifiedPages:
    """The pages :func:`allocate_kv_caches` gives the context's cache layers, allocating and binding nothing:
    each layer's spec after unification and the common block stride ``page_bytes`` (every cache layer then
    takes ``num_blocks * page_bytes`` bytes). Build the model on the meta device to plan a deployment."""
    return _unified_pages(*_cache_owners(static_forward_context))


def allocate_kv_caches(
    static_forward_context: Mapping[str, Any], num_blocks: int, *, device: torch.device | str | None = None
) -> KVCaches:
    """Allocate and bind the cache of every layer in the forward context that has ``get_kv_cache_spec()``.

    Asks each such layer (an owner from :mod:`stepops.owners`) for its spec and backend, unifies the page
    sizes (:func:`unify_page_sizes`, padding allowed where ``backend.indexes_kv_by_block_stride()``; a
    backend without it, or without ``get_kv_cache_stride_order()``, is read as vLLM reads one: not padded,
    identity order),
    allocates a zeroed ``uint8 [num_blocks * page_bytes]`` buffer per layer on ``device``, views it as
    ``backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size + head_size_v)`` with
    ``stride(0) = page_bytes / itemsize`` and calls the owner's ``bind_kv_cache``. Every view is made, and
    given to the ``check_kv_cache`` of every owner that has one (each stepops owner does), before any layer
    is bound: a backend shape that does not fit its page, or a view an owner refuses, binds nothing and
    leaves every layer with the cache it had. Layers are then bound in the context's order.
    """
    check_int("num_blocks", num_blocks, 1)
    owners, backends = _cache_owners(static_forward_context)
    unified = _unified_pages(owners, backends)
    page_bytes = unified.page_bytes
    check_int(f"num_blocks * page bytes ({num_blocks} x {page_bytes})", num_blocks * page_bytes, 1)
    layers: dict[str, LayerKVCache] = {}
    for name in owners:
        spec = unified.specs[name]
        buffer = torch.zeros(num_blocks * page_bytes, dtype=torch.uint8, device=device)
        kv_cache = _cache_view(buffer, spec, backends[name], num_blocks, page_bytes)
        layers[name] = LayerKVCache(spec=spec, buffer=buffer, kv_cache=kv_cache)
    for name, owner in owners.items():
        check = getattr(owner, "check_kv_cache", None)
        if callable(check):
            check(layers[name].kv_cache)
    for name, owner in owners.items():
        owner.bind_kv_cache(layers[name].kv_cache)
    return KVCaches(page_bytes=page_bytes, num_blocks=num_blocks, layers=layers)
