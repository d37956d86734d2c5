"""``python -m benchmarks static [--json PATH]``: what the GPU compiler makes of every Triton kernel, and what
that predicts for a decode step. No GPU needed: kernels are compiled, never run.

1. :func:`stepops.testing.gpu_build.format_table` for every kernel configuration the samples reach and the
   configurations of the benchmarks' decode steps at model shapes (64 and 256 requests, one token each):
   registers, stack, spills, shared memory, occupancy on an H100/H200 SM, barriers, the memory round
   trips a thread waits for in turn and the longest address chain of global loads (both read off the
   SASS by :func:`stepops.testing.gpu_build.load_chains`), and load/store widths.
2. Per op and decode step, an estimate of one launch on an H200:
   ``launch + round trips x memory latency + floor bytes / bandwidth`` (the constants below), and the
   share of the byte floor it reaches, ``(floor bytes / bandwidth) / estimate``. At decode a kernel moves
   a few hundred KiB at most, 0.01-0.2 µs at 4.8 TB/s: the launch and the round trips decide.
3. The same estimate for ``csa_ring_update``'s kernel before issue 16 (``static_baseline.json``, measured
   the same way on the kernel of commit 9f6760b), and the ratio.

Interpreted kernels cannot be compiled, so when ``TRITON_INTERPRET`` is set this re-runs itself in a child
process without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

# The estimate's constants (an H200; stated assumptions: benchmarks/gpu_check.sh measures real launches):
# - the cost of one kernel in a step, launch latency and grid drain: of the order of 2 µs between dependent
#   kernels on H100-class GPUs launched from the host, somewhat less under CUDA-graph replay (an assumption
#   until benchmarks/gpu_check.sh measures it; docs/performance.md gives the ratios at 0 and 1 µs too);
LAUNCH_US = 2.0
# - one global-memory round trip: HBM3/HBM3e latency on H100-class GPUs is 0.45-0.6 µs idle (pointer
#   chasing, about 800-1000 cycles), more under load: 0.6 µs;
MEMORY_LATENCY_US = 0.6
# - the H200's HBM3e datasheet bandwidth: 4.8 TB/s.
BANDWIDTH_BYTES_PER_US = 4.8e12 / 1e6
TARGET = "sm_90a"
DECODE_REQUESTS = (64, 256)
BASELINE = Path(__file__).with_name("static_baseline.json")


def _decode_workloads():
    """(op, case, Workload) of every op's benchmark at the decode steps of DECODE_REQUESTS."""
    import torch

    from benchmarks.harness import OP_MODULES, load_module
    from benchmarks.steps import decode

    for op in OP_MODULES:
        module = load_module(op)
        for requests in DECODE_REQUESTS:
            case = decode(requests)
            yield op, case, module.build(case, torch.device("cpu"))


def _latency_us(round_trips: int) -> float:
    """What one kernel launch waits for besides moving bytes: ``LAUNCH_US + round_trips * MEMORY_LATENCY_US``."""
    return LAUNCH_US + round_trips * MEMORY_LATENCY_US


def _estimate(op: str, case, floor_bytes: int, kernels: list[dict]) -> dict:
    """One row: the op's kernels at this step, each paying its own launch and round trips, plus the op's
    byte floor at the bandwidth."""
    floor_us = floor_bytes / BANDWIDTH_BYTES_PER_US
    total = sum(_latency_us(k["load_round_trips"]) for k in kernels) + floor_us
    return {
        "op": op,
        "case": case.name,
        "decode_tokens": case.num_tokens,
        "kernels": [k["kernel"] for k in kernels],
        "registers": max(k["registers"] for k in kernels),
        "occupancy": min(k["occupancy"] for k in kernels),
        "round_trips": sum(k["load_round_trips"] for k in kernels),
        "dependent_load_chain": max(k["load_address_chain"] for k in kernels),
        "floor_bytes": floor_bytes,
        "floor_us": floor_us,
        "estimated_us": total,
        "floor_percent": 100 * floor_us / total,
    }


