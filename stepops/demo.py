"""``python -m stepops demo``: both model stacks through a scripted multi-request workload, checked.

A 2-layer Step5 stack (a sliding-window layer and a CSA layer) and a 2-layer Inkling stack (sliding-window
and global) run the same kind of workload: several requests, prompts split into prefill chunks, then plain
decode and speculative verify steps whose rejected drafts the next step overwrites. Each model runs eagerly,
compiled with ``torch.compile(fullgraph=True)`` and, with a GPU, replayed from CUDA graphs; every run's
committed outputs are compared with a full recompute of the committed sequences without caches.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
from stepops.models.reference import model_reference
from stepops.models.runner import COMPILED, CUDA_GRAPH, EAGER, StepRunner, Workload, run_workload
from stepops.testing.tolerances import TOLERANCES

WORKLOAD = Workload()
_MODELS: tuple[tuple[str, Callable[[], torch.nn.Module]], ...] = (
    ("step5", lambda: Step5Model(Step5Config())),
    ("inkling", lambda: InklingModel(InklingConfig())),
)


def _say(text: str) -> None:
    print(text, flush=True)


class _Ticker:
    """Prints the elapsed time every ``every`` seconds while a long call (a compile) runs."""

    def __init__(self, label: str, every: float = 10.0) -> None:
        self.label, self.every = label, every
        self._stop = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            _say(f"    ... {self.label}: {time.perf_counter() - self._start:.0f} s")

    def __enter__(self) -> _Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _max_error(model: torch.nn.Module, result) -> tuple[float, bool]:
    """Largest ``|incremental - recompute|`` over committed outputs, and whether all are inside the bound."""
    tol = TOLERANCES["model_vs_recompute"]
    worst, inside = 0.0, True
    for x, y in zip(result.inputs, result.outputs):
        want = model_reference(model, x.to(next(model.parameters()).device)).cpu().float()
        err = (y.float() - want).abs()
        worst = max(worst, float(err.max()))
        inside &= bool((err <= tol.atol + tol.rtol * want.abs()).all())
    return worst, inside


def _run_mode(name: str, make: Callable[[], torch.nn.Module], mode: str, device: torch.device, backend: str) -> dict:
    torch.manual_seed(0)  # every mode gets the same weights
    with device:
        model = make()
    runner = StepRunner(
        model,
        max_requests=len(WORKLOAD.prompt_lens),
        max_model_len=WORKLOAD.max_len,
        max_tokens=WORKLOAD.token_budget,
        device=device,
        mode=mode,
        compile_backend=backend,
    )
    counters.clear()
    warm_start = time.perf_counter()
    if mode == EAGER:
        runner.warm_up()  # padding-only steps: first-call costs stay out of the timed run, as for the others
    else:
        what = f"compiling {name} ({backend}, fullgraph)" if mode == COMPILED else f"capturing {name} CUDA graphs"
        _say(f"  {what}, padded sizes T = {', '.join(map(str, runner.capture_sizes))}")
        with _Ticker(what):
            runner.warm_up(lambda msg: _say(f"    {msg}  ({time.perf_counter() - warm_start:.0f} s)"))
    warm_seconds = time.perf_counter() - warm_start
    result = run_workload(runner, WORKLOAD, model.config.hidden_size)
    err, inside = _max_error(model, result)
    row = {
        "mode": mode,
        "steps": result.steps,
        "tokens": result.tokens,
        "verify_turns": result.verify_turns,
        "rejected_tokens": result.rejected_tokens,
        "seconds": round(result.seconds, 3),
        "warm_up_seconds": round(warm_seconds, 3),
        "max_abs_err_vs_recompute": err,
        "within_bound": inside,
    }
    if mode == COMPILED:
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["recompiles"] = max(counters["stats"]["unique_graphs"] - 1, 0)
    _say(f"  {name} {mode}: {result.steps} steps, {result.tokens} tokens, {result.seconds:.2f} s, max err {err:g}")
    return row


def run_demo(*, json_path: str | None = None, device: str = "auto", backend: str = "inductor") -> int:
    """Run the demo; print the table; write ``json_path``; return 0 when every check passed, else 1."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    modes = [EAGER, COMPILED] + ([CUDA_GRAPH] if dev.type == "cuda" else [])
    w = WORKLOAD
    _say(
        f"stepops demo on {dev}: {len(w.prompt_lens)} requests, prompts {w.prompt_lens}, decode {w.decode_lens}, "
        f"k = {w.num_speculative_tokens} speculative tokens, {w.token_budget}-token step budget"
    )
    report: dict[str, dict] = {}
    for name, make in _MODELS:
        _say(f"{name}:")
        rows = {mode: _run_mode(name, make, mode, dev, backend) for mode in modes}
        compiled = rows[COMPILED]
        report[name] = {
            "graph_breaks": compiled["graph_breaks"],
            "recompiles": compiled["recompiles"],
            "max_abs_err_vs_recompute": max(r["max_abs_err_vs_recompute"] for r in rows.values()),
            "steps": rows[EAGER]["steps"],
            "tokens": rows[EAGER]["tokens"],
            "eager_seconds": rows[EAGER]["seconds"],
            "compiled_seconds": compiled["seconds"],
            "compile_seconds": compiled["warm_up_seconds"],
            "within_bound": all(r["within_bound"] for r in rows.values()),
            "modes": rows,
        }
        if CUDA_GRAPH in rows:
            report[name]["cudagraph_seconds"] = rows[CUDA_GRAPH]["seconds"]
    _print_table(report)
    ok = all(r["graph_breaks"] == 0 and r["recompiles"] == 0 and r["within_bound"] for r in report.values())
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": str(dev), "backend": backend, "bound": TOLERANCES["model_vs_recompute"].__dict__,
                       "models": report, "ok": ok}, f, indent=2)
        _say(f"wrote {json_path}")
    _say("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def _print_table(report: dict[str, dict]) -> None:
    tol = TOLERANCES["model_vs_recompute"]
    header = ("model", "mode", "steps", "tokens", "seconds", "max |err| vs recompute", "in bound", "graph breaks", "recompiles")
    lines = [header]
    for name, r in report.items():
        for mode, row in r["modes"].items():
            lines.append((
                name, mode, str(row["steps"]), str(row["tokens"]), f"{row['seconds']:.2f}",
                f"{row['max_abs_err_vs_recompute']:g}", "yes" if row["within_bound"] else "NO",
                str(row.get("graph_breaks", "-")), str(row.get("recompiles", "-")),
            ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    _say("")
    for i, line in enumerate(lines):
        _say("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(line)))
        if i == 0:
            _say("  ".join("-" * wd for wd in widths))
    _say(f"\nbound: |err| <= {tol.atol} + {tol.rtol} * |recompute| per element (stepops.testing.TOLERANCES"
         "['model_vs_recompute']); CPU eager is bitwise (0).")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo())
