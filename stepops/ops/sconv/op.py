"""``stepops::sconv``: its declaration (schema, kernels, fake, samples) and the public wrapper."""

from __future__ import annotations

import torch

from stepops._library import declare_op
from stepops._meta.errors import check_arg_types
from stepops._meta.sconv import sconv_fake
from stepops._triton import triton_launcher
from stepops.ops.sconv.metadata import SconvMetadata
from stepops.ops.sconv.samples import error_inputs, samples
from stepops.ops.sconv.torch_kernel import sconv_torch
from stepops.ops.sconv.validate import validate_sconv_inputs

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

    Shapes and dtypes:
        ``x`` ``[T, H * width]`` bf16, head-major; ``weight`` ``[H * width, W]`` bf16 or fp32 (the conv1d
        weight ``[C, 1, W]`` squeezed); ``cache`` ``[num_blocks, H, N, D]`` bf16; ``block_table``
        ``[R, max_blocks]`` int32; ``metadata`` from :func:`build_sconv_metadata` (four ``[T]`` int32,
        -1 for padding); ``stream_offset`` int; ``errors`` optional int32 ``[1]``.
    Writes:
        ``cache`` in place, inside ``[stream_offset, stream_offset + width)`` of each head at the step's
        slots only; on CUDA, ``errors`` counts tokens with an out-of-range id.
    Returns:
        ``y`` ``[T, H * width]`` bf16: ``y[t, c] = x[t, c] + sum_{j<W} w[c, j] * x_{p-W+1+j}[c]`` in fp32,
        rounded once (``silu`` applies ``a / (1 + exp(-a))`` to the sum first; ``residual=False`` drops
        ``x[t, c]``); padding rows are zero.

    No id makes the op touch memory outside its tensors (``stepops.ops.bounds``): on CPU an out-of-range
    request, chunk start, slot or block is a ``ValueError`` raised before anything is written; on CUDA
    those addresses are masked (nothing written, zeros read) and the token is counted in ``errors``
    (``stepops.error_counter()``), read after the step.

    ``validate=True`` first checks on the host (a device sync; keep it off in serving and under
    ``torch.compile``) that the metadata describe contiguous, in-order request rows, that slots match
    the block table, that every block read or written exists (the kernels read an earlier tap whose
    block is unallocated, a negative entry or a column past the table, as zero; ``validate`` rejects it
    as a broken block table), and that no stored slot is read or stored twice; it raises ``ValueError``
    otherwise.

    Example (the full one is in ``docs/ops.md``)::

        metadata = build_sconv_metadata(query_start_loc, seq_lens, block_table, cache.shape[2], x.shape[0])
        y_k = sconv(x_k, conv_k, cache, block_table, metadata, k_offset)  # [T, H * head_dim] bf16
    """
    if not isinstance(metadata, SconvMetadata):
        raise TypeError(f"sconv: metadata must be an SconvMetadata, got {type(metadata).__name__}")
    check_arg_types(
        "sconv",
        (
            ("x", x), ("weight", weight), ("cache", cache), ("block_table", block_table),
            *((f"metadata.{name}", t) for name, t in zip(SconvMetadata._fields, metadata)),
            *(() if errors is None else (("errors", errors),)),
        ),
        ints=(("stream_offset", stream_offset),),
        bools=(("residual", residual), ("silu", silu), ("validate", validate)),
    )  # fmt: skip
    if validate:
        validate_sconv_inputs(x, weight, cache, block_table, metadata, stream_offset)
    return torch.ops.stepops.sconv(x, weight, cache, block_table, *metadata, stream_offset, residual, silu, errors)
