"""The benchmark harness: a smoke run on a tiny configuration, the byte floors, and the baseline guard.

Timings are never asserted. The smoke run uses the ``aot_eager`` compile backend (Dynamo and AOTAutograd
trace the PyTorch kernels as with Inductor, without C++ code generation) to keep this test in seconds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stepops._library import registered_op, registered_ops

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ is a top-level folder of the checkout, not part of the package

from benchmarks import harness  # noqa: E402
from benchmarks.steps import VERIFY_TOKENS, decode, prefill, standard_cases, verify  # noqa: E402

OPS = ("csa_ring_update", "paged_kv_write", "sconv")


def test_every_op_has_a_benchmark():
    assert sorted(e.name for e in registered_ops()) == sorted(harness.OP_MODULES)
    for name in harness.OP_MODULES:
        assert (ROOT / "benchmarks" / f"bench_{name}.py").is_file()


def test_tiny_run_writes_every_op_with_floor_times_and_both_ratios(tmp_path):
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Another directory as cwd: the harness must run as `python path/to/benchmarks`.
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks"), "--tiny", "--compile-backend", "aot_eager", "--threads", "2",
         "--json", str(out), "--results-dir", str(tmp_path / "results")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    # The files named by device and size went to --results-dir (not into the checkout), the JSON as --json's.
    assert sorted(p.name for p in (tmp_path / "results").glob("cpu-tiny.*")) == ["cpu-tiny.csv", "cpu-tiny.json"]
    assert json.loads((tmp_path / "results" / "cpu-tiny.json").read_text()) == report
    assert report["copy_bandwidth_gbps"] > 0
    assert report["machine"]["torch_threads"] == 2 and report["machine"]["size"] == "tiny"
    assert sorted(r["op"] for r in report["ops"]) == sorted(OPS)
    for result in report["ops"]:
        assert result["floor"]
        host = result["host_cost_us"]
        for key in ("op_us", "kernel_function_us", "twin_us", "argument_checks_us", "host_path_us"):
            assert host[key] > 0, key
        # None where torch cannot call a custom_op whose trailing mutable optional is left out (torch 2.11).
        assert host["custom_op_twin_us"] is None or host["custom_op_twin_us"] > 0
        assert host["host_path_vs_twin"] == host["host_path_us"] / host["twin_us"]
        assert host["dispatch_overhead_us"] == host["op_us"] - host["kernel_function_us"]
        assert host["case"] == result["cases"][0]["name"]
        assert host["met"] == (host["host_path_vs_twin"] <= host["bar"]) and host["bar"] == 1.5
        assert result["cases"]
        for case in result["cases"]:
            assert case["checked"] == {"naive": True, "compiled": True}
            assert case["floor_bytes"] > 0
            assert set(case["time_us"]) == {"stepops", "naive", "compiled"}
            assert all(t > 0 for t in case["time_us"].values())
            assert set(case["ratio_vs_stepops"]) == {"naive", "compiled"}
            assert all(r > 0 for r in case["ratio_vs_stepops"].values())
            assert case["compiled_speedup_vs_naive"] == case["time_us"]["naive"] / case["time_us"]["compiled"]
        # The tiny run's one case (decode_r1) is not one the bar applies to.
        assert result["compiled_vs_naive"] == {"bar": harness.COMPILED_SPEEDUP_BAR, "speedups": {}, "met": None}
    for line in (f"{op}  (floor:" for op in OPS):
        assert line in run.stdout
    assert "no-op twin" in run.stdout and "aten ops per metadata build" in run.stdout
    assert run.stdout.count("compiled vs naive (bar: >= 3x at decode R >= 256 and prefill)") == len(OPS)
    for model in ("step5", "inkling"):
        counts = report["metadata"][model]
        assert counts["step"]["aten_ops"] >= counts["token"]["aten_ops"] > 0


def test_a_baseline_that_fails_its_check_is_reported_and_never_timed(monkeypatch):
    """A wrong baseline's time would be a meaningless ratio: it is not timed, the row says why, and the run
    exits 1 through ``failed_checks``. The op and the passing baseline are timed, and the derived figures
    follow their formulas."""
    module = harness.load_module("paged_kv_write")
    monkeypatch.setattr(module, "naive", lambda *args: None)  # writes nothing: the cache check fails
    settings = harness.Settings(device=torch.device("cpu"), quick=True, tiny=True, compile_backend="aot_eager",
                                min_run_time=0.01)
    copy_gbps = 10.0
    result = harness.run_op("paged_kv_write", settings, copy_gbps, lambda message: None)
    (case,) = result["cases"]
    assert case["checked"]["compiled"] is True
    assert "paged_kv_write/naive: key_cache differs from the stepops op" in case["checked"]["naive"]
    times = case["time_us"]
    assert times["naive"] is None and times["stepops"] > 0 and times["compiled"] > 0
    # GB/s = B / us / 1e3; approx: the same value computed in another order may differ in the last bit.
    assert case["bandwidth_gbps"] == {
        "stepops": pytest.approx(case["floor_bytes"] / times["stepops"] / 1e3, rel=1e-12), "naive": None,
        "compiled": pytest.approx(case["floor_bytes"] / times["compiled"] / 1e3, rel=1e-12),
    }
    assert case["pct_copy_bandwidth"] == pytest.approx(100 * case["floor_bytes"] / times["stepops"] / 1e3 / copy_gbps,
                                                       rel=1e-12)
    assert case["ratio_vs_stepops"] == {"naive": None,
                                        "compiled": pytest.approx(times["compiled"] / times["stepops"], rel=1e-12)}
    assert case["compiled_speedup_vs_naive"] is None
    assert harness.failed_checks({"ops": [result]}) == [f"paged_kv_write/{case['name']}/naive"]
    assert f"  {case['name']}  " in harness.format_op_table(result)


def test_step_cases_close_a_region_and_cover_the_bars_cases():
    """Request 0 closes a Step5 region in every decode and verify step (position 1023 is the last of its 8),
    the other priors are seeded in [16, 1024], and both run sizes hold the cases the 3x bar applies to."""
    step = decode(256)
    assert (step.name, step.kind, step.num_requests, step.num_tokens) == ("decode_r256", "decode", 256, 256)
    assert step.params["prior_lens"][0] == 1023 and step.params["new_lens"] == [1] * 256
    assert all(16 <= p <= 1024 for p in step.params["prior_lens"]) and step == decode(256)
    step = verify(16)
    assert (step.name, step.num_tokens, step.params["prior_lens"][0]) == ("verify_k3_r16", 64, 1020)
    # Request 0 writes positions 1020..1023: the step's last token closes its region.
    assert step.params["new_lens"][0] == VERIFY_TOKENS and (1020 + step.params["new_lens"][0]) % 8 == 0
    step = prefill(4, 512, prior=512)
    assert (step.name, step.num_tokens, step.params["prior_lens"]) == ("prefill_4x512_cont", 2048, [512] * 4)
    for quick in (True, False):
        cases = standard_cases(quick)
        assert cases[0] == decode(1)  # the smallest first: the host-cost case
        rows = [dict(name=c.name, kind=c.kind, num_requests=c.num_requests, compiled_speedup_vs_naive=1.0)
                for c in cases]
        speedups = harness.compiled_vs_naive(rows)["speedups"]
        assert "decode_r256" in speedups and any(name.startswith("prefill") for name in speedups)


def _one_case_result() -> dict:
    """An op's result as run_op makes it: one case, 4000 floor bytes, the naive baseline failed its check."""
    times = {"stepops": 2.0, "naive": None, "compiled": 8.0}
    case = {"name": "decode_r1", "kind": "decode", "num_requests": 1, "num_tokens": 1, "floor_bytes": 4000,
            "time_us": times, "bandwidth_gbps": {"stepops": 2.0, "naive": None, "compiled": 0.5},
            "pct_copy_bandwidth": 20.0, "ratio_vs_stepops": {"naive": None, "compiled": 4.0},
            "compiled_speedup_vs_naive": None}
    host = {"case": "decode_r1", "op_us": 30.0, "kernel_function_us": 12.0, "dispatch_overhead_us": 18.0,
            "host_path_us": 15.0, "twin_us": 10.0, "host_path_vs_twin": 1.5}
    return {"op": "sconv", "floor": "x + y", "cases": [case], "host_cost_us": host,
            "compiled_vs_naive": {"bar": 3.0, "speedups": {}, "met": None}}


