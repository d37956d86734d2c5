"""Launching the Triton kernels with less host work per call than ``kernel[grid](...)``.

An eager op call is host-bound on a GPU (docs/performance.md, "GPU figures"): most of its 20-130 µs is the
launcher, and most of the launcher is Triton's ``JITFunction.run``. Per call that reads knobs, the
current device and stream, runs the binder over every argument to derive its specialisation (pointer
dtype and 16-byte alignment; an int's width, divisibility by 16, or the constant 1), turns the result into
a string key, looks the compiled kernel up and only then launches it: 12-22 µs of Python on this project's
CPUs for 26-35 arguments, against ~0.5 µs for the call into the compiled kernel's launcher (measured with
a launcher that does nothing; the driver's launch comes on top of both).

:class:`CachedLaunch` asks Triton that question once per distinct call and remembers the answer. Its key
is the device, each pointer's dtype and whether it is 16-byte aligned, every other argument's value, and
the constexpr and option keywords: everything Triton's specialisation and options are derived from, and
finer (an int is kept by value, not by class). So two calls with one key get the same compiled kernel
from Triton, and a repeat can launch the kernel that the first call got, through that kernel's own
launcher, with the arguments ``JITFunction.run`` passes it: the bound arguments in the kernel's order,
the launch metadata, the launch hooks (so profilers still see the launch). The first call of a key goes
through ``JITFunction.run`` itself, which compiles when it must.

Not repeated on a hit: the check that the kernel's globals have not changed since it was compiled
(stepops kernels read only constants), pre-run hooks (stepops adds none), and a change to Triton's
``debug`` or instrumentation knobs made after a configuration's first call.

Under ``TRITON_INTERPRET=1`` the kernel is an interpreted function and every call takes the plain path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import triton.language as tl
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# Keys are exact argument values: a step size seen once (a prefill's last chunk) adds a key. Past this
# many the table starts again; the next call of each configuration pays one JITFunction.run.
MAX_KEYS = 1024


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for ints: ``triton.cdiv`` on the host, without the ~2 µs that a
    ``constexpr_function`` call costs there."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` for ``n >= 0`` (0 for 0), as ``triton.next_power_of_2``, in plain
    Python (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# The most elements one Triton tensor may hold (2**20 on Triton 3.6-3.9): a kernel that keeps a token's whole
# row in one program cannot be built past it, and Triton's compile error names no argument.
MAX_TILE_NUMEL = tl.TRITON_MAX_TENSOR_NUMEL


def tile_too_large(op: str, rows: int, columns: int, **sizes: int) -> NotImplementedError:
    """The error for a ``[rows, columns]`` tile past :data:`MAX_TILE_NUMEL`; ``sizes`` are the argument sizes
    that set it. A launcher compares first (``rows * columns > MAX_TILE_NUMEL``) and builds this only to
    raise it: the comparison is all a launch pays. The PyTorch kernels have no such limit."""
    named = ", ".join(f"{name} = {size}" for name, size in sizes.items())
    return NotImplementedError(
        f"{op}: {named} needs a [{rows}, {columns}] tile per program, more than the {MAX_TILE_NUMEL} elements "
        "a Triton tensor may hold: not implemented in the Triton kernel (the PyTorch kernel, the op's CPU path, "
        "runs it)"
    )


class CachedLaunch:
    """``kernel[grid](*args, **kwargs)`` through a table of the compiled kernels that earlier calls got.

    Call it as ``launch(grid, *args, **kwargs)``: ``grid`` a tuple of one to three ints, ``args`` the
    kernel's tensor arguments first, then its scalars, and ``kwargs`` its constexprs and launch options
    (``num_warps``, ``enable_fp_fusion``). A scalar is keyed by value, so each position must always get
    one Python type (``1``, ``1.0`` and ``True`` are equal keys but three Triton types); the launchers pass
    ints from shapes and strides, and the op wrappers refuse a bool for an int.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.fast = isinstance(kernel, JITFunction)  # an InterpretedFunction under TRITON_INTERPRET=1
        self._params = frozenset(kernel.signature.parameters) if self.fast else frozenset()
        self._num_tensors: int | None = None  # how many leading tensor arguments; set by the first call
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}

    def plain(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """The same launch through ``kernel[grid]``: every call through ``JITFunction.run``."""
        self.kernel[grid](*args, **kwargs)

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not self.fast:
            self.plain(grid, *args, **kwargs)
            return
        num_tensors = self._num_tensors
        if num_tensors is None:
            num_tensors = self._num_tensors = leading_tensors(self.kernel, args)
        active = driver.active
        device = active.get_current_device()
        key = (
            device,
            *[(t.dtype, t.data_ptr() & 15 == 0) for t in args[:num_tensors]],
            *args[num_tensors:],
            *kwargs.items(),
        )
        hit = self._compiled.get(key)
        if hit is None:
            self._first_call(key, grid, args, kwargs)
            return
        compiled, constexprs = hit
        stream = active.get_current_stream(device)
        values = (*args, *constexprs)
        compiled.run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            compiled.launch_metadata(grid, stream, *values),
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *values,
        )

    def _first_call(self, key: tuple, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        """Launch through ``JITFunction.run`` and remember the compiled kernel it used, with the values
        of the kernel's parameters after ``args`` (its constexprs, given or defaulted) in its order. The
        key took the first call's count of leading tensors: a call with another count is refused here (a
        tensor among the scalars would be keyed by identity and miss every time)."""
        if leading_tensors(self.kernel, args) != self._num_tensors:
            raise TypeError(
                f"CachedLaunch({self.kernel.__name__}): pass the same {self._num_tensors} leading tensor "
                "arguments on every call"
            )
        compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if getattr(compiled, "function", None) is None:  # no loaded kernel: a hook stopped the launch
            return
        bound = self.kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in self._params})
        bound.apply_defaults()
        if len(self._compiled) >= MAX_KEYS:
            self._compiled.clear()
        self._compiled[key] = compiled, tuple(bound.arguments.values())[len(args) :]


@contextlib.contextmanager
def plain_launches() -> Iterator[None]:
    """Within: every :class:`CachedLaunch` launches through ``kernel[grid]`` (:meth:`CachedLaunch.plain`),
    the path the table is compared with and that the build tooling records."""
    original = CachedLaunch.__call__
    CachedLaunch.__call__ = CachedLaunch.plain
    try:
        yield
    finally:
        CachedLaunch.__call__ = original


def leading_tensors(kernel: Any, args: tuple) -> int:
    """How many of ``args`` lead with tensors; a ``TypeError`` if a tensor follows a scalar (the key
    reads the leading tensors' pointers and takes the rest by value)."""
    count = 0
    while count < len(args) and isinstance(args[count], torch.Tensor):
        count += 1
    if any(isinstance(a, torch.Tensor) for a in args[count:]):
        raise TypeError(f"CachedLaunch({kernel.__name__}): pass the tensor arguments before the scalars")
    return count
