"""``python -m benchmarks static``: what the GPU compiler makes of every Triton kernel, and the bytes per launch.

Prints :func:`stepops.testing.gpu_build.format_table` (registers, stack, spills, shared memory, occupancy
on an H100/H200 SM, global load/store widths in the SASS, for sm_90a and sm_80, per kernel configuration
the samples reach) and, under each op's rows, the byte floor of one launch at the benchmark's model
shapes (the same floors ``python -m benchmarks`` divides by). Kernels are compiled, never run: no GPU
needed. Interpreted kernels cannot be compiled, so when ``TRITON_INTERPRET`` is set this re-runs itself
in a child process without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _floors(op: str) -> str:
    import torch

    from benchmarks.harness import load_module

    module = load_module(op)
    parts = []
    for case in module.cases(quick=True):
        floor = module.build(case, torch.device("cpu")).floor_bytes
        parts.append(f"{case.name} {floor / 1024:.1f} KiB")
    return ", ".join(parts)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = Path(__file__).resolve().parent.parent
        return subprocess.run([sys.executable, "-m", "benchmarks", "static"], env=env, cwd=root).returncode

    import torch

    from benchmarks.harness import OP_MODULES
    from stepops.testing.gpu_build import build_all, format_table

    torch.manual_seed(0)
    builds = build_all()
    lines = format_table(builds).splitlines()
    out = [lines[0]]
    ops = [b.op for b in builds]  # build_all sorts by op: each op's rows are consecutive
    for i, (line, op) in enumerate(zip(lines[1:], ops)):
        out.append(line)
        if i + 1 == len(ops) or ops[i + 1] != op:
            floors = _floors(op) if op in OP_MODULES else f"no benchmarks/bench_{op}.py"
            out.append(f"  -> {op}: bytes per launch (byte floor at the benchmark's model shapes): {floors}")
    print("\n".join(out))
    problems = [p for b in builds for p in b.problems]
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0
