"""Argument checks and fake for ``stepops::csa_ring_update``.

The checks look at dtypes, shapes and devices only (never at data), so the fake, the PyTorch kernel and
the Triton launcher all call the same :func:`check_csa_ring_update_args` and raise the same errors at
trace time and at call time.
"""

from __future__ import annotations

import torch
from torch.compiler import is_dynamo_compiling

from stepops._meta.accepted import ABSENT, AcceptedSignatures
from stepops._meta.errors import check_errors_arg
from stepops._meta.written import check_own_elements
from stepops.layouts import REPLAY_ROWS
from stepops.specs import is_int

# uint8 means float8_e4m3fn codes, accepted beside float8 itself: the Step5 model holds its summary caches as
# bytes (stepops.models.step5, bind_summary_cache), and opcheck's test_schema runs fp8 samples as bytes
# (stepops.testing.registry).
FP8_SUMMARY_DTYPES = (torch.float8_e4m3fn, torch.uint8)
SUMMARY_DTYPES = (torch.bfloat16, *FP8_SUMMARY_DTYPES)
METADATA_NAMES = (
    "token_position",
    "token_chunk_start",
    "token_chunk_len",
    "token_ring_base",
    "token_summary_slot",
)
_ACCEPTED = AcceptedSignatures()


def check_csa_ring_update_args(
    index_k: torch.Tensor,
    index_z: torch.Tensor,
    ring: torch.Tensor,
    summary_cache: torch.Tensor,
    token_position: torch.Tensor,
    token_chunk_start: torch.Tensor,
    token_chunk_len: torch.Tensor,
    token_ring_base: torch.Tensor,
    token_summary_slot: torch.Tensor,
    capacity: int,
    errors: torch.Tensor | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` unless the arguments describe a well-formed step.

    A call that repeats a recently accepted signature returns at once (``stepops._meta.accepted``)."""
    if type(capacity) is int and not is_dynamo_compiling():
        for accepted in _ACCEPTED.entries:
            if accepted.scalar == capacity and accepted.guards.check(
                index_k, index_z, ring, summary_cache, token_position, token_chunk_start, token_chunk_len,
                token_ring_base, token_summary_slot, ABSENT if errors is None else errors,
            ):  # fmt: skip
                if accepted is not _ACCEPTED.entries[0]:
                    _ACCEPTED.promote(accepted)
                return
    for name, t in (("index_k", index_k), ("index_z", index_z), ("ring", ring)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"csa_ring_update: {name} must be bfloat16, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"csa_ring_update: {name} must be 2-D, got shape {tuple(t.shape)}")
    if index_k.shape != index_z.shape:
        raise ValueError(
            f"csa_ring_update: index_k {tuple(index_k.shape)} and index_z {tuple(index_z.shape)} must both be [T, P]"
        )
    num_tokens, proxy_dim = index_k.shape
    if ring.shape[1] != 2 * proxy_dim:
        raise ValueError(
            f"csa_ring_update: a ring row is [index_k | index_z] = {2 * proxy_dim} bf16 values "
            f"({4 * proxy_dim} bytes) for P = {proxy_dim}, but ring rows have {ring.shape[1]} values"
        )
    if summary_cache.dtype not in SUMMARY_DTYPES:
        raise TypeError(
            "csa_ring_update: summary_cache must be bfloat16, float8_e4m3fn, or uint8 holding float8_e4m3fn "
            f"codes; got {summary_cache.dtype}"
        )
    if summary_cache.dim() != 2 or summary_cache.shape[1] != proxy_dim:
        raise ValueError(
            f"csa_ring_update: summary_cache must be [num_slots, {proxy_dim}], got {tuple(summary_cache.shape)}"
        )
    if not is_int(capacity):
        raise TypeError(f"csa_ring_update: capacity must be an int, got {type(capacity).__name__}")
    # The op reads up to REPLAY_ROWS rows from before the step. The layout's stricter rule, 7 + k, also keeps
    # them safe from the previous verify step's rejected drafts; the op cannot know k.
    if capacity < REPLAY_ROWS:
        raise ValueError(
            f"csa_ring_update: capacity {capacity} < {REPLAY_ROWS}: a ring must hold the {REPLAY_ROWS} rows "
            "before a step that a closing token replays (the layout needs 7 + k)"
        )
    if ring.shape[0] < capacity:
        raise ValueError(f"csa_ring_update: ring has {ring.shape[0]} rows, fewer than capacity {capacity}")
    metadata = (token_position, token_chunk_start, token_chunk_len, token_ring_base, token_summary_slot)
    for name, t in zip(METADATA_NAMES, metadata):
        if t.dtype != torch.int32:
            raise TypeError(f"csa_ring_update: {name} must be int32, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] != num_tokens:
            raise ValueError(f"csa_ring_update: {name} must be [T] = [{num_tokens}], got {tuple(t.shape)}")
    device = index_k.device
    for name, t in zip(("index_z", "ring", "summary_cache", *METADATA_NAMES), (index_z, ring, summary_cache, *metadata)):
        if t.device != device:
            raise ValueError(f"csa_ring_update: {name} is on {t.device}, index_k on {device}")
    check_errors_arg("csa_ring_update", errors, device)
    # ring [R, 2P] and summary_cache [S, P] can never be one tensor: their rows differ in width.
    check_own_elements("csa_ring_update", "ring", ring)
    check_own_elements("csa_ring_update", "summary_cache", summary_cache)
    tensors = (
        index_k, index_z, ring, summary_cache, token_position, token_chunk_start, token_chunk_len,
        token_ring_base, token_summary_slot, ABSENT if errors is None else errors,
    )  # fmt: skip
    _ACCEPTED.remember(tensors, capacity, written=(2, 3))


# The op writes its caches and returns nothing, so its fake is its argument check (one frame less on
# every eager call's host path, which runs the same check).
csa_ring_update_fake = check_csa_ring_update_args
