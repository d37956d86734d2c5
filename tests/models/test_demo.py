"""The demo's report: every field the README promises, from a short workload (aot_eager keeps it quick)."""

import copy
import json
import math
import re

import pytest
import torch
from torch._dynamo.utils import counters

import stepops.demo
from stepops.cli import main
from stepops.demo import checks_passed, largest, merge_rank_generations, merge_rank_rows, within_bound
from stepops.models.runner import StepRunner, Workload


def test_demo_reports_every_field(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stepops.demo, "WORKLOAD", Workload(prompt_lens=(11, 4), decode_lens=(5, 6), token_budget=8))
    path = tmp_path / "demo.json"
    assert main(["demo", "--json", str(path), "--backend", "aot_eager", "--device", "cpu"]) == 0
    report = json.loads(path.read_text())
    assert set(report["models"]) == {"step5", "inkling"}
    for model in report["models"].values():  # greedy tokens, with and without drafts
        generation = model["generation"]
        assert generation["same_with_drafts"] and generation["draft_steps"] < generation["steps"]
    assert report["bound_vs_eager"] == {"atol": 2**-3, "rtol": 2**-6}
    for model in report["models"].values():
        assert model["graph_breaks"] == 0 and model["recompiles"] == 0 and model["within_bound"]
        # aot_eager runs the eager kernels in the same order: the compiled run is the eager run, bit for bit.
        assert model["max_abs_err_vs_eager"] == 0
        assert all(row["rows_off"] == 0 and row["rows"] == 16 + 10 for row in model["modes"].values())
        assert set(model["modes"]) == {"eager", "compiled"}
        assert model["steps"] > 0 and model["tokens"] > 0
        assert model["eager_seconds"] > 0 and model["compiled_seconds"] > 0
        eager, compiled = model["modes"]["eager"], model["modes"]["compiled"]
        assert (model["steps"], model["tokens"]) == (eager["steps"], eager["tokens"]) == (
            compiled["steps"], compiled["tokens"])
        assert (model["eager_seconds"], model["compiled_seconds"], model["compile_seconds"]) == (
            eager["seconds"], compiled["seconds"], compiled["warm_up_seconds"])
    out = capsys.readouterr().out
    assert "compiling step5" in out and "max |err| vs eager" in out and "all checks passed" in out


@pytest.mark.parametrize("fault", ["off_when_compiled", "nan_in_every_mode"])
def test_demo_fails_when_a_mode_leaves_the_eager_run(tmp_path, monkeypatch, capsys, fault):
    """A compiled run that differs from eager by more than the bound fails the demo (exit 1, ``ok`` false,
    ``NO`` in the table), as does a NaN output, even where the eager run has the same NaN: a NaN compares
    unequal to everything, and a check built on ``diff > bound`` let it through."""
    monkeypatch.setattr(stepops.demo, "WORKLOAD", Workload(prompt_lens=(5,), decode_lens=(2,), token_budget=8))
    monkeypatch.setattr(stepops.demo, "_MODELS", tuple(m for m in stepops.demo._MODELS if m[0] == "inkling"))
    run_workload = stepops.demo.run_workload

    def faulty(runner, workload, hidden_size):
        result = run_workload(runner, workload, hidden_size)
        if fault == "nan_in_every_mode":
            result.outputs[0][-1, 0] = float("nan")
        elif runner.mode == "compiled":
            result.outputs[0][-1, 0] += 0.5
            # Counted as Dynamo counts them: they must reach the report (that each fails the demo alone is
            # test_checks_passed_fails_on_each_check_alone).
            counters["graph_break"]["injected"] += 2
            counters["stats"]["unique_graphs"] += 3
        return result

    monkeypatch.setattr(stepops.demo, "run_workload", faulty)
    path = tmp_path / "demo.json"
    assert main(["demo", "--backend", "aot_eager", "--device", "cpu", "--json", str(path)]) == 1
    report = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} is not strict JSON"))
    modes = report["models"]["inkling"]["modes"]
    faulty_modes = {"eager", "compiled"} if fault == "nan_in_every_mode" else {"compiled"}
    assert {mode for mode, row in modes.items() if not row["within_bound"]} == faulty_modes
    assert all(modes[mode]["rows_off"] == 1 for mode in faulty_modes)
    assert report["ok"] is False and report["models"]["inkling"]["within_bound"] is False
    if fault == "off_when_compiled":
        assert (modes["compiled"]["graph_breaks"], modes["compiled"]["recompiles"]) == (2, 3)
    if fault == "nan_in_every_mode":
        assert report["models"]["inkling"]["max_abs_err_vs_eager"] == "nan"
    out = capsys.readouterr().out
    assert re.search(r"^inkling +compiled .* NO ", out, re.MULTILINE) and "SOME CHECKS FAILED" in out


