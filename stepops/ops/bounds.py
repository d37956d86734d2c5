"""Memory safety of every op: one rule for every id that a kernel turns into an address.

An id read from data (a slot, a block, a request, a ring row, a summary slot, a row of the step) is either
``-1`` where the op documents it (padding: nothing is read or written for it) or inside the extent of the
tensor it addresses. Nothing else may reach memory, however wrong the metadata:

- PyTorch kernels check every such id (:func:`check_ids`, or :func:`any_bad_ids` for several at once)
  before they write anything, so a bad id is a ``ValueError`` naming the op, the argument and what is
  expected, and every byte of every argument is left as it was (the CPU path can afford the host read).
- Triton kernels cannot raise without a host sync. They mask every address to its tensor's extent (a bad
  id writes nothing and reads zeros) and add one per token with a bad id to the optional ``errors``
  counter, an int32 ``[1]`` tensor on the device that the caller reads after the step
  (:func:`error_counter`, ``stepops.ops.triton_bounds``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# What an op's ids may be: -1 (documented padding) or an index into the tensor they address.
PADDING_ID = -1


class IdCheck(NamedTuple):
    """One argument's ids and their bound: the arguments of :func:`check_ids` after ``op``."""

    name: str
    ids: torch.Tensor
    extent: int | torch.Tensor
    where: torch.Tensor | None = None
    padding: bool = True
    expected: str | None = None

    def bad(self) -> torch.Tensor:
        """A bool mask of the ids that break the rule (computed on the device, no host read)."""
        ids = self.ids.to(torch.int64)
        bad = (ids >= self.extent) | (ids < 0)
        if self.padding:
            bad &= ids != PADDING_ID
        if self.where is not None:
            bad &= self.where
        return bad


def check_ids(
    op: str,
    name: str,
    ids: torch.Tensor,
    extent: int | torch.Tensor,
    *,
    where: torch.Tensor | None = None,
    padding: bool = True,
    expected: str | None = None,
) -> None:
    """``ValueError`` unless every id (of the tokens in ``where``) is in ``[0, extent)``, or ``-1``.

    ``extent`` may be a tensor of per-token bounds (e.g. a chunk start must not pass its own token);
    ``expected`` then says in words what the bound is. Reads the ids on the host: CPU kernels and
    ``validate`` only.
    """
    checks = (IdCheck(name, ids, extent, where, padding, expected),)
    if bool(any_bad_ids(checks)):
        raise bad_ids_error(op, checks)


def any_bad_ids(checks: Sequence[IdCheck]) -> torch.Tensor:
    """Whether any of the checks fails, as a bool tensor on the ids' device (no host read yet).

    A PyTorch kernel reads it once for all its ids, in its own code (``if bool(any_bad_ids(checks))``):
    compiled, that read is the kernel's one graph break, and it stays in the kernel's frame (a break
    inside a helper would split the caller's graph at the call as well).
    """
    return torch.stack([check.bad().any() for check in checks]).any()


def bad_ids_error(op: str, checks: Sequence[IdCheck]) -> ValueError:
    """The ``ValueError`` of the first failing check, in order: the ids and the tokens that hold them.

    A check after a failing one may see ids derived from bad ones; kernels clamp their gathers so that
    computing such ids cannot fail before this error is raised.
    """
    check = next(c for c in checks if bool(c.bad().any()))
    tokens = check.bad().nonzero().squeeze(1)[:8]
    expected = check.expected or f"{'-1 or ' if check.padding else ''}in [0, {check.extent})"
    return ValueError(
        f"{op}: {check.name} must be {expected}; got {check.ids[tokens].tolist()} at tokens {tokens.tolist()}"
    )


def error_counter(device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed int32 ``[1]`` counter to pass as an op's ``errors``: after the step it holds the number of
    tokens whose ids a Triton kernel masked off (always 0 on CPU, where the op raises instead). ``ValueError``
    for a CUDA device where this torch build sees none (torch raised an ``AssertionError``)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"error_counter: device {device} is CUDA, but this torch build sees no CUDA device")
    return torch.zeros(1, dtype=torch.int32, device=device)