def test_op_table_shows_each_figure_in_its_unit():
    assert harness.format_op_table(_one_case_result()).splitlines() == [
        "sconv  (floor: x + y)",
        "       case  R  T  floor KiB  stepops us  naive us  compiled us  GB/s  % copy  naive/stepops  "
        "compiled/stepops  naive/compiled",
        "  decode_r1  1  1        3.9         2.0         -          8.0  2.00    20.0              -  "
        "            4.00               -",
        "  compiled vs naive (bar: >= 3x at decode R >= 256 and prefill): -: no such case in this run",
        "  host cost (decode_r1): eager call 30.0 us, kernel function 12.0 us, dispatch 18.0 us; host path "
        "15.0 us = 1.50x its no-op twin (10.0 us)",
    ]


def test_static_estimate_header_states_its_constants_in_their_units():
    from benchmarks import static

    result = {"constants": {"launch_us": static.LAUNCH_US, "memory_latency_us": static.MEMORY_LATENCY_US,
                            "bandwidth_bytes_per_us": static.BANDWIDTH_BYTES_PER_US, "target": static.TARGET},
              "estimates": [], "before": []}
    assert static.format_estimates(result).splitlines()[0] == (
        "Estimated time of one decode launch on sm_90a (H200): 2.0 µs launch + round trips x 0.6 µs + floor "
        "bytes / 4.8 TB/s"
    )


