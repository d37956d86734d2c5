"""Triton is optional: ``import stepops`` and every CPU path work without it (the idea of vLLM's
``HAS_TRITON`` guard, done once here instead of in every op).

``pyproject.toml`` installs Triton on Linux only. Each op names its Triton launcher by module and attribute
through :func:`triton_launcher`; the launcher's module (and with it ``triton``) is imported only when
Triton imports. Where it does not, the op's CUDA kernel is a stand-in that raises a ``RuntimeError`` naming
the op and the fix, so a CUDA call fails clearly while CPU calls, fakes and ``torch.compile`` tracing work.

Each launcher also runs with its tensors' GPU current (:func:`on_tensors_device`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
except ImportError as error:  # also a broken install: any import failure means no CUDA kernels
    HAS_TRITON = False
    TRITON_IMPORT_ERROR: str | None = f"{type(error).__name__}: {error}"
else:
    HAS_TRITON = True
    TRITON_IMPORT_ERROR = None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: ``TRITON_INTERPRET`` as Triton itself reads it (``1``,
    ``true``, ``on``...; ``0``, ``false``, ``off`` or unset compile). False without Triton."""
    return HAS_TRITON and triton.knobs.runtime.interpret


def triton_launcher(op: str, module: str, name: str) -> Callable[..., Any]:
    """The launcher ``module.name`` of op ``op`` (e.g. ``"stepops::sconv"``), or, without Triton, a
    stand-in with the same name that raises ``RuntimeError`` when called."""
    if HAS_TRITON:
        return on_tensors_device(getattr(importlib.import_module(module), name))

    def triton_missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{op}: the CUDA kernel is a Triton kernel ({module}.{name}) and Triton is not installed "
            f"({TRITON_IMPORT_ERROR}). Install it with `pip install triton` (Linux), or run on CPU."
        )

    triton_missing.__name__ = triton_missing.__qualname__ = name
    triton_missing.__module__ = module
    return triton_missing


def on_tensors_device(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch`` called with its first argument's GPU as the current device.

    A Triton kernel launches on the current device and its current stream, not on its tensors' device, and
    the dispatcher sets no device guard for a kernel registered from Python (native CUDA ops get one from
    codegen; vLLM's C++ ops take an ``OptionalCUDAGuard`` themselves). Without this, a call on ``cuda:1``
    tensors while ``cuda:0`` is current would run on GPU 0 with GPU 1's addresses. Every op checks that its
    tensors share one device, so the first one decides. The guard is entered only when the device differs:
    the usual call pays one ``current_device()`` read; CPU tensors (the interpreter) pass straight through.
    """

    @functools.wraps(launch)
    def launch_on_tensors_device(first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        index = first.get_device()
        if index < 0 or index == torch.cuda.current_device():
            return launch(first, *args, **kwargs)
        with torch.cuda.device(index):
            return launch(first, *args, **kwargs)

    return launch_on_tensors_device
