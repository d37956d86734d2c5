"""Per-step metadata of the decoder layers, built on the device from fixed-size buffers (no host sync).

The runner fills :class:`StepBuffers` on the host side of each step (a copy into fixed device buffers);
everything per token is derived from them on the device by :func:`build_step5_metadata` /
:func:`build_inkling_metadata`, whose output sizes depend only on the padded token count ``T`` and the
buffers' fixed widths. That is what lets a whole step, metadata included, compile to one graph and
capture into a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from stepops.ops.csa_ring_update import CSARingMetadata, build_csa_ring_metadata
from stepops.ops.sconv import SconvMetadata, build_sconv_metadata
from stepops.ops.step_metadata import TokenMetadata, build_token_metadata, paged_slot_mapping


class StepBuffers(NamedTuple):
    """One step's scheduling, in fixed-size int32 device buffers (``R`` = the runner's request slots).

    ``query_start_loc [R + 1]`` (scheduled requests first; unused entries repeat the total),
    ``seq_lens [R]`` (tokens of each request after the step; 0 for unused rows),
    ``attn_block_table [R, max_blocks]`` (every attention layer's KV cache),
    ``ring_blocks [R]`` (Step5: each request's CSA ring block), ``summary_block_table [R, max_summary_blocks]``
    (Step5: region summaries), ``conv_block_table [R, max_conv_blocks]`` (Inkling: the conv-state cache).
    A model ignores the tables it does not use.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    attn_block_table: torch.Tensor
    ring_blocks: torch.Tensor
    summary_block_table: torch.Tensor
    conv_block_table: torch.Tensor


def bound_size(cache: torch.Tensor, dim: int) -> int:
    """``cache.shape[dim]`` of a bound 4-D cache; ``0`` for an owner's empty placeholder (nothing bound)."""
    return cache.shape[dim] if cache.dim() == 4 else 0


def bound_sizes(what: str, sizes: dict[str, int]) -> list[int]:
    """The sizes of ``sizes`` (cache name -> size, ``0`` = no cache bound); ``ValueError`` naming the caches
    that have none bound."""
    unbound = [name for name, size in sizes.items() if size == 0]
    if unbound:
        raise ValueError(f"{what}: no cache bound for {', '.join(unbound)} (allocate the model's caches first)")
    return list(sizes.values())


def common_size(what: str, sizes: dict[str, int]) -> int:
    """The one ``what`` every layer in ``sizes`` (layer name -> size, ``0`` = no cache bound) shares.

    A step's metadata is built once for all layers from one set of block tables, so the layers must agree;
    ``ValueError`` naming the layers when one has no cache bound or when they differ.
    """
    if len(set(bound_sizes(what, sizes))) > 1:
        found = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise ValueError(f"{what} must be the same for every layer (one block table serves them all), got {found}")
    return next(iter(sizes.values()))



def common_attn_block_size(layers) -> int:
    """Tokens per block of every layer's bound paged KV cache (``layer.attn``); see :func:`common_size`."""
    return common_size(
        "attention block size", {layer.attn.layer_name: bound_size(layer.attn.kv_cache, 1) for layer in layers}
    )

class Step5StepMetadata(NamedTuple):
    """Everything a Step5 decoder layer reads per step; every tensor's first dim is ``T`` or ``R``.

    ``attn_slot_mapping [T]`` and ``attn_block_table [R, max_blocks]`` address the paged KV caches;
    ``ring`` is the CSA tail ring's :class:`CSARingMetadata`; ``summary_block_table [R, max_summary_blocks]``
    with ``summary_block_size`` regions per block addresses the e4m3 summary caches (the CSA indexer reads
    them a chunk of regions at a time, never as ``[T, num_regions]``).
    """

    token: TokenMetadata
    attn_slot_mapping: torch.Tensor
    attn_block_table: torch.Tensor
    ring: CSARingMetadata
    summary_block_table: torch.Tensor
    summary_block_size: int


def build_step5_metadata(
    buffers: StepBuffers,
    num_tokens: int,
    *,
    attn_block_size: int,
    rows_per_block: int,
    summary_block_size: int,
) -> Step5StepMetadata:
    """Derive a Step5 step's metadata from ``buffers`` on their device, for ``num_tokens`` (padded) tokens."""
    token = build_token_metadata(buffers.query_start_loc, buffers.seq_lens, num_tokens)
    ring = build_csa_ring_metadata(
        buffers.query_start_loc,
        buffers.seq_lens,
        buffers.ring_blocks,
        rows_per_block,
        buffers.summary_block_table,
        summary_block_size,
        num_tokens,
        token=token,
    )
    return Step5StepMetadata(
        token=token,
        attn_slot_mapping=paged_slot_mapping(token, buffers.attn_block_table, attn_block_size),
        attn_block_table=buffers.attn_block_table,
        ring=ring,
        summary_block_table=buffers.summary_block_table,
        summary_block_size=summary_block_size,
    )


class InklingStepMetadata(NamedTuple):
    """Everything an Inkling decoder layer reads per step.

    ``attn_slot_mapping [T]`` and ``attn_block_table`` address the paged KV caches; ``sconv`` is the
    short-conv op's :class:`SconvMetadata` over ``conv_block_table [R, max_conv_blocks]``.
    """

    token: TokenMetadata
    attn_slot_mapping: torch.Tensor
    attn_block_table: torch.Tensor
    sconv: SconvMetadata
    conv_block_table: torch.Tensor


def build_inkling_metadata(
    buffers: StepBuffers, num_tokens: int, *, attn_block_size: int, conv_block_size: int
) -> InklingStepMetadata:
    """Derive an Inkling step's metadata from ``buffers`` on their device, for ``num_tokens`` tokens."""
    token = build_token_metadata(buffers.query_start_loc, buffers.seq_lens, num_tokens)
    sconv = build_sconv_metadata(
        buffers.query_start_loc, buffers.seq_lens, buffers.conv_block_table, conv_block_size, num_tokens, token=token
    )
    return InklingStepMetadata(
        token=token,
        attn_slot_mapping=paged_slot_mapping(token, buffers.attn_block_table, attn_block_size),
        attn_block_table=buffers.attn_block_table,
        sconv=sconv,
        conv_block_table=buffers.conv_block_table,
    )