def test_csv_has_one_row_per_case_and_provider(tmp_path):
    harness.write_csv(tmp_path / "out.csv", [_one_case_result()])
    assert (tmp_path / "out.csv").read_text().splitlines() == [
        "op,case,kind,requests,tokens,floor_bytes,provider,time_us,cudagraph_time_us,bandwidth_gbps,ratio_vs_stepops",
        "sconv,decode_r1,decode,1,1,4000,stepops,2.000,-,2.0000,1",
        "sconv,decode_r1,decode,1,1,4000,naive,-,-,-,-",
        "sconv,decode_r1,decode,1,1,4000,compiled,8.000,-,0.5000,4.0000",
    ]


@pytest.mark.parametrize(
    "quick, tiny, stem", [(False, False, "cpu"), (True, False, "cpu-quick"), (True, True, "cpu-tiny")]
)
def test_each_run_size_writes_its_own_files(tmp_path, quick, tiny, stem):
    """A smoke run (``--tiny``, as the test above makes) wrote cpu-quick.json over a real quick run's."""
    settings = harness.Settings(device=torch.device("cpu"), quick=quick, tiny=tiny)
    report = {"machine": harness.machine(settings), "ops": []}
    harness.save(report, None, lambda message: None, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.csv", f"{stem}.json"]
    assert json.loads((tmp_path / f"{stem}.json").read_text())["machine"]["size"] == settings.size


def test_compiled_vs_naive_bar_applies_to_decode_at_256_requests_and_prefill():
    def row(name, kind, requests, speedup):
        return {"name": name, "kind": kind, "num_requests": requests, "compiled_speedup_vs_naive": speedup}

    rows = [row("decode_r16", "decode", 16, 0.5), row("verify_k3_r256", "verify", 256, 1.0),
            row("decode_r256", "decode", 256, 3.0), row("prefill_1x256", "prefill", 1, 4.0)]
    assert harness.compiled_vs_naive(rows) == {
        "bar": 3.0, "speedups": {"decode_r256": 3.0, "prefill_1x256": 4.0}, "met": True,
    }
    rows[3] = row("prefill_1x256", "prefill", 1, 2.9)
    assert harness.compiled_vs_naive(rows)["met"] is False
    rows[3] = row("prefill_1x256", "prefill", 1, None)  # a baseline that failed its check is never timed
    assert harness.compiled_vs_naive(rows)["met"] is False


def test_no_op_twins_have_the_op_schema():
    """The twins are registered like the ops (same schema, same dispatch keys), only their kernels differ."""
    for op in OPS:
        entry = registered_op(op)
        for how in ("register_op", "checks", "custom_op"):
            twin = harness.noop_twin(entry, how)
            assert str(twin._schema).split("::", 1)[1] == str(entry.overload._schema).split("::", 1)[1]
        twin = harness.noop_twin(entry)
        for key in ("CPU", "CUDA", "Meta", "Autograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(twin.name(), key) == (
                torch._C._dispatch_has_kernel_for_dispatch_key(entry.qualname, key)
            ), (op, key)


def test_count_aten_ops():
    x = torch.arange(4)
    total, by_op = harness.count_aten_ops(lambda: (x + 1).clamp(max=2) * 2)
    assert total == 3 and by_op == {"aten.add": 1, "aten.clamp": 1, "aten.mul": 1}


def test_floors_counted_by_hand():
    """One decode token at position 1023 (the first request of every decode case)."""
    cpu = torch.device("cpu")
    # paged_kv_write: one int32 slot; 8 heads x (128 + 128) bf16 read, the same written.
    assert harness.load_module("paged_kv_write").build(decode(1), cpu).floor_bytes == 4 + 2 * 8 * 256 * 2
    # sconv, K and V in one call, 2048 channels, W = 4: x, fp32 weight [2048, 4], 4 int32 metadata, 3 history
    # rows and one block-table entry (positions 1020..1022 share a block of N = 4), y, the stored row.
    row = 2048 * 2
    assert harness.load_module("sconv").build(decode(1), cpu).floor_bytes == row + 2048 * 4 * 4 + 16 + 3 * row + 4 + row + row
    # csa_ring_update, P = 256: the token's row, 5 int32 metadata, 7 replayed ring rows (positions
    # 1016..1022), the stored row, one bf16 summary of 256.
    ring_row = 2 * 256 * 2
    assert harness.load_module("csa_ring_update").build(decode(1), cpu).floor_bytes == (
        ring_row + 20 + 7 * ring_row + ring_row + 256 * 2
    )


@pytest.mark.parametrize("op", OPS)
def test_a_wrong_baseline_is_refused(op):
    """The guard that keeps a wrong baseline out of the tables: a naive kernel that skips the last token."""
    module = harness.load_module(op)
    entry = registered_op(op)
    case = decode(16)
    want = harness.state_after(entry.overload, entry.overload, module.build(case, torch.device("cpu")))
    assert harness.state_after(entry.overload, module.naive, module.build(case, torch.device("cpu"))).keys() == want.keys()

    def is_metadata(a):  # every op's per-token metadata: [T] int32
        return isinstance(a, torch.Tensor) and a.dtype == torch.int32 and a.shape == (case.num_tokens,)

    def wrong(*args):
        # Marking the last token as padding in every metadata tensor makes the baseline skip it.
        args = [a.clone() if is_metadata(a) else a for a in args]
        for a in filter(is_metadata, args):
            a[-1] = -1
        return module.naive(*args)

    got = harness.state_after(entry.overload, wrong, module.build(case, torch.device("cpu")))
    with pytest.raises(AssertionError, match="differs from the stepops op|outside its tolerance"):
        harness.check_equal(op, "naive", got, want, getattr(module, "TOLERANCES", {}))


def test_attention_case_reports_memory_and_time_per_byte():
    """The layer-attention case at 1k and 2k contexts (the real run goes to 16k): both providers, every field,
    the paged path agrees with the dense one, and its transient memory stays flat (1k is one chunk, 2k
    two) while the dense path's doubles."""
    from benchmarks.bench_attention import format_attention, run_attention

    settings = harness.Settings(device=torch.device("cpu"), quick=True, compile_backend="aot_eager", min_run_time=0.01)
    results = run_attention(settings, lambda message: None, contexts=(1024, 2048))
    rows = {(r["provider"], r["context"]): r for r in results["rows"]}
    assert set(rows) == {(p, c) for p in ("dense", "paged") for c in (1024, 2048)}
    assert all(r["compiled_us"] > 0 and r["peak_eager_mib"] > 0 and r["us_per_kv_mib"] > 0 for r in rows.values())
    # bf16 outputs of magnitude < 1, softmax summed in another order: at most one bf16 ulp (2**-7 at 1) apart.
    assert rows["paged", 2048]["max_abs_diff_vs_dense"] <= 2**-7
    growth = results["growth_1024_to_2048"]
    assert growth["dense"]["peak_eager"] > 1.8 and growth["dense"]["peak_compiled"] > 1.8
    assert growth["paged"]["peak_eager"] < 1.1 and growth["paged"]["peak_compiled"] < 1.1
    assert "paged 1024_to_2048" in format_attention(results)


def test_model_step_case_runs_both_models_with_the_chunk_sizes_given():
    """The whole-model step case (the real run: 1k to 16k, eager and compiled) at a 256-token context with
    32-key attention chunks and 2-region indexer chunks: both models, every field, the models built with them."""
    from benchmarks.bench_attention import format_model_step, run_model_step

    settings = harness.Settings(device=torch.device("cpu"), quick=True, compile_backend="eager", min_run_time=0.01)
    results = run_model_step(settings, lambda message: None, contexts=(256,), modes=("eager",),
                             attention_keys_per_chunk=32, indexer_regions_per_chunk=2)
    rows = results["rows"]
    assert [(r["model"], r["attention_keys_per_chunk"]) for r in rows] == [("step5", 32), ("inkling", 32)]
    assert [r["indexer_regions_per_chunk"] for r in rows] == [2, None]
    assert all(r["first_run_s"] > 0 and r["step_us"] > 0 and r["peak_mib"] > 0 and r["kv_read_mib"] > 0 for r in rows)
    assert "keys/chunk" in format_model_step(results)


def test_the_attention_entry_point_also_runs_the_largest_context_at_other_chunk_sizes(tmp_path, capsys):
    """``--also-chunks KEYS REGIONS`` (benchmarks/gpu_check.sh passes 8x the defaults): the model step again at
    the largest context, its rows in the report's ``model_step_also_chunks``."""
    import json

    from benchmarks.bench_attention import main

    out = tmp_path / "attention.json"
    argv = ["--model-step-only", "--modes", "eager", "--contexts", "64", "128", "--also-chunks", "32", "2",
            "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    default = [(r["context"], r["attention_keys_per_chunk"]) for r in report["model_step"]["rows"]]
    assert default == [(64, 1024), (128, 1024)] * 2
    also = [(r["model"], r["context"], r["attention_keys_per_chunk"], r["indexer_regions_per_chunk"])
            for r in report["model_step_also_chunks"]["rows"]]
    assert also == [("step5", 128, 32, 2), ("inkling", 128, 32, None)]
    assert capsys.readouterr().out.count("keys/chunk") == 2


def test_layer_steps_time_every_case_in_both_modes():
    """``python -m benchmarks --layers``: every case (a verify step among them) runs repeatedly in each mode.
    It failed from the runner's rollback check on: a repeated 4-token verify step stepped back 4 positions,
    past what the Step5 rings keep. With the ``eager`` backend the compiled graph runs the same kernels, so
    its first outputs equal eager's bit for bit."""
    from benchmarks.bench_layers import run_layers

    settings = harness.Settings(device=torch.device("cpu"), quick=True, compile_backend="eager", min_run_time=0.01)
    results = run_layers(settings, lambda message: None)
    for model in results["models"]:
        assert [c["case"] for c in model["cases"]] == ["decode_r1", "decode_r16", "verify_k3_r4"]
        for case in model["cases"]:
            assert all(case[f"{mode}_{what}_us"] > 0 for mode in model["modes"] for what in ("step", "forward"))
    assert results["max_abs_diff_vs_eager"] == {"step5/compiled": 0.0, "inkling/compiled": 0.0}
