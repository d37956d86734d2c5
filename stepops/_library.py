"""The one path through which every stepops op is declared.

Each op is a ``torch.library.custom_op`` in the ``stepops`` namespace whose schema is inferred from the
annotations of its PyTorch kernel. That kernel is the readable specification and serves CPU; the Triton
launcher serves CUDA; the fake from ``stepops._meta`` serves FakeTensor/Meta tracing. Declaring through
:func:`declare_op` also records the op in a registry, so generic tests (``opcheck``, schema snapshots,
"every op has a fake, both kernels and samples") and benchmarks can iterate over all ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

NAMESPACE = "stepops"


@dataclass(frozen=True)
class SampleInput:
    """One call of an op: a name for test ids, positional and keyword arguments."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


SampleFn = Callable[[torch.device], Iterator[SampleInput]]


@dataclass(frozen=True)
class OpEntry:
    """Everything stepops knows about one declared op."""

    name: str
    op: torch._library.custom_ops.CustomOpDef
    torch_kernel: Callable[..., Any]
    triton_kernel: Callable[..., Any]
    fake: Callable[..., Any]
    samples: SampleFn

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default


_REGISTRY: dict[str, OpEntry] = {}


def declare_op(
    name: str,
    *,
    mutates_args: Sequence[str],
    torch_kernel: Callable[..., Any],
    triton_kernel: Callable[..., Any],
    fake: Callable[..., Any],
    samples: SampleFn,
) -> torch._library.custom_ops.CustomOpDef:
    """Declare ``stepops::<name>`` and record it in the registry.

    ``torch_kernel``'s annotations give the schema and its docstring documents the op. Cache writers
    return ``None`` and list the cache in ``mutates_args``; no op returns an alias of an input.
    """
    if name in _REGISTRY:
        raise ValueError(f"stepops op {name!r} is declared twice")
    op = torch.library.custom_op(
        f"{NAMESPACE}::{name}", torch_kernel, mutates_args=tuple(mutates_args), device_types="cpu"
    )
    op.register_kernel("cuda", triton_kernel)
    op.register_fake(fake)
    _REGISTRY[name] = OpEntry(name, op, torch_kernel, triton_kernel, fake, samples)
    return op


def registered_ops() -> tuple[OpEntry, ...]:
    """Every declared op, sorted by name."""
    return tuple(_REGISTRY[name] for name in sorted(_REGISTRY))
