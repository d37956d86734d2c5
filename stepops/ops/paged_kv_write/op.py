"""``stepops::paged_kv_write``: its declaration (schema, kernels, fake, samples) and the public wrapper."""

from __future__ import annotations

import torch

from stepops._library import declare_op
from stepops._meta.errors import check_arg_types
from stepops._meta.paged_kv_write import paged_kv_write_fake
from stepops._triton import triton_launcher
from stepops.ops.paged_kv_write.samples import error_inputs, samples
from stepops.ops.paged_kv_write.torch_kernel import paged_kv_write_torch
from stepops.ops.paged_kv_write.validate import validate_paged_kv_write_inputs

declare_op(
    "paged_kv_write",
    mutates_args=("key_cache", "value_cache", "errors"),
    torch_kernel=paged_kv_write_torch,
    triton_kernel=triton_launcher(
        "stepops::paged_kv_write", "stepops.ops.paged_kv_write.triton_kernel", "paged_kv_write_triton"
    ),
    fake=paged_kv_write_fake,
    samples=samples,
    error_inputs=error_inputs,
)


def paged_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    errors: torch.Tensor | None = None,
    validate: bool = False,
) -> None:
    """Write each token's key and value rows at its slot of a paged NHD KV cache.

    Shapes and dtypes:
        ``key`` ``[T, H, D]`` and ``value`` ``[T, H, Dv]``, any dtype of at most 8 bytes (bits are copied);
        ``key_cache`` ``[num_blocks, N, H, D]`` and ``value_cache`` ``[num_blocks, N, H, Dv]`` in their inputs'
        dtypes;
        ``slot_mapping`` ``[T]`` int32 or int64, -1 for padding;
        ``errors`` optional int32 ``[1]`` (``stepops.error_counter()``).
    Writes:
        ``key_cache``/``value_cache`` in place: token ``t`` goes to block ``slot_mapping[t] // N``, offset
        ``slot_mapping[t] % N``; slot -1 writes nothing. A slot outside the cache never writes: on CPU the
        op raises ``ValueError`` before writing anything; on CUDA the token writes nothing and is counted
        in ``errors``, read after the step.
    Returns:
        ``None``.

    ``validate=True`` also checks on the host (a sync) that every slot is -1 or inside the cache and that
    no two tokens share a slot; leave it off in compiled and captured code.

    Example::

        key_cache = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)  # 4 blocks of N = 16 tokens
        value_cache = torch.zeros_like(key_cache)
        slots = torch.tensor([17, 18, -1], dtype=torch.int32)       # block 1, offsets 1 and 2; padding
        paged_kv_write(key, value, key_cache, value_cache, slots)   # key, value [3, 2, 8] bf16
    """
    check_arg_types(
        "paged_kv_write",
        (
            ("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
            ("slot_mapping", slot_mapping), *(() if errors is None else (("errors", errors),)),
        ),
        bools=(("validate", validate),),
    )  # fmt: skip
    if validate:
        validate_paged_kv_write_inputs(key, value, key_cache, value_cache, slot_mapping)
    torch.ops.stepops.paged_kv_write(key, value, key_cache, value_cache, slot_mapping, errors)
