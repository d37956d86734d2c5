"""``stepops::sconv``: Inkling's fused store-and-convolve over the paged HND conv-state cache.

One call handles one conv stream (K, V, attention output or MLP output) of one decoder layer for a whole
ragged step (prefill chunks, decode and speculative verify tokens mixed): it stores each token's input at
its position's slot inside the stream's D-range and returns the depthwise causal convolution of width W
plus the residual. The formula and invariants are in :func:`sconv_torch`'s docstring (the op's
documentation) and ``docs/ops.md``.
"""

from __future__ import annotations

import torch

from stepops._library import declare_op
from stepops._meta.sconv import check_sconv_args, sconv_fake
from stepops._triton import triton_launcher
from stepops.ops.sconv.metadata import SconvMetadata, build_sconv_metadata
from stepops.ops.sconv.samples import error_inputs, samples
from stepops.ops.sconv.torch_kernel import sconv_torch

__all__ = ["SconvMetadata", "build_sconv_metadata", "sconv", "validate_sconv_inputs"]

declare_op(
    "sconv",
    mutates_args=("cache", "errors"),
    torch_kernel=sconv_torch,
    triton_kernel=triton_launcher("stepops::sconv", "stepops.ops.sconv.triton_kernel", "sconv_triton"),
    fake=sconv_fake,
    samples=samples,
    error_inputs=error_inputs,
)


def sconv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    metadata: SconvMetadata,
    stream_offset: int,
    *,
    residual: bool = True,
    silu: bool = False,
    errors: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Store one stream's inputs of a ragged step in ``cache`` and return its short convolution.

    ``x`` ``[T, H * width]`` bf16 head-major; ``weight`` ``[H * width, W]`` bf16/fp32 (the conv1d weight
    ``[C, 1, W]`` squeezed); ``cache`` ``[num_blocks, H, N, D]`` bf16, written in place inside
    ``[stream_offset, stream_offset + width)`` of each head at the step's slots only; ``block_table``
    ``[R, max_blocks]`` int32; ``metadata`` from :func:`build_sconv_metadata`. Returns ``y``
    ``[T, H * width]`` bf16: ``y[t, c] = x[t, c] + sum_{j<W} w[c, j] * x_{p-W+1+j}[c]`` in fp32, rounded
    once (``silu`` applies ``a / (1 + exp(-a))`` to the sum first; ``residual=False`` drops ``x[t, c]``);
    padding rows are zero.

    No id makes the op touch memory outside its tensors (``stepops.ops.bounds``): on CPU an out-of-range
    request, chunk start, slot or block is a ``ValueError`` raised before anything is written; on CUDA
    those addresses are masked (nothing written, zeros read) and the token is counted in ``errors``, an
    optional int32 ``[1]`` device counter (``stepops.error_counter()``) read after the step.

    ``validate=True`` first checks on the host (a device sync; keep it off in serving and under
    ``torch.compile``) that the metadata describe contiguous, in-order request rows, that slots match
    the block table, that every block read or written exists (the kernels read an earlier tap whose
    block is unallocated, a negative entry or a column past the table, as zero; ``validate`` rejects it
    as a broken block table), and that no stored slot is read or stored twice; it raises ``ValueError``
    otherwise.
    """
    if not isinstance(metadata, SconvMetadata):
        raise TypeError(f"sconv: metadata must be an SconvMetadata, got {type(metadata).__name__}")
    if validate:
        validate_sconv_inputs(x, weight, cache, block_table, metadata, stream_offset)
    return torch.ops.stepops.sconv(x, weight, cache, block_table, *metadata, stream_offset, residual, silu, errors)


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


def _slot_mismatch(t, slot, expected, block_size, table, request, slot_mapping, position) -> str:
    """The message for a slot that its block table does not give: names the block size the metadata were
    built for when one other ``N`` explains every stored slot (the common mistake), else the token."""
    stored = [(r, s, p) for r, s, p in zip(request, slot_mapping, position) if r >= 0 and s >= 0]

    def explains(n: int) -> bool:
        return all(
            p // n < len(table[r]) and table[r][p // n] >= 0 and s == table[r][p // n] * n + p % n for r, s, p in stored
        )

    others = [n for n in range(1, max(s for _, s, _ in stored) + 2) if n != block_size and explains(n)]
    if others:
        return (
            f"sconv: the metadata were built for block size {others[0]}, but the cache's block size N is "
            f"{block_size} (cache.shape[2]); build them with build_sconv_metadata(..., block_size={block_size})"
        )
    return f"sconv: token {t} has slot {slot}, but its block table gives {expected} (block size {block_size})"
