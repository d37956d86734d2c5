"""Build every stepops Triton kernel for real GPUs on a CPU-only machine and read what the hardware gets.

For each op, each sample input is pushed through the op's Triton launcher with ``JITFunction.run``
replaced by a recorder, so the launcher picks its grid and constexpr configuration exactly as it would on
a GPU, and Triton's own binder derives the argument signature and specialisations (pointer alignment,
divisibility) from the real sample tensors: no hand-kept signature lists. Every distinct configuration
is then compiled with ``triton.compile`` for sm_90a and sm_80, and the ``cuobjdump``/``nvdisasm`` shipped
in the Triton wheel report registers, stack, local memory (spills), shared memory and the width of every
global load and store in the SASS.

Must run in a process without ``TRITON_INTERPRET`` (interpreted kernels cannot be compiled):
``python -m stepops.testing.gpu_build`` prints the table; ``tests/test_gpu_build.py`` runs it in a
subprocess and snapshots it.

A launcher may allow spills or a stack for one of its kernels with a comment in its own source:
``# gpu-build: allow-spill <kernel_name>: <why>``.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# (name, compute capability): Hopper (H100/H200) and Ampere (A100).
TARGETS = (("sm_90a", 90), ("sm_80", 80))

# One Hopper SM: the limits the occupancy estimate uses (CUDA occupancy calculator, cc 9.0).
_SM90_REGISTERS = 65536
_SM90_MAX_WARPS = 64
_SM90_MAX_BLOCKS = 32
_SM90_SHARED_BYTES = 228 * 1024
_REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256

_ALLOW_SPILL = re.compile(r"#\s*gpu-build:\s*allow-spill\s+(\w+):\s*\S")


@dataclass(frozen=True)
class KernelBuild:
    """One compiled kernel configuration and what the compiler made of it."""

    op: str
    kernel: str
    config: str  # constexprs and launch options, e.g. "BLOCK_D=256 warps=4"
    target: str
    registers: int
    stack: int
    local_bytes: int
    shared_bytes: int
    num_warps: int
    global_loads: str  # e.g. "128x2 32x1": load widths in bits x count
    global_stores: str
    barriers: int  # BAR.SYNC in the SASS: a kernel that orders reads before stores must keep its barrier
    spill_allowed: bool

    @property
    def occupancy(self) -> float:
        """Fraction of an H100/H200 SM's warp slots these resources allow."""
        per_warp = -(-max(self.registers, 1) * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
        blocks = min(_SM90_MAX_BLOCKS, (_SM90_REGISTERS // per_warp) // self.num_warps)
        if self.shared_bytes:
            blocks = min(blocks, _SM90_SHARED_BYTES // self.shared_bytes)
        return min(blocks * self.num_warps, _SM90_MAX_WARPS) / _SM90_MAX_WARPS

    @property
    def problems(self) -> list[str]:
        if (self.local_bytes or self.stack) and not self.spill_allowed:
            return [f"{self.kernel} [{self.config}] on {self.target}: stack {self.stack} B, local "
                    f"{self.local_bytes} B (spills) with no '# gpu-build: allow-spill {self.kernel}: why' "
                    "comment at its launcher"]
        return []


@dataclass(frozen=True)
class _Launch:
    op: str
    launcher: object
    fn: object  # triton JITFunction
    args: tuple
    kwargs: dict


def _record_launches() -> list[_Launch]:
    """Run every sample through its op's Triton launcher, recording kernel launches instead of running."""
    from triton.runtime.jit import JITFunction

    from stepops._library import registered_ops
    from stepops.testing.registry import op_samples

    launches: list[_Launch] = []
    current: dict[str, object] = {}

    def record(fn, *args, grid, warmup, **kwargs):
        launches.append(_Launch(current["op"], current["launcher"], fn, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record
    try:
        for entry in registered_ops():
            current.update(op=entry.name, launcher=entry.triton_kernel)
            for _, args, kwargs in op_samples(op_name=entry.name):
                entry.triton_kernel(*args, **kwargs)
    finally:
        JITFunction.run = original
    return launches


def _bits(op: str) -> int:
    widths = re.findall(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}[widths[0]] if widths else 32


def _access_widths(sass: str, opcode: str) -> str:
    counts: dict[int, int] = {}
    for match in re.finditer(rf"\b{opcode}(\.[A-Z0-9.]+)?\b", sass):
        width = _bits(match.group(0))
        counts[width] = counts.get(width, 0) + 1
    return " ".join(f"{w}x{n}" for w, n in sorted(counts.items(), reverse=True)) or "-"


def _nvidia_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _compile(launch: _Launch, target_name: str, capability: int) -> KernelBuild:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = launch.fn
    target = GPUTarget("cuda", capability, 32)
    backend, bound, specialization, options, kwargs = _bind(launch, capability)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    except Exception as error:  # report which kernel and configuration failed, then fail
        raise RuntimeError(f"{launch.op}: {fn.__name__} [{_config(fn, constexprs, specialization, options)}] does not compile "
                           f"for {target_name}:\n{error}") from error
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([_nvidia_tool("nvdisasm"), "-c", cubin.name], check=True, capture_output=True,
                              text=True).stdout
    resources = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    allowed = {m.group(1) for m in _ALLOW_SPILL.finditer(inspect.getsource(launch.launcher))}
    return KernelBuild(
        op=launch.op,
        kernel=fn.__name__,
        config=_config(fn, constexprs, specialization, options),
        target=target_name,
        registers=int(resources.get("REG", 0)),
        stack=int(resources.get("STACK", 0)),
        local_bytes=int(resources.get("LOCAL", 0)),
        shared_bytes=max(int(resources.get("SHARED", 0)), int(compiled.metadata.shared)),
        num_warps=options.num_warps,
        global_loads=_access_widths(sass, "LDG"),
        global_stores=_access_widths(sass, "STG"),
        barriers=len(re.findall(r"\bBAR\.SYNC", sass)),
        spill_allowed=fn.__name__ in allowed,
    )


def _config(fn, constexprs: dict, specialization: list, options) -> str:
    """The kernel's declared ``tl.constexpr`` values and warps, then (after ``|``) the int arguments Triton
    specialised to the constant 1 (a unit stride, a single column), which also change the code."""
    consts = " ".join(f"{fn.params[path[0]].name}={value}" for path, value in sorted(constexprs.items())
                      if len(path) == 1 and fn.params[path[0]].is_constexpr)
    ones = [p.name for p, (kind, _) in zip(fn.params, specialization) if kind == "constexpr" and not p.is_constexpr]
    return f"{consts} warps={options.num_warps}".strip() + (f" | 1: {','.join(ones)}" if ones else "")


_BINDERS: dict[tuple[object, int], tuple[object, object]] = {}


def _bind(launch: _Launch, capability: int):
    """Triton's own argument binding for ``capability``: (backend, bound args, specialisation, options,
    kwargs). One binder per (kernel, target), as Triton's runtime keeps one per device."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    key = (launch.fn, capability)
    if key not in _BINDERS:
        backend = make_backend(GPUTarget("cuda", capability, 32))
        _BINDERS[key] = backend, create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    backend, binder = _BINDERS[key]
    kwargs = {"debug": False, **launch.kwargs}
    bound, specialization, options = binder(*launch.args, **kwargs)
    return backend, bound, specialization, options, kwargs


def unsupported_reason() -> str | None:
    """Why this Triton cannot run the check (it drives Triton's compile internals), or None."""
    try:
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as error:
        return f"Triton {_triton_version()} lacks an API the GPU-build check drives: {error}"
    if not hasattr(JITFunction, "_pack_args"):
        return f"Triton {_triton_version()} has no JITFunction._pack_args (the check is written for 3.8-3.9)"
    return None


def _triton_version() -> str:
    import triton

    return triton.__version__


def build_all() -> list[KernelBuild]:
    """Compile every distinct (kernel, configuration) reached by the samples for every target."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("gpu_build needs a process without TRITON_INTERPRET: interpreted kernels cannot "
                           "be compiled")
    reason = unsupported_reason()
    if reason:
        raise RuntimeError(reason)
    seen: dict[tuple, _Launch] = {}
    for launch in _record_launches():
        _, _, specialization, _, _ = _bind(launch, TARGETS[0][1])
        key = (launch.op, launch.fn.__name__, repr(specialization), repr(sorted(launch.kwargs.items())))
        seen.setdefault(key, launch)
    builds = [_compile(launch, name, cap) for launch in seen.values() for name, cap in TARGETS]
    # One row per distinct outcome: samples that differ only in alignment may compile identically.
    unique = {b: None for b in builds}
    return sorted(unique, key=lambda b: (b.op, b.kernel, b.config, b.target, b.global_loads))


def format_table(builds: list[KernelBuild]) -> str:
    header = ("op", "kernel", "config", "target", "regs", "stack", "local", "smem", "occupancy", "bar",
              "LDG bits", "STG bits")
    rows = [header] + [
        (b.op, b.kernel, b.config, b.target, str(b.registers), str(b.stack), str(b.local_bytes),
         str(b.shared_bytes), f"{b.occupancy:.0%}", str(b.barriers), b.global_loads, b.global_stores)
        for b in builds
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    """Print the table; ``--json PATH`` also writes every build's fields. Exit 1 on an unexplained spill."""
    import argparse
    import dataclasses
    import json

    parser = argparse.ArgumentParser(prog="python -m stepops.testing.gpu_build", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every build as a JSON list")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    builds = build_all()
    print(format_table(builds))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(b) for b in builds], indent=1))
    problems = [p for b in builds for p in b.problems]
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
