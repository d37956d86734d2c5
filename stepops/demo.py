"""``python -m stepops demo``: both model stacks through a scripted multi-request workload, checked.

A 2-layer Step5 stack (a sliding-window layer and a CSA layer) and a 2-layer Inkling stack (sliding-window
and global) run the same kind of workload: several requests, prompts split into prefill chunks, then plain
decode and speculative verify steps whose rejected drafts the next step overwrites. Each model runs eagerly,
compiled with ``torch.compile(fullgraph=True)`` and, with a GPU, replayed from CUDA graphs; every run's
compiled run and CUDA-graph replay must reproduce the eager run's committed outputs (within
``MODE_VS_EAGER_ATOL + MODE_VS_EAGER_RTOL * |eager|``), with no graph break and no recompile. Each model
then generates greedily from token ids, with and without drafts: the same tokens.

With ``tp > 1`` each stack runs on ``tp`` spawned local ranks (gloo on CPU, NCCL with one GPU per rank):
Inkling tensor-parallel (each rank a shard of every layer), Step5 expert-parallel (each rank its share of
the routed experts, the rest whole). Each rank loads its part of the same seeded weights, and every rank's
outputs are checked against the eager run of the unsharded model; every rank generates, and must emit the
same tokens as the others.

What the demo shows is that the stacks run, compile and capture as one graph and agree with themselves.
Whether they are right is the test suite's question: ``tests/models`` compares them with transformers'
Inkling and an independent Step5 recompute (``stepops.testing``), which this module does not import.
:func:`register` adds the ``demo`` subcommand to ``python -m stepops``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from stepops.models import InklingConfig, InklingModel, Step5Config, Step5ForCausalLM, Step5Model
from stepops.models.inkling import shard_inkling_state_dict
from stepops.models.runner import COMPILED, CUDA_GRAPH, EAGER, TOKENS, StepRunner, Workload, run_workload
from stepops.models.step5_weights import load_step5_state_dict
from stepops.models.tensor_parallel import spawn_ranks
from stepops.specs import check_int

WORKLOAD = Workload()
# Factories as partials, not lambdas: the tensor-parallel ranks receive theirs pickled.
_MODELS: tuple[tuple[str, Callable[[], torch.nn.Module]], ...] = (
    ("step5", partial(Step5ForCausalLM, Step5Config())),  # the stack on hidden inputs, and token ids for generation
    ("inkling", partial(InklingModel, InklingConfig())),
)
# A run in another mode (compiled, CUDA graph, tensor-parallel ranks) vs the eager single-process run, per
# element: |err| <= atol + rtol * |eager|. Fused kernels and per-rank bf16 partial sums round a stage one bf16
# ulp (2**-8 relative) apart, and a 2-layer stack compounds a few: 4 ulps (2**-6), and near 0 one ulp of the
# residual stream (|x| < 16: 2**-3). The test suite derives the same figures for its comparisons
# (stepops.testing.TOLERANCES: model_vs_recompute, tensor_parallel_vs_single_rank). A stale cache row, a
# wrong mask or a flipped CSA region choice is off by 0.1 or more.
MODE_VS_EAGER_ATOL, MODE_VS_EAGER_RTOL = 2**-3, 2**-6
# Step5 selects regions by top-k of e4m3-rounded scores: where a token's k-th and (k+1)-th scores are a near
# tie, a fused kernel's rounding may pick the other region, a correct choice that moves the token's output
# by O(1) (and every later row of its request when a later layer reads it). Such rows are counted, and may be
# at most this share of a stack's rows (the test suite, which has the recompute's scores, leaves out exactly
# the near ties: seen 0-5 of 93 rows on CPU). Inkling selects nothing: every row must be inside the bound.
STEP5_MAX_SHARE_OF_ROWS_OFF = 1 / 10


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




def _run_mode(
    name: str,
    make: Callable[[], torch.nn.Module],
    mode: str,
    device: torch.device,
    backend: str,
    workload: Workload,
    eager_outputs: list[torch.Tensor] | None,
    shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> tuple[dict, list[torch.Tensor]]:
    """Run ``workload`` through ``make()`` in ``mode``; with ``shard``, through ``shard(make())`` (this rank's
    tensor-parallel model). Returns the report row, checked against ``eager_outputs`` (the eager
    single-process run; ``None``: this is that run), and the committed outputs."""
    torch.manual_seed(0)  # every mode (and every rank) gets the same weights
    with device:
        model = make()
        if shard:
            model = shard(model)
    runner = StepRunner(
        model,
        max_requests=len(workload.prompt_lens),
        max_model_len=workload.max_len,
        max_tokens=workload.token_budget,
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
    result = run_workload(runner, workload, model.config.hidden_size)
    err, rows_off = _compare(result.outputs, eager_outputs or result.outputs)
    rows = sum(out.shape[0] for out in result.outputs)
    finite = all(bool(out.isfinite().all()) for out in result.outputs)
    row = {
        "mode": mode,
        "steps": result.steps,
        "tokens": result.tokens,
        "verify_turns": result.verify_turns,
        "rejected_tokens": result.rejected_tokens,
        "seconds": round(result.seconds, 3),
        "warm_up_seconds": round(warm_seconds, 3),
        "max_abs_err_vs_eager": err,
        "rows_off": rows_off,
        "rows": rows,
        "within_bound": within_bound(model, rows_off, rows, finite),
    }
    if mode == COMPILED:
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["recompiles"] = max(counters["stats"]["unique_graphs"] - len(runner.token_ranges), 0)
    _say(
        f"  {name} {mode}: {result.steps} steps, {result.tokens} tokens, {result.seconds:.2f} s"
        + (f", max |err| vs eager {err:g}, {rows_off} of {rows} rows outside the bound"
           if eager_outputs is not None else "")
        + ("" if finite else ", NON-FINITE outputs")
    )
    return row, result.outputs


def within_bound(model: torch.nn.Module, rows_off: int, rows: int, finite: bool) -> bool:
    """A mode's verdict against the eager run: finite outputs, and no row off (Inkling) or at most
    ``STEP5_MAX_SHARE_OF_ROWS_OFF`` of them (Step5, whose near-tie region choices may flip)."""
    allowed = STEP5_MAX_SHARE_OF_ROWS_OFF if isinstance(model, Step5Model) else 0.0
    return finite and rows_off <= allowed * rows


def _compare(outputs: list[torch.Tensor], eager: list[torch.Tensor]) -> tuple[float, int]:
    """Largest ``|outputs - eager|`` over every request's committed rows (NaN if any difference is), and the
    number of rows with an element not within ``MODE_VS_EAGER_ATOL + MODE_VS_EAGER_RTOL * |eager|``: a NaN
    on either side is outside, even compared with itself."""
    maxima, rows_off = [0.0], 0
    for got, want in zip(outputs, eager, strict=True):
        diff = (got.float() - want.float()).abs()
        if diff.numel():
            maxima.append(float(diff.max()))
        rows_off += int((~(diff <= MODE_VS_EAGER_ATOL + MODE_VS_EAGER_RTOL * want.float().abs())).any(-1).sum())
    return largest(maxima), rows_off


def largest(values: Iterable[float]) -> float:
    """The largest of ``values``, NaN if any is NaN: Python's ``max`` keeps or drops a NaN by its position."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _run_modes(name, make, modes, device, backend, workload, shard=None) -> dict[str, dict]:
    """The eager single-process run of ``make()``, then each of ``modes`` (of ``shard(make())`` with
    ``shard``) checked against it; the report rows by mode."""
    eager_row, eager_outputs = _run_mode(f"{name} (reference)" if shard else name, make, EAGER, device, backend,
                                         workload, None)
    rows = {} if shard else {EAGER: eager_row}
    for mode in modes:
        if mode != EAGER or shard:
            rows[mode], _ = _run_mode(name, make, mode, device, backend, workload, eager_outputs, shard)
    return rows


