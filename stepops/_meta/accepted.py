"""The argument signatures an op's check accepted lately, compared with a new call in C++.

The checks in ``stepops._meta`` read the dtypes, sizes and devices of tensors, the strides of the tensors an
op writes and an int, never data, so a call whose tensors match an accepted call's in type, dispatch keys,
dtype, device, sizes, written strides and ``requires_grad``, and whose int is equal, passes them again.
Reading that in Python costs as much as the checks themselves (3-5 us for 5-9 tensors per eager call, about
the dispatcher's own cost). Dynamo's ``TensorGuards`` (``torch._C._dynamo.guards``: private, the same
interface on torch 2.11-2.15) compares it in one C++ call, so a decode loop, which calls each op with the
same few signatures at every layer and step, runs the Python checks only for a new one. Without
``TensorGuards`` every call runs them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling

try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # a torch without it: every call runs the checks
    TensorGuards = None


class _Absent(torch.Tensor):
    """The type of :data:`ABSENT` alone: the guards compare types, so no tensor a caller passes matches it."""


# Stands for an absent optional tensor (``errors=None``): the guards take tensors only. Not a plain tensor:
# a plain empty one let a call with ``errors=torch.empty(0)`` match an accepted call without a counter, skip
# the checks and reach the Triton kernel, which then counted into an empty tensor's address.
ABSENT = torch.Tensor._make_subclass(_Absent, torch.empty(0))
# Signatures worth remembering: real tensors and parameters (FakeTensors, functional and other subclasses
# are tracing, which runs the checks once anyway) and plain ints (never a SymInt, whose comparison would
# add a guard to a trace).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_INTS = (int, type(None))


class Accepted(NamedTuple):
    """A signature a check accepted: its tensors' guards, its int and what the check returned."""

    guards: Any
    scalar: int | None
    result: Any


class AcceptedSignatures:
    """The last few signatures one op's check accepted, most recently matched first.

    Each check opens with the lookup written out, not called as a method: the guards of a 6-tensor call
    take ~0.6 us, and a lookup method around them (its frame, a tuple of the tensors and unpacking it)
    added ~0.25 us to an eager call's host path of 3-7 us. The lookup of an op with an int ``n``::

        if type(n) is int and not is_dynamo_compiling():
            for accepted in _ACCEPTED.entries:
                if accepted.scalar == n and accepted.guards.check(a, b, ABSENT if errors is None else errors):
                    if accepted is not _ACCEPTED.entries[0]:
                        _ACCEPTED.promote(accepted)
                    return accepted.result
        ...  # the checks
        _ACCEPTED.remember((a, b, ABSENT if errors is None else errors), n, result)

    The int's type before its value: ``True == 1``, but a bool is no int to the checks, and a SymInt's
    comparison would add a guard to a trace. Never while Dynamo traces a kernel that calls the check: the
    C++ call is not traceable, and a trace runs the checks once anyway. The guards fail a call that passes
    one tensor twice (they require distinct tensors): such a call runs the checks and is not remembered.

    A model step calls an op with a few signatures in turn (Inkling's sconv one per stream, its KV writes
    one per cache shape), so one remembered signature would miss at every call; a matched signature moves
    to the front (:meth:`promote`), so a repeated one is found first and one used every step stays while
    new ones come and go.
    """

    __slots__ = ("entries",)
    SIZE = 8  # more than the signatures of one op in a model step

    def __init__(self) -> None:
        self.entries: tuple[Accepted, ...] = ()

    def promote(self, accepted: Accepted) -> None:
        """Move ``accepted``, one of :attr:`entries` that a call matched, to the front. A no-op when it is
        gone: another thread's :meth:`remember` may have let it go since the call matched it."""
        entries = self.entries
        for i, entry in enumerate(entries):
            if entry is accepted:
                self.entries = (accepted, *entries[:i], *entries[i + 1 :])
                return

    def remember(
        self,
        tensors: tuple[torch.Tensor, ...],
        scalar: int | None = None,
        result: Any = None,
        *,
        written: tuple[int, ...] = (),
    ) -> None:
        """Add ``tensors`` and ``scalar`` as accepted with ``result`` (at the front), if they are plain
        values; the least recently matched signature goes when :attr:`SIZE` are remembered. ``written``:
        the positions in ``tensors`` of the tensors the op writes, whose strides must match too."""
        if TensorGuards is None or is_dynamo_compiling() or type(scalar) not in _PLAIN_INTS:
            return
        # A tensor passed twice: the guards would never match the call.
        plain = all(type(t) in _PLAIN_TENSORS or t is ABSENT for t in tensors)
        if not plain or len({id(t) for t in tensors}) < len(tensors):
            return
        # The sizes these tensors have now; the strides of the written ones (the checks refuse strides that
        # let two positions share an element, stepops._meta.written), any strides of the others: comparing
        # them would cost the guards time for nothing the checks read.
        guards = TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[
                list(t.stride()) if i in written else [None] * t.dim() for i, t in enumerate(tensors)
            ],
        )
        self.entries = (Accepted(guards, scalar, result), *self.entries[: self.SIZE - 1])
