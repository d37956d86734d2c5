"""The one path through which every stepops op is declared.

Each op ``stepops::<name>`` is defined with the low-level ``torch.library.Library`` API: the schema is
inferred from the annotations of its PyTorch kernel (``torch.library.infer_schema``, the same inference
``custom_op`` uses, so the schemas are unchanged); that kernel is the readable specification and is the
``CPU`` kernel; the Triton launcher is the ``CUDA`` kernel (a stand-in that explains how to install Triton
where it is missing, see ``stepops._triton``); the fake from ``stepops._meta`` serves FakeTensor/Meta
tracing; and one small ``Autograd`` kernel runs the op below autograd (the ops have no derivative).

Why not ``torch.library.custom_op``: its Python layers (autograd, version bump, backend wrapper) cost
14-59 us per eager call of a no-op with one of these ops' schemas (5-9 tensors) on this project's CPUs, the
low-level path 2-5 us under ``inference_mode`` (vLLM registers its ops this way for the same reason;
``docs/performance.md`` has the numbers). What ``custom_op`` gave and the low-level path keeps: the
pt2-compliant tag, the fake, opcheck's four utils, auto-functionalised mutations under ``torch.compile``,
version bumps of the mutated arguments, and an error, not a silent zero gradient, on backward.

Declaring through :func:`declare_op` also records the op in a registry, so generic tests (``opcheck``,
schema snapshots, "every op has a fake, both kernels, samples and error inputs", bad inputs) and
benchmarks can iterate over all ops; :func:`register_op` is the registration alone, which the benchmarks
use to declare no-op twins of every op registered exactly the same way.
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
    buffer = torch.randn(extent + 2 * pad, generator=torch.Generator().manual_seed(extent), device="cpu")
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
    overload: torch._ops.OpOverload  # torch.ops.stepops.<name>.default
    torch_kernel: Callable[..., Any]
    triton_kernel: Callable[..., Any]
    fake: Callable[..., Any]
    samples: SampleFn
    error_inputs: ErrorInputFn

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


_REGISTRY: dict[str, OpEntry] = {}
# One Library per namespace, kept alive for the life of the process (dropping it would unregister the ops).
_LIBRARIES: dict[str, torch.library.Library] = {}


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBRARIES:
        _LIBRARIES[namespace] = torch.library.Library(namespace, "DEF")
    return _LIBRARIES[namespace]


class _NoDerivative(torch.autograd.Function):
    """The path of a call whose inputs require grad: the forward runs below autograd as usual and any
    output carries a backward that raises, as ``custom_op`` does for an op without an autograd formula."""

    @staticmethod
    def forward(ctx, op, keyset, kwargs, *args):
        ctx.op_name = op.name()
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset, *args, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.op_name} has no derivative: the stepops ops write caches for inference. Run them under "
            "torch.inference_mode() or torch.no_grad(), or with inputs that do not require grad."
        )


def written_arguments(op: torch._ops.OpOverload) -> list[int]:
    """Positions of the arguments ``op``'s schema says it writes (``Tensor(a!)``)."""
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _refuse_written_requiring_grad(op: torch._ops.OpOverload, written: list[tuple[int, torch.Tensor]]) -> None:
    """``ValueError`` naming the first tensor ``op`` writes that requires grad, with grad mode on.

    Autograd records none of the op's writes: a backward through such a cache would return the gradient of
    what it held before the op (silently wrong), as PyTorch refuses an in-place op on a leaf that requires
    grad. Under ``torch.no_grad()`` / ``torch.inference_mode()`` the write is allowed, as PyTorch's is.
    """
    for position, tensor in written:
        if tensor.requires_grad:
            name = op._schema.arguments[position].name
            raise ValueError(
                f"{op.name()} writes {name}, which requires grad: autograd cannot record that write, so "
                f"gradients through {name} would be wrong. Keep caches out of autograd (requires_grad=False, "
                "or .detach()), or run the step under torch.inference_mode() or torch.no_grad()."
            )


def _autograd_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """The ``Autograd`` kernel of ``op``: refuse a written tensor that requires grad (with grad mode on),
    bump the mutated arguments' versions, then run the backend kernel below autograd. Without an
    ``Autograd`` kernel the dispatcher's fallback would run the PyTorch kernel with autograd on, so an
    output would silently carry the gradient of the CPU kernel's internals (and none on CUDA). Under
    ``torch.inference_mode()`` (how the models run) the dispatcher skips this kernel.
    """
    mutated = written_arguments(op)
    below = torch._C._after_autograd_keyset
    increment_version = torch.autograd.graph.increment_version

    def autograd_kernel(keyset, *args, **kwargs):  # kwargs: keyword-only arguments (no op has any yet)
        written = [(i, args[i]) for i in mutated if i < len(args) and args[i] is not None]  # optional: None
        if torch.is_grad_enabled():
            _refuse_written_requiring_grad(op, written)
        # Custom_op's ADInplaceOrView kernel bumps these too: autograd then refuses a backward that would
        # read a tensor saved before the op overwrote it.
        increment_version([tensor for _, tensor in written])
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())
        ):
            return _NoDerivative.apply(op, keyset & below, kwargs, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below, *args, **kwargs)

    return autograd_kernel


