"""Checks that run on spawned ranks, for the multi-rank model tests (test_tensor_parallel,
test_step5_expert_parallel): each rank records every check's traceback (empty when it passed) in a JSON
file, and one pytest test per check reads them all, so a failure names its check and its rank."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

import torch

from stepops.models.runner import EAGER, StepRunner, Workload
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


def record_checks(checks: Mapping[str, Callable[[], None]], rank: int, out_dir: str) -> None:
    """Run each check on this rank; write ``{name: traceback or ""}`` to ``out_dir/rank{rank}.json``."""
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = ""
        except Exception:  # noqa: BLE001 - recorded for the test that reads it
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
