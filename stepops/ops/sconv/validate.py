"""The host validator of ``stepops::sconv`` (``sconv(..., validate=True)``): data checks that need a sync."""

from __future__ import annotations

import torch

from stepops._meta.sconv import check_sconv_args
from stepops.ops.sconv.metadata import SconvMetadata


@torch.compiler.disable  # a host sync: under torch.compile it runs eagerly and raises its own errors
def validate_sconv_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    metadata: SconvMetadata,
    stream_offset: int,
) -> None:
    """Host-side data checks of an sconv call (see :func:`sconv`); raises ``ValueError``. Syncs the device."""
    _, _, _, kernel_size, block_size = check_sconv_args(x, weight, cache, block_table, *metadata, stream_offset)
    num_blocks = cache.shape[0]
    num_requests, max_blocks = block_table.shape
    table = block_table.tolist()
    request, chunk_start, slot_mapping, position = (m.tolist() for m in metadata)

    def block_of(r: int, q: int, what: str) -> int:
        if q // block_size >= max_blocks:
            raise ValueError(
                f"sconv: position {q} of request {r} ({what}) lies past its block table of {max_blocks} blocks"
            )
        block = table[r][q // block_size]
        if not 0 <= block < num_blocks:
            raise ValueError(
                f"sconv: request {r} position {q} ({what}) maps to block {block}, outside [0, {num_blocks})"
            )
        return block

    stored: dict[int, int] = {}
    read: dict[int, int] = {}
    for t, (r, start, slot, p) in enumerate(zip(request, chunk_start, slot_mapping, position)):
        if r == -1:
            if (start, slot, p) != (-1, -1, -1):
                raise ValueError(f"sconv: padding token {t} must carry -1 in every metadata tensor")
            continue
        if not 0 <= r < num_requests:
            raise ValueError(
                f"sconv: token_request of token {t} is {r}; expected -1 (padding) or a block_table row in "
                f"[0, {num_requests})"
            )
        if not 0 <= start <= t:
            raise ValueError(f"sconv: token {t} has chunk start {start}; expected one in [0, {t}]")
        if p < 0:
            raise ValueError(
                f"sconv: token {t} of request {r} has position {p}; a real token's position is >= 0 "
                "(seq_lens shorter than the request's tokens in this step?)"
            )
        if t > start and request[t - 1] != r:
            raise ValueError(f"sconv: rows {start}..{t} of request {r} are not contiguous (row {t - 1} is another's)")
        if t > start and position[t - 1] != p - 1:
            order = "backwards" if position[t - 1] >= p else "with a gap"
            raise ValueError(
                f"sconv: request {r}'s positions run {order}: token {t - 1} at {position[t - 1]}, token {t} at {p}; "
                "a request's rows hold consecutive positions in order"
            )
        if slot < -1:
            raise ValueError(f"sconv: token {t} has slot {slot}; expected -1 (not stored) or a slot >= 0")
        first_position = p - (t - start)
        for q in range(max(0, p - kernel_size + 1), first_position):
            read[block_of(r, q, "read") * block_size + q % block_size] = t
        if slot >= 0:  # a real token with slot -1 (e.g. its block is not allocated) is not stored
            expected = block_of(r, p, "stored") * block_size + p % block_size
            if slot != expected:
                raise ValueError(_slot_mismatch(t, slot, expected, block_size, table, request, slot_mapping, position))
            if slot in stored:
                raise ValueError(f"sconv: tokens {stored[slot]} and {t} store the same slot {slot}")
            stored[slot] = t
    clash = stored.keys() & read.keys()
    if clash:
        slot = min(clash)
        raise ValueError(f"sconv: token {stored[slot]} stores slot {slot}, which token {read[slot]} reads")


# The largest block size the mismatch message tries as an explanation: far above any cache's N, and small
# enough that the search stays in milliseconds whatever slot ids the caller passed.
_MAX_BLOCK_SIZE_TRIED = 1 << 16


def _slot_mismatch(t, slot, expected, block_size, table, request, slot_mapping, position) -> str:
    """The message for token ``t``'s slot, which its block table does not give: names the block size the
    metadata were built for when one other ``N`` (up to ``_MAX_BLOCK_SIZE_TRIED``) explains every slot
    stored so far (the common mistake), else the token. Only tokens ``0..t`` are read: the validator has
    checked their requests and positions, not those of later tokens."""
    checked = zip(request[: t + 1], slot_mapping[: t + 1], position[: t + 1])
    stored = [(r, s, p) for r, s, p in checked if r >= 0 and s >= 0]

    def explains(n: int, tokens) -> bool:
        return all(
            p // n < len(table[r]) and table[r][p // n] >= 0 and s == table[r][p // n] * n + p % n for r, s, p in tokens
        )

    candidates = range(1, min(max(s for _, s, _ in stored) + 1, _MAX_BLOCK_SIZE_TRIED) + 1)
    # Token t alone rules out nearly every candidate; the rest are checked against every stored token.
    others = [n for n in candidates if n != block_size and explains(n, stored[-1:]) and explains(n, stored)]
    if others:
        return (
            f"sconv: the metadata were built for block size {others[0]}, but the cache's block size N is "
            f"{block_size} (cache.shape[2]); build them with build_sconv_metadata(..., block_size={block_size})"
        )
    return f"sconv: token {t} has slot {slot}, but its block table gives {expected} (block size {block_size})"