def _math_bit_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """The ``Conjugate`` and ``Negative`` kernel of ``op``, reached only when an argument is a conjugate or
    negative view (``c.conj()``, ``c.conj().imag``; plain tensors never carry those keys).

    PyTorch's fallback for those bits cannot write through a view it resolved into a copy (it failed with
    "Expected Tensor but got None" or an internal assert), so a written argument with a bit is a
    ``ValueError`` naming it; read-only arguments are resolved, as the fallback resolves them.
    """
    mutated = set(written_arguments(op))
    name = op._schema.name.split("::")[-1]
    bits = torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate).add(torch._C.DispatchKey.Negative)

    def math_bit_kernel(keyset, *args, **kwargs):
        for i, arg in enumerate(args):
            if i in mutated and isinstance(arg, torch.Tensor) and (arg.is_conj() or arg.is_neg()):
                raise ValueError(
                    f"{name}: {op._schema.arguments[i].name} is a {'conjugate' if arg.is_conj() else 'negative'} "
                    "view, which the op cannot write through; pass the tensor the view was taken of (for "
                    "c.conj(), c)"
                )
        resolved = [a.resolve_conj().resolve_neg() if isinstance(a, torch.Tensor) else a for a in args]
        return op.redispatch(keyset - bits, *resolved, **kwargs)

    return math_bit_kernel


def register_op(
    qualname: str,
    *,
    mutates_args: Sequence[str],
    torch_kernel: Callable[..., Any],
    cpu_kernel: Callable[..., Any] | None = None,
    cuda_kernel: Callable[..., Any],
    fake: Callable[..., Any],
) -> torch._ops.OpOverload:
    """Define ``qualname`` (``"namespace::name"``) with the schema of ``torch_kernel``'s annotations and
    register its CPU kernel (``torch_kernel`` unless ``cpu_kernel`` is given), CUDA kernel, fake,
    ``Autograd`` kernel and ``Conjugate``/``Negative`` kernels; return the op's overload. No registry
    entry: :func:`declare_op` adds that."""
    namespace, name = qualname.split("::")
    lib = _library(namespace)
    schema = torch.library.infer_schema(torch_kernel, mutates_args=tuple(mutates_args))
    # custom_op tags its ops pt2-compliant (they trace under torch.compile): so do these.
    lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    lib.impl(name, torch_kernel if cpu_kernel is None else cpu_kernel, "CPU")
    lib.impl(name, cuda_kernel, "CUDA")
    torch.library.register_fake(qualname, fake, lib=lib)
    op = getattr(getattr(torch.ops, namespace), name).default
    lib.impl(name, _autograd_kernel(op), "Autograd", with_keyset=True)
    for math_bit in ("Conjugate", "Negative"):
        lib.impl(name, _math_bit_kernel(op), math_bit, with_keyset=True)
    return op


def declare_op(
    name: str,
    *,
    mutates_args: Sequence[str],
    torch_kernel: Callable[..., Any],
    triton_kernel: Callable[..., Any],
    fake: Callable[..., Any],
    samples: SampleFn,
    error_inputs: ErrorInputFn,
) -> torch._ops.OpOverload:
    """Declare ``stepops::<name>`` (see :func:`register_op`) and record it in the registry.

    ``torch_kernel``'s annotations give the schema and its docstring documents the op. Cache writers
    return ``None`` and list the cache in ``mutates_args``; no op returns an alias of an input.
    ``triton_kernel`` comes from :func:`stepops._triton.triton_launcher`, so a missing Triton only fails
    a call on CUDA.
    """
    if name in _REGISTRY:
        raise ValueError(f"stepops op {name!r} is declared twice")
    op = register_op(
        f"{NAMESPACE}::{name}",
        mutates_args=mutates_args,
        torch_kernel=torch_kernel,
        cuda_kernel=triton_kernel,
        fake=fake,
    )
    _REGISTRY[name] = OpEntry(name, op, torch_kernel, triton_kernel, fake, samples, error_inputs)
    return op


def registered_ops() -> tuple[OpEntry, ...]:
    """Every declared op, sorted by name."""
    return tuple(_REGISTRY[name] for name in sorted(_REGISTRY))


def registered_op(name: str) -> OpEntry:
    """The declared op ``name`` (``KeyError`` naming the declared ones otherwise)."""
    if name not in _REGISTRY:
        raise KeyError(f"no stepops op named {name!r}; declared: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
