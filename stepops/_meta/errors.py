"""The argument checks every op wrapper shares: the optional ``errors`` counter (see ``stepops.ops.bounds``)
and the wrappers' argument types (:func:`check_arg_types`)."""

from __future__ import annotations

import torch

from stepops.specs import check_fits_int64, is_int


def check_errors_arg(op: str, errors: torch.Tensor | None, device: torch.device) -> None:
    """``TypeError``/``ValueError`` unless ``errors`` is None or an int32 ``[1]`` tensor on ``device``."""
    if errors is None:
        return
    if errors.dtype != torch.int32:
        raise TypeError(f"{op}: errors must be an int32 counter (stepops.error_counter()), got {errors.dtype}")
    if errors.shape != (1,) or errors.device != device:
        raise ValueError(
            f"{op}: errors must be an int32 [1] tensor on {device} (stepops.error_counter()); got shape "
            f"{tuple(errors.shape)} on {errors.device}"
        )


def check_arg_types(
    op: str,
    tensors: tuple[tuple[str, object], ...],
    ints: tuple[tuple[str, object], ...] = (),
    bools: tuple[tuple[str, object], ...] = (),
) -> None:
    """``TypeError`` naming the first argument of a public wrapper that has the wrong Python type.

    Run before the dispatcher, which would turn a non-tensor into a ``RuntimeError`` ("Expected a value of
    type 'Tensor'"), let ``None`` through to fail as an ``AttributeError`` in the checks, and silently turn
    a bool into the int ``1``. ``tensors`` must be tensors (``errors`` is checked by the wrapper as optional),
    ``ints`` :func:`~stepops.specs.is_int` (never bools or enum members: ``stream_offset=InklingStream.V``
    would be the offset 1, not V's), ``bools`` bools. A Python int outside int64, which
    the schema's ``SymInt`` cannot hold, is a ``ValueError`` (the dispatcher's reads "Expected a value of
    type 'int' ... found type 'int'").
    """
    for name, value in tensors:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    for name, value in ints:
        if not is_int(value):
            raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
        check_fits_int64(f"{op}: {name}", value)
    for name, value in bools:
        if not isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")
