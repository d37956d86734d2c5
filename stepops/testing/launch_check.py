"""Check on a CPU-only machine that :class:`~stepops.ops.triton_launch.CachedLaunch` launches what
``JITFunction.run`` launches, and time both.

A stand-in for Triton's CUDA driver (device 0, one stream, the sm_90 target) and for its compiler (one
stub kernel per Triton cache key, no code generated) let the real Triton runtime run without a GPU: its
binder, specialisation, cache keys and knobs decide which stub kernel a call gets, and each stub's
launcher records what it is given instead of launching. :func:`compare_paths` runs every call three
times, through the table (filling it), through the table again (every launch must now come from it), and
through ``kernel[grid]``, and compares the recorded launches call by call: the stub kernel (that is,
Triton's cache key), the grid, the stream, the launch hooks and every argument. A table key coarser than
Triton's specialisation would hand a later call an earlier call's kernel, which the third pass shows.

Must run in a process without ``TRITON_INTERPRET`` and without a visible GPU
(``python -m stepops.testing.launch_check``; ``--time`` prints the launchers' host time through both
paths instead; the test runs it in a subprocess), like :mod:`stepops.testing.gpu_build`.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import timeit
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stepops._triton import interpreting

_STREAM = 0x5EED  # the stand-in driver's one stream


@dataclass(frozen=True)
class LaunchCall:
    """One call of a launcher (an op's Triton kernel, or a :class:`CachedLaunch`): a label for reports,
    positional and keyword arguments."""

    label: str
    launch: Callable[..., Any]
    args: tuple
    kwargs: dict


class _StubKernel:
    """What Triton's cache holds for one key: the attributes a launch reads, and a launcher that records."""

    def __init__(self, name: str, key: str, device: int, launches: list) -> None:
        self.key = key
        self.function = f"{name} on {device}: {key}"  # a compiled kernel's handle: what it was built for
        self.packed_metadata = ("packed", key)
        self._launches = launches

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *launch: Any) -> None:
        self._launches.append((self.key, *launch))


def _fingerprint(value: Any, origin: dict[int, int]) -> Any:
    """A tensor as what a launch depends on: dtype, shape, strides, offset in its storage, 16-byte
    alignment, and which of the call's tensor arguments it is (by address; None for one the launcher
    allocated or copied), which tells same-shaped arguments apart. Anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    where = origin.get(value.data_ptr())
    alignment = value.data_ptr() & 15
    return (value.dtype, tuple(value.shape), value.stride(), value.storage_offset(), alignment, where)


class _StandInDriver:
    """The parts of Triton's active driver that a launch reads; ``device`` is the current device."""

    device = 0

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> int:
        return _STREAM

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def stand_in_gpu() -> Iterator[list]:
    """Within: Triton launches on the stand-in driver and stub kernels; yields the list of recorded
    launches. Triton's kernel caches are left holding stub kernels only for the kernels launched within;
    run it in a process of its own."""
    if interpreting():
        raise RuntimeError("launch_check needs a process without TRITON_INTERPRET (kernels are interpreted)")
    if torch.cuda.is_available():  # stub kernels left in Triton's caches must never meet a real GPU
        raise RuntimeError("launch_check stands in for a GPU: run it with none visible (CUDA_VISIBLE_DEVICES=)")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    launches: list = []

    def stub_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _StubKernel(self.__name__, key, device, launches)
        self.device_caches[device][0][key] = kernel
        return kernel

    saved_driver, saved_compile = driver._active, JITFunction._do_compile
    driver.set_active(_StandInDriver())
    JITFunction._do_compile = stub_compile
    try:
        yield launches
    finally:
        driver._active, JITFunction._do_compile = saved_driver, saved_compile


@contextlib.contextmanager
def _counting_jit_runs() -> Iterator[list]:
    """Within: every ``JITFunction.run`` call is counted (appended to the yielded list)."""
    from triton.runtime.jit import JITFunction

    runs: list = []
    original = JITFunction.run

    def counted(self, *args, **kwargs):
        runs.append(self.__name__)
        return original(self, *args, **kwargs)

    JITFunction.run = counted
    try:
        yield runs
    finally:
        JITFunction.run = original