def test_demo_fails_when_drafts_change_the_generated_tokens(tmp_path, monkeypatch, capsys):
    """Greedy generation with drafts must give the tokens it gives without: a runner whose drafted run
    changes one token fails the demo end to end (``same_with_drafts`` false, exit 1)."""
    monkeypatch.setattr(stepops.demo, "WORKLOAD", Workload(prompt_lens=(5,), decode_lens=(2,), token_budget=8))
    monkeypatch.setattr(stepops.demo, "_MODELS", tuple(m for m in stepops.demo._MODELS if m[0] == "inkling"))
    generate = StepRunner.generate

    def drafted_differs(self, prompts, max_new_tokens, **kwargs):
        tokens = generate(self, prompts, max_new_tokens, **kwargs)
        if kwargs.get("draft") is not None:
            tokens[0][-1] = (tokens[0][-1] + 1) % self.model.config.vocab_size
        return tokens

    monkeypatch.setattr(StepRunner, "generate", drafted_differs)
    path = tmp_path / "demo.json"
    assert main(["demo", "--backend", "aot_eager", "--device", "cpu", "--json", str(path)]) == 1
    report = json.loads(path.read_text())
    assert report["models"]["inkling"]["generation"]["same_with_drafts"] is False and report["ok"] is False
    assert "DIFFERENT tokens" in capsys.readouterr().out


def test_checks_passed_fails_on_each_check_alone():
    def model(**changes):
        return {"graph_breaks": 0, "recompiles": 0, "within_bound": True, **changes}

    generation = {"same_with_drafts": True}
    assert checks_passed({"step5": model(), "inkling": model(generation=generation)})
    assert checks_passed({"step5": model(), "inkling": model(generation={**generation, "same_on_every_rank": True})})
    for bad in (dict(graph_breaks=1), dict(recompiles=1), dict(within_bound=False),
                dict(generation={"same_with_drafts": False}),
                dict(generation={"same_with_drafts": True, "same_on_every_rank": False})):
        assert not checks_passed({"step5": model(), "inkling": model(**bad)}), bad


def test_ranks_generations_merge_to_their_worst():
    def rank(tokens, same_with_drafts=True):
        return {"steps": 5, "tokens": tokens, "same_with_drafts": same_with_drafts}

    merged = merge_rank_generations([rank([[1, 2]]), rank([[1, 2]])])
    assert merged["same_with_drafts"] and merged["same_on_every_rank"] and merged["steps"] == 5
    assert not merge_rank_generations([rank([[1, 2]]), rank([[1, 3]])])["same_on_every_rank"]
    assert not merge_rank_generations([rank([[1, 2]]), rank([[1, 2]], same_with_drafts=False)])["same_with_drafts"]


def test_only_step5_may_have_rows_off_and_no_model_a_non_finite_output():
    models = {}
    for name, make in stepops.demo._MODELS:
        with torch.device("meta"):  # only the model's kind matters
            models[name] = make()
    step5, inkling = models["step5"], models["inkling"]
    assert within_bound(step5, 2, 26, True) and not within_bound(step5, 3, 26, True)  # 10% of 26 rows: 2.6
    assert within_bound(inkling, 0, 26, True) and not within_bound(inkling, 1, 26, True)
    assert not within_bound(step5, 0, 26, False) and not within_bound(inkling, 0, 26, False)


