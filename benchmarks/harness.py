"""The one benchmark harness: providers, correctness checks, timing, byte floors, tables and result files.

Every ``benchmarks/bench_<op>.py`` module declares, for the stepops op of the same name:

- ``OP``: the op's name in the registry; ``FLOOR``: the byte-floor formula in words;
- ``cases(quick) -> list[Case]``: configurations (decode at 1..256 requests, verify with k = 3, prefill);
- ``build(case, device) -> Workload``: fresh, seeded inputs (the op's positional arguments) and the
  floor: each input read once, each output written once, counting only the cache rows actually touched;
- ``naive(*args)``: the op's naive reference, ``stepops.ops.<op>.reference`` (Python loops over tokens,
  one assignment per row): the same semantics as a naive PyTorch user would write them;
- optionally ``TOLERANCES``: ``{(provider, state): Tolerance}`` where a baseline computes with another
  arithmetic order than the op (otherwise results must be equal bit for bit) and ``extras(ctx)``:
  op-specific measurements.

Providers: ``stepops`` (the custom op called eagerly: the PyTorch kernel on CPU, the Triton kernel on
CUDA), ``naive`` and ``compiled`` (the op's PyTorch kernel under ``torch.compile``). Before a case is
timed, each baseline runs once on fresh inputs and its output and every byte of the storage behind every
argument the op mutates must equal the op's (a benchmark of a wrong baseline is worthless).

Host path (issue 16): each op's eager call against its no-op twin, the same schema registered the same
way (``stepops._library.register_op``) with a kernel that does nothing, and against the same twin
registered with ``torch.library.custom_op`` (the registration before); the bar is host path / twin <= 1.5
(see :func:`_host_cost` for what the host path is on CPU and CUDA). ``metadata_op_counts``: the aten ops
of one step's metadata build per model.

Times are medians: ``torch.utils.benchmark`` on CPU (one thread by default); ``triton.testing.do_bench``
on CUDA, and ``do_bench_cudagraph`` for the op replayed from a CUDA graph. Achieved bandwidth is ``floor / time``, also as a percentage
of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import csv
import importlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils.benchmark as torch_benchmark

from stepops._library import registered_op, written_arguments
from stepops.testing.storage import storage_bytes

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROVIDERS = ("stepops", "naive", "compiled")
# Issue 16: on CPU, the compiled PyTorch kernel at least this many times faster than the naive reference at
# decode with 256 requests and at prefill (see compiled_vs_naive).
COMPILED_SPEEDUP_BAR = 3.0
# The issue-16 bar for an eager call's host path: at most this many times its no-op twin's (host_cost_us).
HOST_PATH_BAR = 1.5
# Op benchmarks by op name; each module is benchmarks/bench_<op>.py.
OP_MODULES = ("csa_ring_update", "paged_kv_write", "sconv")


@dataclass(frozen=True)
class Case:
    """One configuration of an op: ``kind`` is decode, verify (k = 3) or prefill."""

    name: str
    kind: str
    num_requests: int
    num_tokens: int  # real tokens of the step (padding, if any, comes on top)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Workload:
    """Inputs of one case (the op's positional arguments) and the bytes the op must move."""

    args: tuple[Any, ...]
    floor_bytes: int


@dataclass
class Settings:
    device: torch.device
    quick: bool
    compile_backend: str = "inductor"
    min_run_time: float = 0.2  # seconds per CPU measurement
    tiny: bool = False  # one smallest case per op: the smoke test's configuration

    @property
    def size(self) -> str:
        """``tiny``, ``quick`` or ``full``: recorded in the report and naming its files, so that a smoke run
        never overwrites the results of a real one."""
        return "tiny" if self.tiny else "quick" if self.quick else "full"


# --------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timer(fn: Callable[[], Any]) -> torch_benchmark.Timer:
    return torch_benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())


def _wall_median_us(fn: Callable[[], Any], settings: Settings) -> float:
    """The median over blocks of back-to-back calls of the mean wall time of one call, after a warm-up
    call (a first call may compile or allocate)."""
    fn()
    _sync(settings.device)
    return 1e6 * _timer(fn).blocked_autorange(min_run_time=settings.min_run_time).median


