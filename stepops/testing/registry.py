"""OpInfo-style sample registry over every declared stepops op, and the one opcheck policy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import stepops  # noqa: F401  (importing the package declares every op)
from stepops._library import ErrorInput, registered_ops
from stepops.ops.bounds import error_counter

# All four opcheck utils run on every op and sample (run_opcheck). An exclusion must be added here, per op,
# with the reason next to it; there is none. One util runs on another form of float8 arguments: test_schema
# checks that an op writes only what it declares by comparing every argument before and after the call with
# torch.allclose, which has no CPU kernel for float8 dtypes (torch 2.13: NotImplementedError
# "mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'). On a sample with float8 tensors it runs on
# the same call with them viewed as their bytes (uint8), which every op taking float8 accepts as the same
# call (paged_kv_write copies bits; csa_ring_update reads uint8 as e4m3fn codes); the other three utils run
# on the float8 tensors as they are.
OPCHECK_UTILS: tuple[str, ...] = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


@dataclass(frozen=True)
class OpSample:
    """A sample call ``op(*args, **kwargs)``; unpacks as ``op, args, kwargs``. ``name`` is for test ids."""

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    name: str

    def __iter__(self):
        return iter((self.op, self.args, self.kwargs))

    def with_error_counter(self) -> OpSample:
        """The same call with a zeroed ``errors`` counter on the sample's device: the optional written argument
        every stepops op takes (``stepops.ops.bounds``), which the samples leave out."""
        device = next(a.device for a in self.args if isinstance(a, torch.Tensor))
        kwargs = {**self.kwargs, "errors": error_counter(device)}
        return OpSample(self.op, self.args, kwargs, f"{self.name}-errors")


def op_samples(
    device: str | torch.device = "cpu", *, op_name: str | None = None, with_error_counters: bool = False
) -> Iterator[OpSample]:
    """Yield sample inputs for every stepops op (or only ``op_name``), fresh tensors on each call;
    ``with_error_counters``: each sample also again with an ``errors`` counter (:meth:`OpSample.with_error_counter`)."""
    device = torch.device(device)
    for entry in registered_ops():
        if op_name is not None and entry.name != op_name:
            continue
        for sample in entry.samples(device):
            sample = OpSample(entry.overload, sample.args, sample.kwargs, f"{entry.name}-{sample.name}")
            yield sample
            if with_error_counters:
                yield sample.with_error_counter()


def _is_float8(arg: Any) -> bool:
    return isinstance(arg, torch.Tensor) and arg.dtype.is_floating_point and arg.dtype.itemsize == 1


def run_opcheck(sample: OpSample) -> None:
    """``torch.library.opcheck`` of ``sample`` with every util of ``OPCHECK_UTILS`` (float8 arguments: see
    there); raises opcheck's ``OpCheckError`` on the first failure."""
    op, args, kwargs = sample
    if not any(_is_float8(a) for a in (*args, *kwargs.values())):
        torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)
        return
    torch.library.opcheck(op, args, kwargs, test_utils=[u for u in OPCHECK_UTILS if u != "test_schema"])

    def as_bytes(arg):
        return arg.view(torch.uint8) if _is_float8(arg) else arg

    byte_args, byte_kwargs = tuple(map(as_bytes, args)), {k: as_bytes(v) for k, v in kwargs.items()}
    torch.library.opcheck(op, byte_args, byte_kwargs, test_utils="test_schema")


@dataclass(frozen=True)
class OpErrorInput:
    """A bad call of ``op`` (an op's ``ErrorInput``) with the op's registry entry; ``name`` is for test ids."""

    entry: Any  # stepops._library.OpEntry
    error: ErrorInput
    name: str


def op_error_inputs(device: str | torch.device = "cpu", *, op_name: str | None = None) -> Iterator[OpErrorInput]:
    """Yield every op's error inputs (or only ``op_name``'s), fresh tensors on each call."""
    device = torch.device(device)
    for entry in registered_ops():
        if op_name is None or entry.name == op_name:
            for error in entry.error_inputs(device):
                yield OpErrorInput(entry, error, f"{entry.name}-{error.sample.name}")