def test_tensor_parallel_rows_are_the_worst_of_every_rank():
    """Any rank's failure fails the merged row, whichever rank it is (not only rank 0's)."""
    def row(err, off, bound, breaks, recompiles, seconds):
        return {"max_abs_err_vs_eager": err, "rows_off": off, "within_bound": bound, "graph_breaks": breaks,
                "recompiles": recompiles, "seconds": seconds}

    ranks = [
        {"eager": {"max_abs_err_vs_eager": 0.0, "rows_off": 0, "within_bound": True, "seconds": 1.0},
         "compiled": row(0.25, 0, True, 0, 2, 2.0)},
        {"eager": {"max_abs_err_vs_eager": 0.5, "rows_off": 3, "within_bound": False, "seconds": 9.0},
         "compiled": row(0.125, 1, True, 4, 0, 8.0)},
    ]
    before = copy.deepcopy(ranks)
    assert merge_rank_rows(ranks) == {
        "eager": {"max_abs_err_vs_eager": 0.5, "rows_off": 3, "within_bound": False, "seconds": 1.0},
        "compiled": row(0.25, 1, True, 4, 2, 2.0),
    }
    assert merge_rank_rows(ranks[::-1])["eager"]["within_bound"] is False
    assert ranks == before  # the ranks' own rows are left as they were
    ranks[1]["compiled"]["max_abs_err_vs_eager"] = math.nan  # a NaN on any rank, not only the first
    assert math.isnan(merge_rank_rows(ranks)["compiled"]["max_abs_err_vs_eager"])


def test_largest_keeps_a_nan_wherever_it_is():
    assert largest([0.0, 0.5, 0.25]) == 0.5
    for values in ([math.nan, 1.0], [1.0, math.nan], [0.0, 2.0, math.nan, 1.0]):
        assert math.isnan(largest(values)), values


def test_demo_tensor_parallel_reports_every_rank(tmp_path, monkeypatch, capsys):
    """``--tp 2``: both stacks on two spawned gloo ranks each (Inkling tensor-parallel, Step5
    expert-parallel), their bounds and graph breaks reported. The workload reaches the ranks as an
    argument, so the monkeypatched one applies there too."""
    monkeypatch.setattr(stepops.demo, "WORKLOAD", Workload(prompt_lens=(11, 4), decode_lens=(5, 6), token_budget=8))
    path = tmp_path / "demo.json"
    assert main(["demo", "--tp", "2", "--json", str(path), "--backend", "aot_eager", "--device", "cpu"]) == 0
    report = json.loads(path.read_text())
    assert report["tp"] == 2
    for name, model in report["models"].items():
        assert model["tp"] == 2, name
        assert model["graph_breaks"] == 0 and model["recompiles"] == 0 and model["within_bound"], name
        assert model["steps"] > 0 and model["tokens"] > 0, name
        generation = model["generation"]
        assert generation["same_with_drafts"] and generation["same_on_every_rank"], name
    # Inkling: not bitwise vs the unsharded eager run (bf16 partial sums), but within a few bf16 ulps of the
    # residual stream (|x| < 8). Step5: its expert outputs are all-reduced exactly (one rank's value plus
    # zeros), and its bf16 expert paths agree bitwise on CPU: the unsharded bits.
    assert 0 < report["models"]["inkling"]["max_abs_err_vs_eager"] <= 2**-3
    assert report["models"]["step5"]["max_abs_err_vs_eager"] == 0
    out = capsys.readouterr().out
    assert "inkling (tp=2)" in out and "step5 (ep=2)" in out and "2 ranks (gloo)" in out and "all checks passed" in out
