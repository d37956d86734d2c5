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
    for model in report["models"].values():
        assert model["graph_breaks"] == 0 and model["recompiles"] == 0
        assert model["max_abs_err_vs_recompute"] == 0.0  # eager and aot_eager on CPU are bitwise
        assert model["steps"] > 0 and model["tokens"] > 0
        assert model["eager_seconds"] > 0 and model["compiled_seconds"] > 0
    out = capsys.readouterr().out
    assert "compiling step5" in out and "max |err| vs recompute" in out and "all checks passed" in out