def _greedy_generation(name: str, make: Callable[[], torch.nn.Module], device: torch.device) -> dict:
    """Greedy generation on ``make()`` (embedding to logits per step): two prompts in one ragged batch, then
    again with drafts of 3 that are wrong on every other step; the emitted tokens must not change."""
    torch.manual_seed(0)
    with device:
        model = make()
    prompts, new_tokens = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [27, 18, 28]], 16

    def runner() -> StepRunner:
        return StepRunner(model, max_requests=2, max_model_len=32, max_tokens=16, device=device, inputs=TOKENS)

    plain = runner()
    tokens = plain.generate(prompts, new_tokens)

    def draft(i: int, seq: list[int]) -> list[int]:
        done = len(seq) - len(prompts[i])
        return [(t + done % 2) % model.config.vocab_size for t in tokens[i][done : done + 3]]

    drafted = runner()
    same = drafted.generate(prompts, new_tokens, draft=draft) == tokens
    _say(f"  {name} greedy generation: {new_tokens} tokens x 2 prompts in {plain.steps} steps; with drafts "
         f"{drafted.steps} steps, {'the same' if same else 'DIFFERENT'} tokens")
    return {"new_tokens": new_tokens, "steps": plain.steps, "draft_steps": drafted.steps, "same_with_drafts": same,
            "tokens": tokens}