def _record(calls: Sequence[LaunchCall], launches: list) -> list[list]:
    """The launches each call made, fingerprinted."""
    recorded = []
    for call in calls:
        start = len(launches)
        call.launch(*call.args, **call.kwargs)
        tensors = [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, torch.Tensor)]
        origin = {t.data_ptr(): i for i, t in reversed(list(enumerate(tensors)))}
        recorded.append([tuple(_fingerprint(v, origin) for v in launch) for launch in launches[start:]])
    return recorded


def compare_paths(calls: Sequence[LaunchCall]) -> tuple[int, list[str]]:
    """Run ``calls`` through the table twice, then through ``kernel[grid]``: the number of launches
    ``kernel[grid]`` made, and one line per problem."""
    from stepops.ops.triton_launch import plain_launches

    problems = []
    with stand_in_gpu() as launches:
        filling = _record(calls, launches)
        with _counting_jit_runs() as runs:
            cached = _record(calls, launches)
        with plain_launches():
            plain = _record(calls, launches)
    if runs:
        problems.append(f"{len(runs)} launches of the second pass missed the table ({sorted(set(runs))})")
    for call, first, again, want in zip(calls, filling, cached, plain):
        for name, got in (("filling the table", first), ("from the table", again)):
            if got != want:
                problems.append(f"{call.label}: {name}: {_difference(got, want)}")
    return sum(map(len, plain)), problems


def _difference(got: list, want: list) -> str:
    """The first field in which two lists of launches differ."""
    if len(got) != len(want):
        return f"{len(got)} launches, kernel[grid] made {len(want)}"
    fields = ("kernel key", "grid x", "grid y", "grid z", "stream", "function", "packed metadata",
              "launch metadata", "enter hook", "exit hook")
    for launch, (a, b) in enumerate(zip(got, want)):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                name = fields[i] if i < len(fields) else f"argument {i - len(fields)}"
                return f"launch {launch}, {name}: {x!r} where kernel[grid] had {y!r}"
        if len(a) != len(b):
            return f"launch {launch}: {len(a)} fields, kernel[grid] passed {len(b)}"
    return "equal"


def sample_calls() -> list[LaunchCall]:
    """Every sample of every declared op (CPU tensors: only their pointers' values and alignment matter)."""
    from stepops._library import registered_ops

    return [
        LaunchCall(f"{entry.name}-{sample.name}", entry.triton_kernel, sample.args, sample.kwargs)
        for entry in registered_ops()
        for sample in entry.samples(torch.device("cpu"))
    ]


def misaligned_calls(calls: Sequence[LaunchCall]) -> list[LaunchCall]:
    """Each call once per positional tensor argument, with that tensor moved one element off its 16-byte
    alignment (same values and strides): Triton specialises on each pointer's alignment, so each variant
    may need a kernel of its own."""
    from stepops._library import guarded

    variants = []
    for call in calls:
        for i, arg in enumerate(call.args):
            if isinstance(arg, torch.Tensor) and arg.numel():
                args = (*call.args[:i], guarded(arg, pad=1), *call.args[i + 1 :])
                variants.append(LaunchCall(f"{call.label}[{i} misaligned]", call.launch, args, call.kwargs))
    return variants


def launcher_host_us(calls: Sequence[LaunchCall], number: int = 2000) -> list[dict]:
    """Per call, the launcher's host time through the table and through ``kernel[grid]`` (µs, best of 5
    rounds of ``number``), on the stand-in driver: Python work only, no launch."""
    from stepops.ops.triton_launch import plain_launches

    rows = []
    with stand_in_gpu():
        for call in calls:

            def run(call=call):
                call.launch(*call.args, **call.kwargs)

            run()
            cached = min(timeit.repeat(run, number=number, repeat=5)) / number * 1e6
            with plain_launches():
                plain = min(timeit.repeat(run, number=number, repeat=5)) / number * 1e6
            rows.append({"call": call.label, "plain_us": plain, "cached_us": cached})
    return rows


