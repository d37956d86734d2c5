"""Memory safety of every op: one rule for every id that a kernel turns into an address.

An id read from data (a slot, a block, a request, a ring row, a summary slot, a row of the step) is either
``-1`` where the op documents it (padding: nothing is read or written for it) or inside the extent of the
tensor it addresses. Nothing else may reach memory, however wrong the metadata:

- PyTorch kernels call :func:`check_ids` on every such id before they write anything, so a bad id is a
  ``ValueError`` naming the op, the argument and what is expected, and every byte of every argument is
  left as it was (the CPU path can afford the host read).
- Triton kernels cannot raise without a host sync. They mask every address to its tensor's extent (a bad
  id writes nothing and reads zeros) and add one per token with a bad id to the optional ``errors``
  counter, an int32 ``[1]`` tensor on the device that the caller reads after the step
  (:func:`error_counter`, ``stepops.ops.triton_bounds``).
"""

from __future__ import annotations

import torch

# What an op's ids may be: -1 (documented padding) or an index into the tensor they address.
PADDING_ID = -1


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
    ids = ids.to(torch.int64)
    bad = (ids >= extent) | (ids < 0)
    if padding:
        bad &= ids != PADDING_ID
    if where is not None:
        bad &= where
    if bool(bad.any()):
        tokens = bad.nonzero().squeeze(1)[:8]
        if expected is None:
            expected = f"{'-1 or ' if padding else ''}in [0, {extent})"
        raise ValueError(
            f"{op}: {name} must be {expected}; got {ids[tokens].tolist()} at tokens {tokens.tolist()}"
        )


def error_counter(device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed int32 ``[1]`` counter to pass as an op's ``errors``: after the step it holds the number of
    tokens whose ids a Triton kernel masked off (always 0 on CPU, where the op raises instead)."""
    return torch.zeros(1, dtype=torch.int32, device=device)