def median_us(fn: Callable[[], Any], settings: Settings) -> float:
    """Median time of ``fn()`` in microseconds on the settings' device (on a GPU, Triton's ``do_bench``:
    kernel time, synchronised)."""
    if settings.device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, return_mode="median")
    return _wall_median_us(fn, settings)


def cudagraph_median_us(fn: Callable[[], Any]) -> tuple[float | None, str | None]:
    """Median of ``fn`` replayed from a CUDA graph, or ``(None, why)`` when it cannot be captured."""
    import triton.testing

    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, return_mode="median"), None
    except Exception as error:  # host syncs (.tolist()) or data-dependent shapes make capture fail
        torch.cuda.synchronize()
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def host_us(fn: Callable[[], Any], settings: Settings) -> float:
    """Host-side cost of one call in microseconds: the median over blocks of back-to-back calls of the mean
    wall time of one call.

    On CUDA the kernels of a tiny case finish faster than the host can launch them, so the loop's wall
    time is the host's; on CPU the call's whole time is host time.
    """
    return _wall_median_us(fn, settings)


def side_by_side_us(fns: Sequence[Callable[[], Any]], settings: Settings, rounds: int = 15) -> list[float]:
    """Host cost of one call of each of ``fns`` in microseconds (see :func:`host_us`), measured in turns:
    each round times a block of calls of every function, so a change in the machine's load (2 shared cores
    here) falls on all alike; the fastest block of each (a burst of load slows some blocks, none speeds
    one up). For ratios of host paths."""
    timers = [_timer(fn) for fn in fns]
    for fn in fns:
        fn()
    _sync(settings.device)
    number = max(1, int(settings.min_run_time / rounds / (timers[0].timeit(100).mean * len(fns))))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for timer, times in zip(timers, samples):
            times.append(timer.timeit(number).mean)
            _sync(settings.device)
    return [1e6 * min(times) for times in samples]


