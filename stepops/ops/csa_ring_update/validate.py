"""The host validator of ``stepops::csa_ring_update`` (``validate=True``): data checks that need a sync."""

from __future__ import annotations

import math

import torch

from stepops._meta.csa_ring_update import check_csa_ring_update_args
from stepops.ops.bounds import check_ids
from stepops.ops.csa_ring_update.metadata import CSARingMetadata
from stepops.specs import check_int


@torch.compiler.disable  # a host sync: under torch.compile it runs eagerly and raises its own errors
def validate_csa_ring_update_inputs(
    index_k: torch.Tensor,
    index_z: torch.Tensor,
    ring: torch.Tensor,
    summary_cache: torch.Tensor,
    metadata: CSARingMetadata,
    capacity: int,
    rows_per_block: int | None = None,
) -> None:
    """Host-side data checks of a csa_ring_update call (see :func:`csa_ring_update`); raises ``ValueError``.

    Reads the metadata back (a device sync: for debugging, never in serving or under ``torch.compile``).
    Beyond the argument checks: each real token ``t`` lies in its own chunk, ``chunk_start <= t <
    chunk_start + chunk_len <= T``; the tokens of a chunk are exactly those rows, agree on ``chunk_len``
    and ``ring_base`` and have consecutive positions; every ring ``[ring_base, ring_base + capacity)`` lies
    inside ``ring`` and the rings of different requests are disjoint (bases at least ``capacity`` apart);
    summary slots are -1 or in range and distinct; padding carries -1 everywhere, and a real token's position
    is not negative (``seq_lens`` shorter than the step) nor behind the token before it. Each ring lies
    inside its own block: given the ring's ``rows_per_block``, every base is a multiple of it and
    ``capacity <= rows_per_block``; without it, only what the bases show (their gcd is a multiple of the
    ``rows_per_block`` they were built with: ``capacity`` above the gcd is caught, a base off the block
    grid is not). These rule out races between the Triton kernel's programs and writes outside the
    requests' own rows: a program reads and writes only its own request's ring rows and step rows, and no
    two write one row.
    """
    check_csa_ring_update_args(index_k, index_z, ring, summary_cache, *metadata, capacity)
    position, chunk_start, chunk_len, ring_base, summary_slot = (m.long().cpu() for m in metadata)
    num_tokens = position.shape[0]
    token = torch.arange(num_tokens, device="cpu")
    # Padding carries -1 everywhere; a token with a chunk but position < 0 is a real token whose request's
    # seq_lens is shorter than its tokens in this step (the builder's positions went negative).
    short = (position < 0) & (chunk_start >= 0)
    if bool(short.any()):
        t = int(short.nonzero()[0])
        raise ValueError(
            f"csa_ring_update: token {t} belongs to the chunk at {int(chunk_start[t])} but has position "
            f"{int(position[t])}: its request's seq_lens is shorter than its tokens in this step"
        )
    padding = position < 0
    for name, field in (("token_position", position), ("token_chunk_start", chunk_start),
                        ("token_chunk_len", chunk_len), ("token_ring_base", ring_base),
                        ("token_summary_slot", summary_slot)):  # fmt: skip
        bad = padding & (field != -1)
        if bool(bad.any()):
            t = int(bad.nonzero()[0])
            raise ValueError(f"csa_ring_update: padding token {t} has {name} {int(field[t])}; padding carries -1")
    real = ~padding
    empty = real & ((chunk_start < 0) | (chunk_len < 1))
    if bool(empty.any()):
        t = int(empty.nonzero()[0])
        raise ValueError(
            f"csa_ring_update: token {t} has token_chunk_start {int(chunk_start[t])} and token_chunk_len "
            f"{int(chunk_len[t])}; a real token's chunk starts at a row >= 0 and holds at least that token"
        )
    if bool((chunk_start[real] + chunk_len[real] > num_tokens).any()):
        raise ValueError(f"csa_ring_update: a request's tokens run past T = {num_tokens}")
    chunk_end = chunk_start + chunk_len
    outside = real & ((token < chunk_start) | (token >= chunk_end))
    if bool(outside.any()):
        t = int(outside.nonzero()[0])
        raise ValueError(
            f"csa_ring_update: token {t} lies outside its chunk [{int(chunk_start[t])}, {int(chunk_end[t])})"
        )
    # Each token after its chunk's first agrees with the one before it; each before its chunk's last is
    # followed by one of the same chunk. By induction the chunk is exactly rows [chunk_start, chunk_end).
    previous = (token - 1).clamp(min=0)
    follows = real & (token > chunk_start)
    same = (
        (chunk_start[previous] == chunk_start)
        & (chunk_len[previous] == chunk_len)
        & (ring_base[previous] == ring_base)
        & (position[previous] == position - 1)
    )
    backwards = follows & (chunk_start[previous] == chunk_start) & (position[previous] >= position)
    if bool(backwards.any()):
        t = int(backwards.nonzero()[0])
        raise ValueError(
            f"csa_ring_update: positions run backwards in one chunk: token {t - 1} at {int(position[t - 1])}, "
            f"token {t} at {int(position[t])}; a request's tokens hold consecutive positions in order"
        )
    bad = follows & ~same
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise ValueError(
            f"csa_ring_update: tokens {t - 1} and {t} of one chunk disagree on chunk_start, chunk_len or "
            f"ring_base, or their positions ({int(position[t - 1])}, {int(position[t])}) are not consecutive"
        )
    following = (token + 1).clamp(max=max(num_tokens - 1, 0))
    cut = real & (token + 1 < chunk_end) & (chunk_start[following] != chunk_start)
    if bool(cut.any()):
        t = int(cut.nonzero()[0])
        raise ValueError(
            f"csa_ring_update: token {t + 1} is inside the chunk [{int(chunk_start[t])}, {int(chunk_end[t])}) "
            f"of token {t} but does not belong to it"
        )
    base = ring_base[real]
    if bool((base < 0).any()) or bool((base + capacity > ring.shape[0]).any()):
        raise ValueError(
            f"csa_ring_update: a ring_base is outside [0, {ring.shape[0] - capacity}] "
            f"(ring rows {ring.shape[0]}, capacity {capacity})"
        )
    bases = ring_base[real & (token == chunk_start)].sort().values  # one per request
    overlap = bases[1:] - bases[:-1] < capacity
    if bool(overlap.any()):
        i = int(overlap.nonzero()[0])
        raise ValueError(
            f"csa_ring_update: the rings at ring_base {int(bases[i])} and {int(bases[i + 1])} of two requests "
            f"overlap (capacity {capacity}): rings of different requests must be disjoint"
        )
    if rows_per_block is None:
        # Bases are ring_block * rows_per_block, so their gcd is a multiple of rows_per_block: one below
        # capacity means capacity > rows_per_block, and every ring runs into the next block's ring.
        stride = math.gcd(*ring_base[real].tolist())
        if 0 < stride < capacity:
            raise ValueError(
                f"csa_ring_update: capacity {capacity} exceeds rows_per_block: every ring_base is a multiple of "
                f"{stride} rows, so a ring of {capacity} rows runs into the next block's ring; capacity must be "
                "<= the rows_per_block the metadata were built with"
            )
    else:
        _check_inside_blocks(ring_base[real], capacity, rows_per_block)
    check_ids("csa_ring_update", "token_summary_slot", summary_slot, summary_cache.shape[0])
    slot = summary_slot[summary_slot >= 0]
    if slot.unique().numel() != slot.numel():
        raise ValueError("csa_ring_update: two tokens write the same summary_slot")


def _check_inside_blocks(ring_base: torch.Tensor, capacity: int, rows_per_block: int) -> None:
    """Every ring ``[base, base + capacity)`` inside one block of ``rows_per_block`` rows: the ring of a
    request outside the step may start in the next block, so disjoint bases alone do not keep them apart."""
    check_int("csa_ring_update: rows_per_block", rows_per_block, 1)
    if capacity > rows_per_block:
        raise ValueError(
            f"csa_ring_update: capacity {capacity} exceeds rows_per_block {rows_per_block}: every ring runs into "
            "the next block's ring"
        )
    off_grid = ring_base % rows_per_block != 0
    if bool(off_grid.any()):
        base = int(ring_base[off_grid][0])
        raise ValueError(
            f"csa_ring_update: ring_base {base} is not a multiple of rows_per_block {rows_per_block}: its ring "
            f"starts inside block {base // rows_per_block} and may run into the next block's; build the "
            "metadata with the ring's rows_per_block"
        )
