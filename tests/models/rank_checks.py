"""Checks that run on spawned ranks, for the multi-rank model tests (test_tensor_parallel,
test_step5_expert_parallel): each rank runs the scripted workload through the whole model and through its
own (:func:`run_sharded`), checks what every sharding must give (:func:`shared_checks`) and its own, and
records every check's traceback (empty when it passed) in a JSON file; one pytest test per check reads
them all, so a failure names its check and its rank."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
import torch.distributed as dist
from torch._dynamo.utils import counters

from stepops.models.runner import COMPILED, EAGER, StepRunner, Workload, WorkloadResult, run_workload
from stepops.models.tensor_parallel import spawn_ranks


def workload_runner(model: torch.nn.Module, workload: Workload, mode: str = EAGER, backend=None) -> StepRunner:
    """A CPU runner sized for ``workload`` (one slot per request, its step budget)."""
    return StepRunner(
        model,
        max_requests=len(workload.prompt_lens),
        max_model_len=workload.max_len,
        max_tokens=workload.token_budget,
        device="cpu",
        mode=mode,
        compile_backend=backend,
    )


@dataclass
class ShardedRuns:
    """One workload through the whole model and through this rank's models."""

    whole: WorkloadResult  # the whole model, in this process
    eager: WorkloadResult  # this rank's model
    eager_model: torch.nn.Module
    swapped: WorkloadResult  # this rank's model holding the other rank's part
    compiled: WorkloadResult  # this rank's model compiled (aot_eager, fullgraph)
    compiled_model: torch.nn.Module
    compiled_runner: StepRunner
    graphs: int  # graphs compiled
    graph_breaks: dict
    small_steps: list[int]  # the token counts of the eager steps that ran only the chosen experts
    every_rank: list[list[torch.Tensor]]  # every rank's eager outputs


def run_sharded(
    whole_model: torch.nn.Module,
    rank_model: Callable[[int], torch.nn.Module],
    moe_cls: type,
    workload: Workload,
    rank: int,
    world_size: int,
) -> ShardedRuns:
    """Run ``workload`` through ``whole_model``, then through ``rank_model(rank)`` (this rank's part of it)
    eagerly and compiled, and through ``rank_model(1 - rank)`` (another rank's part); record which eager
    steps ran ``moe_cls.chosen_experts``."""
    hidden = whole_model.config.hidden_size
    whole = run_workload(workload_runner(whole_model, workload), workload, hidden)
    eager_model = rank_model(rank)
    small_steps = []
    chosen_experts = moe_cls.chosen_experts
    moe_cls.chosen_experts = lambda self, *a: (small_steps.append(a[0].shape[0]), chosen_experts(self, *a))[1]
    try:
        eager = run_workload(workload_runner(eager_model, workload), workload, hidden)
    finally:
        moe_cls.chosen_experts = chosen_experts
    swapped = run_workload(workload_runner(rank_model(1 - rank), workload), workload, hidden)
    counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled_model = rank_model(rank)
    compiled_runner = workload_runner(compiled_model, workload, COMPILED, backend)
    compiled_runner.warm_up()  # every capture size, as a server would
    compiled = run_workload(compiled_runner, workload, hidden)
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, list(eager.outputs))
    return ShardedRuns(whole, eager, eager_model, swapped, compiled, compiled_model, compiled_runner,
                       backend.frame_count, dict(counters["graph_break"]), small_steps, every_rank)


def shared_checks(runs: ShardedRuns, token_ranges: tuple, small_step_sizes: set[int]) -> dict[str, Callable[[], None]]:
    """What every sharding gives: every rank the same outputs; compiled == eager bitwise (outputs and caches),
    one graph per token range (``token_ranges``), no break; the eager steps of ``small_step_sizes`` tokens
    (only those) ran only the chosen experts."""

    def ranks_replicated():
        for i, y in enumerate(runs.eager.outputs):
            assert all(torch.equal(y, other[i]) for other in runs.every_rank), f"request {i} differs between ranks"

    def compiled_equals_eager():
        for i, (y, x) in enumerate(zip(runs.compiled.outputs, runs.eager.outputs, strict=True)):
            assert torch.equal(y, x), f"request {i}"
        for a, b in zip(runs.compiled_model.cache_tensors(), runs.eager_model.cache_tensors(), strict=True):
            assert torch.equal(a, b), "caches"

    def compiled_one_graph_per_token_range_no_breaks():
        assert not runs.graph_breaks, runs.graph_breaks
        assert runs.compiled_runner.token_ranges == token_ranges, runs.compiled_runner.token_ranges
        assert runs.graphs == len(token_ranges), f"{runs.graphs} graphs"

    def small_steps_ran_the_chosen_experts():
        assert runs.small_steps and set(runs.small_steps) == small_step_sizes, runs.small_steps

    return {check.__name__: check for check in (
        ranks_replicated, compiled_equals_eager, compiled_one_graph_per_token_range_no_breaks,
        small_steps_ran_the_chosen_experts,
    )}  # fmt: skip


def record_checks(checks: Mapping[str, Callable[[], None]], rank: int, out_dir: str) -> None:
    """Run each check on this rank; write ``{name: traceback or ""}`` to ``out_dir/rank{rank}.json``."""
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = ""
        # pytest.raises' "DID NOT RAISE" is no Exception: caught too, so one failing check ends only itself
        except (Exception, pytest.fail.Exception):  # noqa: BLE001 - recorded for the test that reads it
            results[name] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def spawn_checks(rank_main: Callable[[int, int, str], None], size: int, out_dir: Path) -> list[dict[str, str]]:
    """Spawn ``size`` ranks of ``rank_main(rank, size, out_dir)`` (which ends in :func:`record_checks`) and
    read every rank's results."""
    spawn_ranks(rank_main, size, str(out_dir), timeout=timedelta(seconds=120))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(size)]


def assert_every_rank_passed(rank_results: list[dict[str, str]], check: str) -> None:
    failures = [f"rank {r}:\n{results[check]}" for r, results in enumerate(rank_results) if results[check]]
    assert not failures, "\n".join(failures)
