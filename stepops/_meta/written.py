"""Checks of the tensors an op writes that no single op owns: a written tensor must give every position
an element of its own, and must not be passed twice."""

from __future__ import annotations

import torch
from torch.compiler import is_dynamo_compiling


def check_own_elements(op: str, name: str, tensor: torch.Tensor) -> None:
    """``ValueError`` if two positions of ``tensor``, which ``op`` writes, can share one element of memory.

    An ``expand``ed cache (stride 0) or an ``unfold``ed one (windows that overlap) would take the writes of
    one position at another's, in an order no kernel defines; CPU ``index_put_`` only warns about it and a
    Triton kernel cannot see it. The rule: ordered by stride, each dimension of size > 1 steps past every
    element the smaller-stride dimensions reach. Every layout that slicing, ``select``, ``view``,
    ``permute`` and ``transpose`` make meets it; one that fails it without sharing an element takes an
    ``as_strided`` with interleaved strides, and is refused too.
    Symbolic sizes are left to the call-time check, which sees the real tensor: comparing them here would
    add guards to a trace. So is Dynamo tracing a PyTorch kernel itself (the benchmarks' compiled baseline),
    which cannot sort symbolic strides; a graph that calls the op checks its tensors in the op's fake.
    """
    if is_dynamo_compiling():
        return
    shape, strides = tensor.shape, tensor.stride()
    if not all(type(n) is int for n in (*shape, *strides)) or 0 in shape:
        return  # symbolic, or no element to share
    reach = 0  # the largest element offset that the dimensions of smaller stride reach
    for stride, size in sorted((stride, size) for size, stride in zip(shape, strides) if size > 1):
        if stride <= reach:
            raise ValueError(
                f"{op}: {name} (shape {tuple(shape)}, strides {tuple(strides)}) lets several of its positions "
                "share one element of memory (an expand()ed or unfold()ed view), so writes would land on each "
                f"other; pass a {name} that owns its elements, e.g. one made by torch.zeros"
            )
        reach += (size - 1) * stride


def check_distinct(op: str, first: tuple[str, torch.Tensor], second: tuple[str, torch.Tensor]) -> None:
    """``ValueError`` if one tensor is passed as two arguments that ``op`` writes (the later writes would
    overwrite the earlier). Distinct views whose elements overlap are not checked here: that needs their
    data pointers on every call (see ``docs/ops.md``)."""
    if first[1] is second[1]:
        raise ValueError(
            f"{op}: {first[0]} and {second[0]} are one tensor, so the writes of one would overwrite the other; "
            "pass two tensors with their own memory"
        )