def _inkling_rank_model(full: InklingModel, rank: int, tp_size: int) -> InklingModel:
    """This rank's tensor-parallel shard of ``full``."""
    model = InklingModel(full.config, process_group=dist.group.WORLD)
    model.load_state_dict(shard_inkling_state_dict(full.state_dict(), full.config, tp_rank=rank, tp_size=tp_size))
    return model


def _step5_rank_model(full: Step5Model, rank: int, tp_size: int) -> Step5Model:
    """This rank's expert-parallel model of ``full``: it keeps its experts of the whole weights (which ones,
    the group says: ``rank`` and ``tp_size`` are taken only for the signature every rank model shares)."""
    model = type(full)(full.config, process_group=dist.group.WORLD)
    load_step5_state_dict(model, full.state_dict())
    return model


# How a rank of --tp N holds each stack (the label says how it is split).
_RANK_MODELS = {"inkling": ("tp", _inkling_rank_model), "step5": ("ep", _step5_rank_model)}


def _tp_rank(
    rank: int, tp_size: int, name: str, make, device_type: str, backend: str, workload: Workload, out_dir: str
) -> None:
    """One rank of stack ``name``'s multi-rank run: its eager and compiled rows and its greedy generation
    into ``out_dir/rank{rank}.json``."""
    if rank:  # rank 0 tells the story; the others' rows are merged by the parent
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the rank's process
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // tp_size))
        device = torch.device("cpu")

    split, rank_model = _RANK_MODELS[name]
    shard = partial(rank_model, rank=rank, tp_size=tp_size)
    rows = _run_modes(f"{name} ({split}={tp_size})", make, (EAGER, COMPILED), device, backend, workload, shard)
    generation = _greedy_generation(f"{name} ({split}={tp_size})", lambda: shard(make()), device)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"modes": rows, "generation": generation}, f)


def _run_tensor_parallel(name: str, make, tp: int, dev: torch.device, backend: str) -> tuple[dict[str, dict], dict]:
    """Spawn ``tp`` ranks of stack ``name`` (``make()`` split as :data:`_RANK_MODELS` says); their rows merged
    by :func:`merge_rank_rows`, their generations by :func:`merge_rank_generations`."""
    comm = "nccl" if dev.type == "cuda" else "gloo"
    _say(f"  {tp} ranks ({comm}), one process each; every rank checked against the unsharded eager run")
    with tempfile.TemporaryDirectory(prefix="stepops-demo-tp-") as out_dir:
        spawn_ranks(_tp_rank, tp, name, make, dev.type, backend, WORKLOAD, out_dir, backend=comm)
        ranks = []
        for r in range(tp):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return merge_rank_rows([r["modes"] for r in ranks]), merge_rank_generations([r["generation"] for r in ranks])


def merge_rank_rows(ranks: list[dict[str, dict]]) -> dict[str, dict]:
    """One report row per mode from every rank's rows: the worst error, rows off, graph breaks and
    recompiles of any rank, within the bound only if every rank is; the rest (steps, times) from rank 0."""
    rows = {mode: dict(row) for mode, row in ranks[0].items()}
    for mode, row in rows.items():
        for key in ("max_abs_err_vs_eager", "rows_off", "graph_breaks", "recompiles"):
            if key in row:
                row[key] = largest(rank[mode][key] for rank in ranks)
        row["within_bound"] = all(rank[mode]["within_bound"] for rank in ranks)
    return rows


def merge_rank_generations(ranks: list[dict]) -> dict:
    """Rank 0's greedy generation, unchanged by drafts only if it is on every rank, and
    ``same_on_every_rank``: whether every rank emitted the same tokens (each rank runs the same steps and
    computes the same logits: a rank that does not is a sharding bug)."""
    generation = dict(ranks[0])
    generation["same_with_drafts"] = all(rank["same_with_drafts"] for rank in ranks)
    generation["same_on_every_rank"] = all(rank["tokens"] == generation["tokens"] for rank in ranks)
    return generation