def report() -> dict:
    """Compile everything and estimate; the JSON ``--json`` writes."""
    import torch

    from stepops.testing.gpu_build import OpCall, build_all

    torch.manual_seed(0)
    decode = list(_decode_workloads())
    builds = build_all(tuple(OpCall(op, case.name, w.args, {}) for op, case, w in decode))
    rows = [dict(dataclasses.asdict(b), occupancy=b.occupancy) for b in builds]
    estimates = []
    for op, case, workload in decode:
        kernels = [r for r in rows if r["op"] == op and r["shapes"] == case.name and r["target"] == TARGET]
        estimates.append(_estimate(op, case, workload.floor_bytes, kernels))
    baseline = json.loads(BASELINE.read_text())
    before = []
    for record in baseline["kernels"]:
        for op, case, workload in decode:
            if op == record["op"]:
                old = _estimate(op, case, workload.floor_bytes, [record])
                new = next(e for e in estimates if e["op"] == op and e["case"] == case.name)
                before.append({**old, "baseline": baseline["measured"],
                               "new_over_before": new["floor_percent"] / old["floor_percent"]})
    return {
        "constants": {"launch_us": LAUNCH_US, "memory_latency_us": MEMORY_LATENCY_US,
                      "bandwidth_bytes_per_us": BANDWIDTH_BYTES_PER_US, "target": TARGET,
                      "estimated_us": "sum over the op's kernels of (launch_us + round_trips x memory_latency_us)"
                                      " + floor_bytes / bandwidth",
                      "dependent_load_chain": "the longest in any of the op's kernels",
                      "floor_percent": "100 x (floor_bytes / bandwidth) / estimated_us"},
        "builds": rows,
        "estimates": estimates,
        "before": before,
        "problems": [p for b in builds for p in b.problems],
    }


def format_estimates(result: dict) -> str:
    c = result["constants"]
    lines = [
        f"Estimated time of one decode launch on {c['target']} (H200): {c['launch_us']} µs launch + round trips x "
        f"{c['memory_latency_us']} µs + floor bytes / {c['bandwidth_bytes_per_us'] / 1e6:.1f} TB/s",
        f"{'op':<16} {'case':<12} {'kernel':<26} {'regs':>4} {'occ':>4} {'trips':>5} {'chain':>5} {'floor KiB':>9} "
        f"{'floor µs':>8} {'est. µs':>7} {'% floor':>7}",
    ]

    def line(e: dict, label: str) -> str:
        return (f"{e['op']:<16} {e['case']:<12} {label:<26} {e['registers']:>4} {e['occupancy']:>4.0%} "
                f"{e['round_trips']:>5} {e['dependent_load_chain']:>5} {e['floor_bytes'] / 1024:>9.1f} {e['floor_us']:>8.3f} "
                f"{e['estimated_us']:>7.2f} {e['floor_percent']:>6.2f}%")

    lines += [line(e, "+".join(e["kernels"])) for e in result["estimates"]]
    for e in result["before"]:
        lines.append(line(e, f"before ({e['baseline']['commit']})") + f"   new / before: {e['new_over_before']:.1f}x")
    return "\n".join(lines)


def main(json_path: Path | None = None) -> int:
    from stepops._triton import interpreting

    if interpreting():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = Path(__file__).resolve().parent.parent
        extra = ["--json", str(Path(json_path).resolve())] if json_path else []  # the child runs in root
        return subprocess.run([sys.executable, "-m", "benchmarks", "static", *extra], env=env, cwd=root).returncode

    from stepops.testing.gpu_build import KernelBuild, format_table

    result = report()
    fields = {f.name for f in dataclasses.fields(KernelBuild)}
    print(format_table([KernelBuild(**{k: v for k, v in r.items() if k in fields}) for r in result["builds"]]))
    print()
    print(format_estimates(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    for problem in result["problems"]:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if result["problems"] else 0
