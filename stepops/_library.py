"""The one path through which every stepops op is declared.

Each op is a ``torch.library.custom_op`` in the ``stepops`` namespace whose schema is inferred from the
annotations of its PyTorch kernel. That kernel is the readable specification and serves CPU; the Triton
launcher serves CUDA; the fake from ``stepops._meta`` serves FakeTensor/Meta tracing. Declaring through
:func:`declare_op` also records the op in a registry, so generic tests (``opcheck``, schema snapshots,
"every op has a fake, both kernels, samples and error inputs", bad inputs) and benchmarks can iterate
over all ops.
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
class ErrorInput:
    """A bad call of an op and the error it must raise (PyTorch OpInfo's ``ErrorInput``).

    ``data=True``: the error lies in the ids (``stepops.ops.bounds``), so the PyTorch kernel raises it
    before writing anything while the Triton kernel masks it, writes nothing outside its tensors and
    counts the token in ``errors``; ``data=False``: a shape/dtype error that the fake and both kernels
    raise alike.
    """

    sample: SampleInput
    error_type: type[Exception]
    error_regex: str
    data: bool = False


ErrorInputFn = Callable[[torch.device], Iterator[ErrorInput]]


def guarded(tensor: torch.Tensor, pad: int = 64) -> torch.Tensor:
    """A copy of ``tensor`` (same strides) placed ``pad`` elements into a larger buffer with ``pad`` random
    elements after its last one: bytes around the view that a test can check an op never touches."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
    buffer = torch.randn(extent + 2 * pad, generator=torch.Generator().manual_seed(extent))
    if tensor.dtype.is_floating_point:
        buffer = buffer.to(tensor.dtype)
    else:
        buffer = (buffer * 100).to(tensor.dtype)
    view = buffer.to(tensor.device).as_strided(tensor.shape, tensor.stride(), pad)
    view.copy_(tensor)
    return view


@dataclass(frozen=True)
class OpEntry:
    """Everything stepops knows about one declared op."""

    name: str
    op: torch._library.custom_ops.CustomOpDef
    torch_kernel: Callable[..., Any]
    triton_kernel: Callable[..., Any]
    fake: Callable[..., Any]
    samples: SampleFn
    error_inputs: ErrorInputFn

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
    error_inputs: ErrorInputFn,
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
    _REGISTRY[name] = OpEntry(name, op, torch_kernel, triton_kernel, fake, samples, error_inputs)
    return op


def registered_ops() -> tuple[OpEntry, ...]:
    """Every declared op, sorted by name."""
    return tuple(_REGISTRY[name] for name in sorted(_REGISTRY))