def check_demo_args(*, device: str, backend: str, tp: int, json_path: str | None) -> torch.device:
    """Check the demo's arguments before any work; ``ValueError`` (``TypeError`` for a ``tp`` that is not an
    int) with a one-line reason. Returns the device.

    The device must exist in this torch build, the backend be a registered ``torch.compile`` backend,
    ``tp`` split the Inkling stack's KV heads into whole heads per rank (its 2 heads also split the Step5
    stack's 4 routed experts evenly) and not exceed the GPUs (NCCL: one per rank) or CPU cores (gloo)
    present, and ``json_path`` be a writable file path (checked first, so minutes of results are never lost
    at the end).
    """
    if device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch build sees no CUDA device; use --device cpu or auto")
    if str(device).startswith("cuda:") and int(str(device)[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} GPUs (cuda:0 onwards)")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ValueError(f"--backend {backend!r} is not a torch.compile backend; e.g. inductor, aot_eager or eager")
    check_int("--tp", tp, 1)
    # Every layer kind's KV heads (global and, where the config has them, sliding-window) must split.
    config = InklingConfig()
    heads = math.gcd(*(getattr(config, f.name) for f in dataclasses.fields(config) if f.name.endswith("num_kv_heads")))
    if heads % tp:
        raise ValueError(
            f"--tp {tp}: the demo's Inkling stack has {heads} KV heads per layer, which do not split into {tp} "
            f"ranks of whole heads; use a divisor of {heads}"
        )
    if tp > 1 and dev.index is not None:
        raise ValueError(f"--tp {tp} runs rank r on cuda:r; pass --device cuda or auto, not {device}")
    available, what = (torch.cuda.device_count(), "GPUs") if dev.type == "cuda" else (os.cpu_count() or 1, "CPU cores")
    if tp > available:
        raise ValueError(f"--tp {tp} needs one {what[:-1]} per rank; this machine has {available} {what}")
    if json_path is not None:
        from stepops.cli.paths import check_writable_file  # here: stepops.cli imports this module

        check_writable_file("--json", json_path)
    return dev


def run_demo(*, json_path: str | None = None, device: str = "auto", backend: str = "inductor", tp: int = 1) -> int:
    """Run the demo; print the table; write ``json_path`` (strict JSON: a NaN error is the text ``"nan"``);
    return 0 when every check passed, else 1.

    ``tp > 1`` runs each stack on ``tp`` spawned ranks, Inkling tensor-parallel and Step5 expert-parallel
    (eager and compiled, no CUDA-graph mode; greedy generation on every rank).
    Arguments are checked first (:func:`check_demo_args`, ``ValueError`` or ``TypeError``).
    """
    dev = check_demo_args(device=device, backend=backend, tp=tp, json_path=json_path)
    modes = [EAGER, COMPILED] + ([CUDA_GRAPH] if dev.type == "cuda" else [])
    w = WORKLOAD
    _say(
        f"stepops demo on {dev}: {len(w.prompt_lens)} requests, prompts {w.prompt_lens}, decode {w.decode_lens}, "
        f"k = {w.num_speculative_tokens} speculative tokens, {w.token_budget}-token step budget"
        + (f"; over {tp} ranks, Inkling tensor-parallel and Step5 expert-parallel" if tp > 1 else "")
    )
    report: dict[str, dict] = {}
    for name, make in _MODELS:
        if tp > 1:
            _say(f"{name} ({_RANK_MODELS[name][0]}={tp}):")
            rows, generation = _run_tensor_parallel(name, make, tp, dev, backend)
        else:
            _say(f"{name}:")
            rows = _run_modes(name, make, modes, dev, backend, WORKLOAD)
            generation = _greedy_generation(name, make, dev)
        compiled = rows[COMPILED]
        report[name] = {
            "graph_breaks": compiled["graph_breaks"],
            "recompiles": compiled["recompiles"],
            "max_abs_err_vs_eager": largest(r["max_abs_err_vs_eager"] for r in rows.values()),
            "steps": rows[EAGER]["steps"],
            "tokens": rows[EAGER]["tokens"],
            "eager_seconds": rows[EAGER]["seconds"],
            "compiled_seconds": compiled["seconds"],
            "compile_seconds": compiled["warm_up_seconds"],
            "within_bound": all(r["within_bound"] for r in rows.values()),
            "tp": tp,
            "modes": rows,
            "generation": generation,
        }
        if CUDA_GRAPH in rows:
            report[name]["cudagraph_seconds"] = rows[CUDA_GRAPH]["seconds"]
    _print_table(report)
    ok = checks_passed(report)
    if json_path:
        with open(json_path, "w") as f:
            bound = {"atol": MODE_VS_EAGER_ATOL, "rtol": MODE_VS_EAGER_RTOL}
            document = {"device": str(dev), "backend": backend, "tp": tp, "bound_vs_eager": bound,
                        "models": report, "ok": ok}
            json.dump(_strict_json(document), f, indent=2, allow_nan=False)
        _say(f"wrote {json_path}")
    _say("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def _strict_json(value):
    """``value`` with every non-finite float as its text (``"nan"``, ``"inf"``): the error of a NaN output
    must not make the report a file that strict JSON parsers refuse (Python writes a bare ``NaN``)."""
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def checks_passed(report: dict[str, dict]) -> bool:
    """The demo's verdict on its per-model report: every model compiled without a graph break or a
    recompile, every mode within the bound of its eager run, and greedy generation unchanged by drafts
    (and, over ranks, the same on every rank)."""
    return all(
        r["graph_breaks"] == 0 and r["recompiles"] == 0 and r["within_bound"]
        and r.get("generation", {}).get("same_with_drafts", True)
        and r.get("generation", {}).get("same_on_every_rank", True)
        for r in report.values()
    )


def _print_table(report: dict[str, dict]) -> None:
    header = ("model", "mode", "steps", "tokens", "seconds", "max |err| vs eager", "rows off", "in bound",
              "graph breaks", "recompiles")
    lines = [header]
    for name, r in report.items():
        for mode, row in r["modes"].items():
            label = name + (f" ({_RANK_MODELS[name][0]}={r['tp']})" if r["tp"] > 1 else "")
            lines.append((
                label, mode, str(row["steps"]), str(row["tokens"]),
                f"{row['seconds']:.2f}",
                f"{row['max_abs_err_vs_eager']:g}", f"{row['rows_off']}/{row['rows']}",
                "yes" if row["within_bound"] else "NO",
                str(row.get("graph_breaks", "-")), str(row.get("recompiles", "-")),
            ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    _say("")
    for i, line in enumerate(lines):
        _say("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(line)))
        if i == 0:
            _say("  ".join("-" * wd for wd in widths))
    _say("")
    _say(f"bound: |err| <= {MODE_VS_EAGER_ATOL} + {MODE_VS_EAGER_RTOL} * |eager| per element, against the eager "
         "single-process run of the same stack (fused kernels and tensor-parallel partial sums round in other "
         f"orders, so not bitwise); rows off: rows with an element outside it, at most "
         f"{STEP5_MAX_SHARE_OF_ROWS_OFF:.0%} of Step5's (near-tie region choices) and none of Inkling's. Correctness against transformers' Inkling and the Step5 recompute: the "
         "test suite (tests/models).")


def register(subparsers: argparse._SubParsersAction) -> None:
    """``python -m stepops demo [--json PATH] [--device D] [--backend B] [--tp N]``."""
    parser = subparsers.add_parser(
        "demo",
        help="run 2-layer Step5 and Inkling stacks through a multi-request workload, eager and compiled",
        description="Run a 2-layer Step5 stack and a 2-layer Inkling stack through a scripted multi-request "
        "workload (chunked prefill, decode, speculative verify with rejections), eagerly, compiled with "
        "torch.compile(fullgraph=True) and, with a GPU, from CUDA graphs; check each run against the eager "
        "run, count graph breaks and recompiles, and print a table. Exits 1 when a check fails.",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the per-model results as JSON")
    parser.add_argument("--device", default="auto", help="auto (a GPU when present), cpu or cuda (default: auto)")
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend for the compiled runs (default: inductor)"
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="run each stack on N spawned ranks (gloo on CPU, NCCL with N GPUs): Inkling tensor-parallel, "
        "Step5 expert-parallel (default: 1)",
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:  # before any work: a bad argument is one line on stderr, not a traceback minutes later
        check_demo_args(device=args.device, backend=args.backend, tp=args.tp, json_path=args.json)
    except (TypeError, ValueError) as error:
        print(f"stepops demo: {error}", file=sys.stderr)
        return 2
    return run_demo(json_path=args.json, device=args.device, backend=args.backend, tp=args.tp)
