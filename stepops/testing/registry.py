"""OpInfo-style sample registry over every declared stepops op, and the one opcheck policy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import stepops  # noqa: F401  (importing the package declares every op)
from stepops._library import ErrorInput, registered_ops

# All four opcheck utils run on every op and sample. An exclusion must be added here, per op, with the
# reason next to it; there is none.
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


def op_samples(device: str | torch.device = "cpu", *, op_name: str | None = None) -> Iterator[OpSample]:
    """Yield sample inputs for every stepops op (or only ``op_name``), fresh tensors on each call."""
    device = torch.device(device)
    for entry in registered_ops():
        if op_name is not None and entry.name != op_name:
            continue
        for sample in entry.samples(device):
            yield OpSample(entry.overload, sample.args, sample.kwargs, f"{entry.name}-{sample.name}")


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
