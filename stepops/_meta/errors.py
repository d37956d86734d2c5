"""The optional ``errors`` counter every op takes (see ``stepops.ops.bounds``): its argument check."""

from __future__ import annotations

import torch


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
