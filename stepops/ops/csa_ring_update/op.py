"""``stepops::csa_ring_update``: its declaration (schema, kernels, fake, samples) and the public wrapper."""

from __future__ import annotations

import torch

from stepops._library import declare_op
from stepops._meta.csa_ring_update import csa_ring_update_fake
from stepops._meta.errors import check_arg_types
from stepops._triton import triton_launcher
from stepops.ops.csa_ring_update.metadata import CSARingMetadata
from stepops.ops.csa_ring_update.samples import error_inputs as csa_ring_update_error_inputs
from stepops.ops.csa_ring_update.samples import samples as csa_ring_update_samples
from stepops.ops.csa_ring_update.torch_kernel import csa_ring_update_torch
from stepops.ops.csa_ring_update.validate import validate_csa_ring_update_inputs

declare_op(
    "csa_ring_update",
    mutates_args=("ring", "summary_cache", "errors"),
    torch_kernel=csa_ring_update_torch,
    triton_kernel=triton_launcher(
        "stepops::csa_ring_update", "stepops.ops.csa_ring_update.triton_kernel", "csa_ring_update_triton"
    ),
    fake=csa_ring_update_fake,
    samples=csa_ring_update_samples,
    error_inputs=csa_ring_update_error_inputs,
)


def csa_ring_update(
    index_k: torch.Tensor,
    index_z: torch.Tensor,
    ring: torch.Tensor,
    summary_cache: torch.Tensor,
    metadata: CSARingMetadata,
    capacity: int,
    *,
    errors: torch.Tensor | None = None,
    validate: bool = False,
    rows_per_block: int | None = None,
) -> None:
    """Store a step's ``[index_k | index_z]`` rows in the requests' rings and write closed regions' summaries.

    Shapes and dtypes:
        ``index_k``, ``index_z`` ``[T, P]`` bf16, the step's flattened tokens (requests contiguous, padding
        last); ``ring`` ``[num_rows, 2P]`` bf16, the rows view of the ring cache (request ``r``'s ring is
        rows ``[ring_base, ring_base + capacity)``; e.g. ``BoundCSATailRing.rows``); ``summary_cache``
        ``[num_slots, P]`` bf16 or float8_e4m3fn (uint8 holding e4m3fn codes is accepted too); ``metadata`` from :func:`build_csa_ring_metadata` (five
        ``[T]`` int32, -1 for padding); ``capacity`` int, rows per request ring, ``>= 7`` (the layout
        guarantees ``>= 7 + k``); ``errors`` optional int32 ``[1]`` (``stepops.error_counter()``).
    Writes:
        ``ring`` in place: position ``p`` of a request lives at row ``ring_base + p % capacity``; only the
        last ``capacity`` tokens of a request in a step are stored. ``summary_cache`` in place: a token
        with ``p % 8 == 7`` and a slot writes the summary of positions ``p-7..p``, per dimension
        ``sum_t softmax(z)_t k_t``, folded in that fixed order in fp32 (see
        ``stepops.ops.csa_ring_update.torch_kernel.fold_region``), so the bits do not depend on how the
        sequence was split into steps; fp8 summaries are the bf16 summary clamped to ``[-448, 448]`` then
        cast (round to nearest even), so they saturate instead of becoming NaN. All replays read the ring
        before the step's stores land. On CUDA, ``errors`` counts tokens whose chunk, ring or summary slot
        is out of range (they read and write nothing); on CPU the op raises ``ValueError`` instead, before
        writing anything.
    Returns:
        ``None``. One launch; CUDA-graph safe when ``validate`` is off.

    ``validate=True`` first runs :func:`validate_csa_ring_update_inputs` on the host (chunks, disjoint
    rings, rows and slots in range). Syncs; for debugging only. ``rows_per_block``, the ring's block stride
    (``BoundCSATailRing.rows_per_block``), is read only by that check: with it, every ring must lie inside
    its own block (a ring of a request outside the step may start at the next block).

    Example (the full one is in ``docs/ops.md``)::

        metadata = build_csa_ring_metadata(query_start_loc, seq_lens, ring_blocks, rows_per_block,
                                           summary_block_table, summary_block_size, num_tokens)
        csa_ring_update(index_k, index_z, ring.rows, summary_cache, metadata, ring.capacity)
    """
    if not isinstance(metadata, CSARingMetadata):
        raise TypeError(
            f"csa_ring_update: metadata must be a CSARingMetadata (build_csa_ring_metadata), got "
            f"{type(metadata).__name__}"
        )
    check_arg_types(
        "csa_ring_update",
        (
            ("index_k", index_k), ("index_z", index_z), ("ring", ring), ("summary_cache", summary_cache),
            *((f"metadata.{name}", t) for name, t in zip(CSARingMetadata._fields, metadata)),
            *(() if errors is None else (("errors", errors),)),
        ),
        ints=(("capacity", capacity),),
        bools=(("validate", validate),),
    )  # fmt: skip
    if validate:
        validate_csa_ring_update_inputs(index_k, index_z, ring, summary_cache, metadata, capacity, rows_per_block)
    # An fp8 cache goes to the op as it is, never as a uint8 view: compiled, a dtype view of a graph input
    # that the op writes is copied back whole, and torch 2.11's Inductor copies it back as values, changing
    # every byte of the cache (tests/ops/test_csa_ring_update.py, test_compiled_wrapper_matches_eager_in_place).
    torch.ops.stepops.csa_ring_update(
        index_k,
        index_z,
        ring,
        summary_cache,
        metadata.position,
        metadata.chunk_start,
        metadata.chunk_len,
        metadata.ring_base,
        metadata.summary_slot,
        capacity,
        errors,
    )