def copy_bandwidth_gbps(settings: Settings) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time) of a buffer far larger than caches."""
    nbytes = (1 << 30) if settings.device.type == "cuda" else (256 << 20 if not settings.quick else 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=settings.device).random_()
    dst = torch.empty_like(src)
    seconds = 1e-6 * median_us(lambda: dst.copy_(src), settings)
    return 2 * nbytes / seconds / 1e9


# --------------------------------------------------------------------------------------------------------
# Correctness of the baselines
# --------------------------------------------------------------------------------------------------------


def _storage(tensor: torch.Tensor) -> torch.Tensor:
    """Every element of the storage behind ``tensor`` (a view's gaps included), flat, in its dtype."""
    flat = storage_bytes(tensor)
    return flat.view(tensor.dtype) if flat.numel() % tensor.element_size() == 0 else flat


def state_after(op: torch._ops.OpOverload, fn: Callable[..., Any], workload: Workload) -> dict[str, torch.Tensor]:
    """Run ``fn(*args)`` once; return its output and a copy of each mutated argument's whole storage."""
    out = fn(*workload.args)
    names = [a.name for a in op._schema.arguments]
    # An optional written argument left out (the ``errors`` counter) is not state.
    state = {names[i]: _storage(workload.args[i]).clone() for i in written_arguments(op)
             if i < len(workload.args) and workload.args[i] is not None}
    if isinstance(out, torch.Tensor):
        state["out"] = out.clone()
    return state


def check_equal(op_name: str, provider: str, got: dict, want: dict, tolerances: dict, device_type: str = "cpu") -> None:
    """Raise ``AssertionError`` unless ``got`` equals ``want``: bitwise, or within the op's stated tolerance.

    ``tolerances`` maps ``(provider, state)`` or, for one device type only, ``(provider, state, device_type)``
    to a :class:`stepops.testing.Tolerance`.
    """
    if got.keys() != want.keys():
        raise AssertionError(f"{op_name}/{provider}: state {sorted(got)} != {sorted(want)}")
    for name, expected in want.items():
        actual = got[name]
        tolerance = tolerances.get((provider, name, device_type), tolerances.get((provider, name)))
        if tolerance is None:
            same = actual.shape == expected.shape and torch.equal(
                actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
            )
            if not same:
                detail = f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
                if actual.shape == expected.shape:
                    wrong = (actual.view(torch.uint8) != expected.view(torch.uint8)).reshape(actual.shape[0], -1)
                    first = wrong.any(1).nonzero()[0, 0].item()
                    detail = (f"{int(wrong.any(1).sum())} rows differ; first {first}: "
                              f"{actual[first].flatten()[:4].tolist()} vs {expected[first].flatten()[:4].tolist()}")
                raise AssertionError(f"{op_name}/{provider}: {name} differs from the stepops op ({detail})")
        else:
            torch.testing.assert_close(
                actual.float(), expected.float(), atol=tolerance.atol, rtol=tolerance.rtol,
                msg=lambda m: f"{op_name}/{provider}: {name} outside its tolerance ({tolerance.why}): {m}",
            )


# --------------------------------------------------------------------------------------------------------
# Running one op
# --------------------------------------------------------------------------------------------------------


def load_module(name: str):
    return importlib.import_module(f"benchmarks.bench_{name}")


def run_op(name: str, settings: Settings, copy_gbps: float, log: Callable[[str], None]) -> dict[str, Any]:
    module = load_module(name)
    entry = registered_op(module.OP)
    op = entry.overload
    tolerances = getattr(module, "TOLERANCES", {})
    # The compiled baseline breaks its graph at the kernel's one host read (its bounds check), as the
    # report says; Dynamo's 12-line warning about that Tensor.item() is noise here.
    logging.getLogger("torch._dynamo.variables.tensor").setLevel(logging.ERROR)
    compiled_kernel = torch.compile(entry.torch_kernel, backend=settings.compile_backend, dynamic=True)
    providers: dict[str, Callable[..., Any]] = {
        "stepops": op,
        "naive": module.naive,
        "compiled": compiled_kernel,
    }
    cases = module.cases(settings.quick)
    if settings.tiny:
        cases = cases[:1]
    rows = []
    for case in cases:
        started = time.perf_counter()
        reference = state_after(op, op, module.build(case, settings.device))
        checked: dict[str, Any] = {}
        for provider in ("naive", "compiled"):
            got = state_after(op, providers[provider], module.build(case, settings.device))
            try:
                check_equal(name, provider, got, reference, tolerances, settings.device.type)
                checked[provider] = True
            except AssertionError as error:  # never time a wrong baseline; report it and go on
                checked[provider] = str(error).splitlines()[0]
                log(f"  CHECK FAILED, not timed: {checked[provider]}")
        del reference, got
        workload = module.build(case, settings.device)
        args = workload.args
        timed = {p: fn for p, fn in providers.items() if checked.get(p, True) is True}
        times = {p: median_us(lambda f=fn: f(*args), settings) if p in timed else None for p, fn in providers.items()}
        graph_times, graph_notes = {}, {}
        if settings.device.type == "cuda":
            # Only the op is built for capture. The baselines sync with the host (.tolist(), nonzero),
            # and a capture that fails that way can leave the context unusable for the rest of the run.
            graph_times["stepops"], note = cudagraph_median_us(lambda: op(*args))
            if note:
                graph_notes["stepops"] = note
            for p in ("naive", "compiled"):
                graph_times[p], graph_notes[p] = None, "not captured: host syncs (.tolist(), nonzero)"
        bandwidth = {p: workload.floor_bytes / t / 1e3 if t else None for p, t in times.items()}
        row = {
            **asdict(case),
            "floor_bytes": workload.floor_bytes,
            "checked": checked,
            "time_us": times,
            "bandwidth_gbps": bandwidth,
            "pct_copy_bandwidth": 100 * bandwidth["stepops"] / copy_gbps,
            "ratio_vs_stepops": {p: times[p] / times["stepops"] if times[p] else None for p in ("naive", "compiled")},
            "compiled_speedup_vs_naive": times["naive"] / times["compiled"] if times["naive"] and times["compiled"] else None,
        }
        if settings.device.type == "cuda":
            row["cudagraph_time_us"] = graph_times
            row["cudagraph_notes"] = graph_notes
        rows.append(row)
        log(f"  {name}/{case.name}: {times['stepops']:.1f} us ({time.perf_counter() - started:.1f} s)")

    host = _host_cost(module, entry, cases[0], settings)
    result = {"op": name, "floor": module.FLOOR, "cases": rows, "compiled_vs_naive": compiled_vs_naive(rows),
              "host_cost_us": host}
    if hasattr(module, "extras") and not settings.tiny:
        result["extras"] = module.extras(settings, median_us)
    return result


def compiled_vs_naive(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The compiled kernel's speedup over the naive reference in the cases the bar applies to (decode with
    at least 256 requests, and prefill), and whether each reaches ``COMPILED_SPEEDUP_BAR``; ``met`` is None
    when the run has no such case."""
    speedups = {r["name"]: r["compiled_speedup_vs_naive"] for r in rows
                if r["kind"] == "prefill" or (r["kind"] == "decode" and r["num_requests"] >= 256)}
    met = [s is not None and s >= COMPILED_SPEEDUP_BAR for s in speedups.values()]
    return {"bar": COMPILED_SPEEDUP_BAR, "speedups": speedups, "met": all(met) if met else None}


def failed_checks(report: dict[str, Any]) -> list[str]:
    """``op/case/provider`` of every baseline that failed its correctness check (and so was not timed)."""
    return [f"{r['op']}/{c['name']}/{p}" for r in report["ops"] for c in r["cases"]
            for p, ok in c["checked"].items() if ok is not True]


def _written(op: torch._ops.OpOverload) -> list[str]:
    return [op._schema.arguments[i].name for i in written_arguments(op)]


def _noop_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """A kernel that does nothing: returns None, or for an op that returns a tensor a new tensor shaped
    like its first argument (the allocation any such op makes)."""
    if not op._schema.returns:
        return lambda *args: None
    return lambda *args: torch.empty_like(args[0])


_TWINS: dict[tuple[str, str], torch._ops.OpOverload] = {}


def noop_twin(entry, how: str = "register_op") -> torch._ops.OpOverload:
    """The no-op twin of ``entry``'s op: its schema, registered the way stepops registers its ops
    (``stepops._library.register_op``: Library.define + CPU/CUDA/fake/Autograd); with ``how="checks"`` the
    same with the op's fake as its CPU and CUDA kernel (the argument checks and output allocation every
    kernel entry runs: the CPU stand-in for an eager call's host path); with ``how="custom_op"`` through
    ``torch.library.custom_op`` (stepops' registration until 2026-12, for the before/after)."""
    key = (entry.name, how)
    if key in _TWINS:
        return _TWINS[key]
    if how not in ("register_op", "checks", "custom_op"):
        raise ValueError(f"how must be 'register_op', 'checks' or 'custom_op', got {how!r}")
    written = _written(entry.overload)
    kernel = entry.fake if how == "checks" else _noop_kernel(entry.overload)
    if how == "custom_op":
        schema = torch.library.infer_schema(entry.torch_kernel, mutates_args=written)
        twin = torch.library.custom_op(
            f"stepops_twin_custom_op::{entry.name}", kernel, mutates_args=written, device_types="cpu",
            schema=schema,
        )  # fmt: skip
        twin.register_kernel("cuda", kernel)
        twin.register_fake(entry.fake)
        _TWINS[key] = getattr(torch.ops.stepops_twin_custom_op, entry.name).default
    else:
        from stepops._library import register_op

        namespace = "stepops_twin" if how == "register_op" else "stepops_twin_checks"
        _TWINS[key] = register_op(
            f"{namespace}::{entry.name}", mutates_args=written, torch_kernel=entry.torch_kernel,
            cpu_kernel=kernel, cuda_kernel=kernel, fake=entry.fake,
        )  # fmt: skip
    return _TWINS[key]


def _custom_op_twin_us(twin: torch._ops.OpOverload, args: tuple, settings: Settings) -> float | None:
    """The ``custom_op`` twin's call time, or None where torch cannot call it: torch 2.11's custom_op
    counts a write into every mutable argument by its place, and the dispatcher drops a trailing optional
    left at its default (``errors=None``), so the call fails there (IndexError) before any kernel."""
    try:
        twin(*args)
    except IndexError:
        return None
    return host_us(lambda: twin(*args), settings)


def _host_cost(module, entry, case: Case, settings: Settings) -> dict[str, Any]:
    """The host path of one eager call against the op's no-op twin, on the smallest case, under
    ``torch.inference_mode()`` as the models run (the dispatcher then skips the Autograd kernel).

    ``host_path_us`` is the eager call less the kernel's work on the tokens. On CUDA that is the call
    itself (the kernel runs asynchronously; the loop is host-bound). On CPU the PyTorch kernel's work is
    the call's, so the host path is measured as the op's registration running the argument checks and
    output allocation that every kernel entry runs, i.e. the op's fake registered as its kernel.
    ``host_path_vs_twin`` is the issue-16 bar (at most 1.5); the host path and the twin are timed in
    turns (:func:`side_by_side_us`), so that the ratio does not follow the machine's load.
    """
    args = module.build(case, settings.device).args
    kernel = entry.triton_kernel if settings.device.type == "cuda" else entry.torch_kernel
    twin = noop_twin(entry)
    custom_op_twin = noop_twin(entry, "custom_op")
    with torch.inference_mode():
        # Differences are of times measured in turns: apart, the machine's load made them negative.
        op_us, kernel_us = side_by_side_us([lambda: entry.overload(*args), lambda: kernel(*args)], settings)
        custom_op_twin_us = _custom_op_twin_us(custom_op_twin, args, settings)
        host_path = entry.overload if settings.device.type == "cuda" else noop_twin(entry, "checks")
        host_path_us, twin_us, checks_us = side_by_side_us(
            [lambda: host_path(*args), lambda: twin(*args), lambda: entry.fake(*args)], settings
        )
    return {
        "case": case.name,
        "op_us": op_us,
        "kernel_function_us": kernel_us,
        "dispatch_overhead_us": op_us - kernel_us,
        "kernel_function": f"{kernel.__module__}.{kernel.__name__}",
        "twin_us": twin_us,
        "custom_op_twin_us": custom_op_twin_us,
        "argument_checks_us": checks_us,
        "host_path_us": host_path_us,
        "host_path": "eager call" if settings.device.type == "cuda" else "registration + argument checks + outputs",
        "host_path_vs_twin": host_path_us / twin_us,
        "bar": HOST_PATH_BAR,
        "met": host_path_us / twin_us <= HOST_PATH_BAR,
    }


# --------------------------------------------------------------------------------------------------------
# Metadata builds: aten ops per model step
# --------------------------------------------------------------------------------------------------------


def count_aten_ops(fn: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """The aten ops ``fn()`` dispatches (each a kernel launch on a GPU), in total and by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return sum(counts.values()), dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def metadata_op_counts(device: torch.device, num_requests: int = 16) -> dict[str, Any]:
    """Aten ops of one decode step's metadata (``num_requests`` requests, one token each, padded to the
    runner's capture size) for each model, and of each builder on its own."""
    from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
    from stepops.models.metadata import build_inkling_metadata, build_step5_metadata
    from stepops.models.runner import ScheduledRequest, StepRunner
    from stepops.ops.csa_ring_update.metadata import build_csa_ring_metadata
    from stepops.ops.sconv.metadata import build_sconv_metadata
    from stepops.ops.step_metadata import build_token_metadata

    result: dict[str, Any] = {"num_requests": num_requests}
    for name, model_cls, config in (("step5", Step5Model, Step5Config()), ("inkling", InklingModel, InklingConfig())):
        torch.manual_seed(0)
        with torch.device(device):
            model = model_cls(config)
        runner = StepRunner(model, max_requests=num_requests, max_model_len=64, max_tokens=num_requests,
                            device=device, seed=0)
        hidden = model.config.hidden_size
        batch = [ScheduledRequest(r, 9 + r, torch.zeros(1, hidden, dtype=torch.bfloat16)) for r in range(num_requests)]
        for r in range(num_requests):
            runner.assume_fed(r, 9 + r)  # only the metadata are counted: no prefill needed
        size = runner.padded_size(runner._fill_buffers(batch))
        b = runner.buffers
        builders: dict[str, Callable[[], Any]] = {"token": lambda: build_token_metadata(b.query_start_loc, b.seq_lens, size)}
        if name == "step5":
            builders["step"] = lambda: build_step5_metadata(
                b, size, attn_block_size=model.attn_block_size, rows_per_block=model.rows_per_block,
                summary_block_size=model.summary_block_size,
            )
            builders["csa_ring_update"] = lambda: build_csa_ring_metadata(
                b.query_start_loc, b.seq_lens, b.ring_blocks, model.rows_per_block, b.summary_block_table,
                model.summary_block_size, size,
            )
        else:
            builders["step"] = lambda: build_inkling_metadata(
                b, size, attn_block_size=model.attn_block_size, conv_block_size=model.conv_block_size
            )
            builders["sconv"] = lambda: build_sconv_metadata(
                b.query_start_loc, b.seq_lens, b.conv_block_table, model.conv_block_size, size
            )
        counts = {}
        with torch.inference_mode():
            for builder, fn in builders.items():
                total, by_name = count_aten_ops(fn)
                counts[builder] = {"aten_ops": total, "by_op": by_name}
        result[name] = {"num_tokens": size, **counts}
    return result


def format_metadata_counts(result: dict[str, Any]) -> str:
    lines = [f"aten ops per metadata build (decode, {result['num_requests']} requests)"]
    for model in ("step5", "inkling"):
        counts = result[model]
        parts = ", ".join(f"{k} {v['aten_ops']}" for k, v in counts.items() if isinstance(v, dict))
        lines.append(f"  {model}: {parts}")
    return "\n".join(lines)


def format_host_costs(results: Sequence[dict[str, Any]]) -> str:
    lines = [f"host path of one eager call vs its no-op twin (inference mode, smallest case; bar: <= {HOST_PATH_BAR}x)"]
    for result in results:
        h = result["host_cost_us"]
        lines.append(
            f"  {result['op']}: host path {h['host_path_us']:.1f} us ({h['host_path']}) = "
            f"{h['host_path_vs_twin']:.2f}x twin {h['twin_us']:.1f} us; argument checks {h['argument_checks_us']:.1f} us; "
            f"custom_op twin {_fmt(h['custom_op_twin_us'], 1)} us; eager call {h['op_us']:.1f} us"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Machine, tables, files
# --------------------------------------------------------------------------------------------------------


def machine(settings: Settings) -> dict[str, Any]:
    info = {
        "device": str(settings.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "size": settings.size,  # tiny, quick or full
        "compile_backend": settings.compile_backend,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        # Other processes on a shared machine slow CPU figures down (and make OpenMP regions stall).
        "load_average_1min": os.getloadavg()[0],
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu"] = names[0]
    except OSError:
        pass
    if settings.device.type == "cuda":
        import triton

        info["gpu"] = torch.cuda.get_device_name(settings.device)
        info["triton"] = triton.__version__
    return info


def right_aligned(rows: list[list[str]]) -> list[str]:
    """``rows`` (the header first) as indented lines, each column right-aligned to its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_op_table(result: dict[str, Any]) -> str:
    cuda = any("cudagraph_time_us" in r for r in result["cases"])
    header = ["case", "R", "T", "floor KiB", "stepops us", "naive us", "compiled us"]
    if cuda:
        header += ["graph us"]
    header += ["GB/s", "% copy", "naive/stepops", "compiled/stepops", "naive/compiled"]
    rows = [header]
    for r in result["cases"]:
        t = r["time_us"]
        row = [r["name"], str(r["num_requests"]), str(r["num_tokens"]), _fmt(r["floor_bytes"] / 1024),
               _fmt(t["stepops"]), _fmt(t["naive"]), _fmt(t["compiled"])]
        if cuda:
            row.append(_fmt(r["cudagraph_time_us"].get("stepops")))
        row += [_fmt(r["bandwidth_gbps"]["stepops"], 2), _fmt(r["pct_copy_bandwidth"]),
                _fmt(r["ratio_vs_stepops"]["naive"], 2), _fmt(r["ratio_vs_stepops"]["compiled"], 2),
                _fmt(r["compiled_speedup_vs_naive"], 2)]
        rows.append(row)
    lines = [f"{result['op']}  (floor: {result['floor']})", *right_aligned(rows)]
    bar = result["compiled_vs_naive"]
    verdict = {True: "met", False: "NOT met", None: "no such case in this run"}[bar["met"]]
    speedups = ", ".join(f"{case} {_fmt(s, 1)}x" for case, s in bar["speedups"].items())
    lines.append(f"  compiled vs naive (bar: >= {bar['bar']:g}x at decode R >= 256 and prefill): "
                 f"{speedups or '-'}: {verdict}")
    h = result["host_cost_us"]
    lines.append(f"  host cost ({h['case']}): eager call {h['op_us']:.1f} us, kernel function "
                 f"{h['kernel_function_us']:.1f} us, dispatch {h['dispatch_overhead_us']:.1f} us; host path "
                 f"{h['host_path_us']:.1f} us = {h['host_path_vs_twin']:.2f}x its no-op twin ({h['twin_us']:.1f} us)")
    for name, extra in result.get("extras", {}).items():
        lines.append(f"  {name}: {extra['summary']}")
    return "\n".join(lines)


def write_csv(path: Path, results: Sequence[dict[str, Any]]) -> None:
    fields = ["op", "case", "kind", "requests", "tokens", "floor_bytes", "provider", "time_us",
              "cudagraph_time_us", "bandwidth_gbps", "ratio_vs_stepops"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for result in results:
            for r in result["cases"]:
                for p in PROVIDERS:
                    writer.writerow([
                        result["op"], r["name"], r["kind"], r["num_requests"], r["num_tokens"], r["floor_bytes"],
                        p, _fmt(r["time_us"][p], 3),
                        _fmt(r.get("cudagraph_time_us", {}).get(p), 3),
                        _fmt(r["bandwidth_gbps"][p], 4),
                        "1" if p == "stepops" else _fmt(r["ratio_vs_stepops"][p], 4),
                    ])


def write_plots(directory: Path, stem: str, results: Sequence[dict[str, Any]]) -> list[Path]:
    """One PNG per op: achieved bandwidth of each provider vs tokens per step. Needs matplotlib (optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for result in results:
        fig, ax = plt.subplots(figsize=(7, 4))
        for kind in sorted({r["kind"] for r in result["cases"]}):
            rows = sorted((r for r in result["cases"] if r["kind"] == kind), key=lambda r: r["num_tokens"])
            for p, style in zip(PROVIDERS, ("-o", "--s", ":^")):
                points = [(r["num_tokens"], r["bandwidth_gbps"][p]) for r in rows if r["bandwidth_gbps"][p]]
                ax.plot([x for x, _ in points], [y for _, y in points], style, label=f"{p} ({kind})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per step")
        ax.set_ylabel("GB/s of the byte floor")
        ax.set_title(result["op"])
        ax.legend(fontsize=7)
        path = directory / f"{stem}-{result['op']}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def save(report: dict[str, Any], json_path: Path | None, log: Callable[[str], None], results_dir: Path) -> None:
    """``<device>[-quick|-tiny].json`` and ``.csv`` (and PNG plots) in ``results_dir``; the JSON also at
    ``json_path``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    size = report["machine"]["size"]
    stem = report["machine"]["device"].split(":")[0] + ("" if size == "full" else f"-{size}")
    paths = [results_dir / f"{stem}.json", results_dir / f"{stem}.csv"]
    text = json.dumps(report, indent=1)
    paths[0].write_text(text)
    write_csv(paths[1], report["ops"])
    if json_path is not None:
        json_path.write_text(text)
        paths.append(json_path)
    paths += write_plots(results_dir, stem, report["ops"])
    log("wrote " + ", ".join(str(p) for p in paths))