def scalar_calls() -> list[LaunchCall]:
    """Calls of a small kernel that differ in one argument at a time: each int argument across Triton's
    int classes (the constant 1, divisible by 16 or not, 32 or 64 bits), a bool, each constexpr, an
    option, each pointer's dtype and alignment. An op's launcher passes what its inputs dictate; these
    reach every position of the table's key."""
    import triton
    import triton.language as tl

    from stepops.ops.triton_launch import CachedLaunch

    @triton.jit
    def _scalars_kernel(x_ptr, y_ptr, a, b, c, flag, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i * a, tl.load(x_ptr + i * b + c) * SCALE, mask=(i < a) & flag)

    launch = CachedLaunch(_scalars_kernel)

    def on_device_1(*args, **kwargs):
        from triton.runtime import driver

        driver.active.device = 1
        try:
            launch(*args, **kwargs)
        finally:
            driver.active.device = 0
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    base = dict(args=(x, y, 3, 3, 3, True), kwargs=dict(SCALE=2, BLOCK=16, num_warps=1, enable_fp_fusion=False))
    variants = [("base", base)]
    for position in (2, 3, 4):
        for value in (1, 16, 17, -16, 2**31, 2**32 + 16, 2**63):
            args = list(base["args"])
            args[position] = value
            variants.append((f"argument {position} = {value}", dict(base, args=tuple(args))))
    variants.append(("flag False", dict(base, args=(*base["args"][:5], False))))
    for name, value in (("SCALE", 3), ("BLOCK", 32), ("num_warps", 2)):
        variants.append((f"{name} = {value}", dict(base, kwargs={**base["kwargs"], name: value})))
    variants.append(("x fp32", dict(base, args=(x.float(), *base["args"][1:]))))
    variants.append(("x misaligned", dict(base, args=(x[1:], *base["args"][1:]))))
    variants.append(("y misaligned", dict(base, args=(x, y[1:], *base["args"][2:]))))
    calls = [LaunchCall(f"scalars: {name}", launch, ((2,), *v["args"]), v["kwargs"]) for name, v in variants]
    return calls + [LaunchCall("scalars: base on device 1", on_device_1, ((2,), *base["args"]), base["kwargs"])]


def tensor_among_scalars_problems() -> list[str]:
    """A call that passes a tensor where the first call passed a scalar must be refused (a ``TypeError``):
    the table would key that tensor by identity and miss on every call. One line per problem."""
    base = scalar_calls()[0]  # a CachedLaunch of its own, empty
    grid, x, y, _, *scalars = base.args
    with stand_in_gpu():
        base.launch(*base.args, **base.kwargs)
        try:
            base.launch(grid, x, y, x, *scalars, **base.kwargs)
        except TypeError as error:
            return [] if "same 2 leading tensor arguments" in str(error) else [f"tensor among scalars: {error}"]
    return ["tensor among scalars: CachedLaunch keyed it instead of refusing it"]


def main(argv: Sequence[str] | None = None) -> int:
    """Compare the paths on every sample, its misaligned variants and the scalar calls; ``--time``
    instead prints each op's launcher host time through both paths (median over its samples)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--time"]:
        rows = launcher_host_us(sample_calls(), number=500)
        for op in sorted({r["call"].split("-")[0] for r in rows}):
            mine = [r for r in rows if r["call"].split("-")[0] == op]
            plain, cached = (statistics.median(r[k] for r in mine) for k in ("plain_us", "cached_us"))
            print(f"{op}: kernel[grid] {plain:.1f} us, CachedLaunch {cached:.1f} us ({len(mine)} samples)")
        return 0
    if argv:
        print("usage: python -m stepops.testing.launch_check [--time]", file=sys.stderr)
        return 2
    calls = sample_calls()
    calls += misaligned_calls(calls) + scalar_calls()
    launches, problems = compare_paths(calls)
    problems += tensor_among_scalars_problems()
    for line in problems:
        print(line)
    print(f"{len(calls)} calls, {launches} launches, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
