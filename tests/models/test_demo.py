"""The demo's report: every field the README promises, from a short workload (aot_eager keeps it quick)."""

import json

import stepops.demo
from stepops.cli import main
from stepops.models.runner import Workload


def test_demo_reports_every_field(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stepops.demo, "WORKLOAD", Workload(prompt_lens=(11, 4), decode_lens=(5, 6), token_budget=8))
    path = tmp_path / "demo.json"
    assert main(["demo", "--json", str(path), "--backend", "aot_eager", "--device", "cpu"]) == 0
    report = json.loads(path.read_text())
    assert set(report["models"]) == {"step5", "inkling"}
    generation = report["models"]["inkling"]["generation"]  # greedy tokens, with and without drafts
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
    out = capsys.readouterr().out
    assert "compiling step5" in out and "max |err| vs eager" in out and "all checks passed" in out


def test_demo_fails_when_a_mode_leaves_the_eager_run(monkeypatch, capsys):
    """A compiled run that differs from eager by more than the bound fails the demo (exit 1), as does one
    with non-finite outputs: the check can fail."""
    monkeypatch.setattr(stepops.demo, "WORKLOAD", Workload(prompt_lens=(5,), decode_lens=(2,), token_budget=8))
    monkeypatch.setattr(stepops.demo, "_MODELS", tuple(m for m in stepops.demo._MODELS if m[0] == "inkling"))
    run_workload = stepops.demo.run_workload

    def off_when_compiled(runner, workload, hidden_size):
        result = run_workload(runner, workload, hidden_size)
        if runner.mode == "compiled":
            result.outputs[0][-1, 0] += 0.5
        return result

    monkeypatch.setattr(stepops.demo, "run_workload", off_when_compiled)
    assert main(["demo", "--backend", "aot_eager", "--device", "cpu"]) == 1
    assert "SOME CHECKS FAILED" in capsys.readouterr().out


def test_demo_tensor_parallel_reports_every_rank(tmp_path, monkeypatch, capsys):
    """``--tp 2``: the Inkling stack on two spawned gloo ranks, its bound and graph breaks reported.

    Only the Inkling stack runs (Step5's single-process path is the test above); the workload reaches the
    ranks as an argument, so the monkeypatched one applies there too."""
    monkeypatch.setattr(stepops.demo, "WORKLOAD", Workload(prompt_lens=(11, 4), decode_lens=(5, 6), token_budget=8))
    monkeypatch.setattr(stepops.demo, "_MODELS", tuple(m for m in stepops.demo._MODELS if m[0] == "inkling"))
    path = tmp_path / "demo.json"
    assert main(["demo", "--tp", "2", "--json", str(path), "--backend", "aot_eager", "--device", "cpu"]) == 0
    report = json.loads(path.read_text())
    model = report["models"]["inkling"]
    assert report["tp"] == 2 and model["tp"] == 2
    assert model["graph_breaks"] == 0 and model["recompiles"] == 0 and model["within_bound"]
    # Not bitwise vs the unsharded eager run (bf16 partial sums), but within a few bf16 ulps of the residual
    # stream (|x| < 8).
    assert 0 < model["max_abs_err_vs_eager"] <= 2**-3
    assert model["steps"] > 0 and model["tokens"] > 0
    out = capsys.readouterr().out
    assert "inkling (tp=2)" in out and "2 ranks (gloo)" in out and "all checks passed" in out
