"""``python -m benchmarks``: a bad option is an argparse error (exit 2, one line naming it) before any work,
not a traceback from inside torch minutes later, and ``static`` refuses the options only ``run`` reads."""

import os
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import main
from benchmarks.bench_attention import main as bench_attention_main


@pytest.mark.parametrize(
    ("entry", "argv", "message"),
    [
        (main, ["--device", "foo"], "argument --device: invalid choice: 'foo'"),
        (main, ["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (main, ["--compile-backend", "bogus"], "--compile-backend 'bogus' is not a torch.compile backend"),
        (main, ["static", "--quick"], "static takes only --json, not --quick"),
        (main, ["static", "--ops", "sconv", "--threads", "2"], "static takes only --json, not --ops, --threads"),
        # bench_attention takes the same options, checked the same way (cudagraph on CPU failed after the
        # minutes-long layer-attention case).
        (bench_attention_main, ["--device", "foo"], "argument --device: invalid choice: 'foo'"),
        (bench_attention_main, ["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (bench_attention_main, ["--device", "cpu", "--modes", "cudagraph"], "--modes cudagraph needs a CUDA device"),
        (bench_attention_main, ["--attention-keys-per-chunk", "0"], "argument --attention-keys-per-chunk: must be >= 1"),
        (bench_attention_main, ["--contexts", "1k"], "argument --contexts: invalid int value: '1k'"),
        (bench_attention_main, ["--also-chunks", "8192"], "argument --also-chunks: expected 2 arguments"),
        # A --json that cannot be written failed with a traceback after the whole run.
        (main, ["--json", "/no/such/dir/out.json"], "--json '/no/such/dir/out.json': not a writable file path"),
        (main, ["static", "--json", "/"], "--json '/': not a writable file path"),
        (bench_attention_main, ["--json", "/no/such/dir/a.json"], "--json '/no/such/dir/a.json': not a writable"),
        (main, ["--results-dir", "/proc/stepops"], "--results-dir '/proc/stepops': not a directory that can be made"),
        (main, ["static", "--results-dir", "/tmp"], "static takes only --json, not --results-dir"),
    ],
)
def test_bad_options_are_argparse_errors(entry, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        entry(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda", "--tiny"])
    assert exit_info.value.code == 2
    assert "--device cuda: this torch build sees no CUDA device" in capsys.readouterr().err


def test_help_names_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--json PATH" in text
    assert "torch.compile backend of the baselines (default: inductor)" in text


def test_static_under_the_interpreter_reruns_itself_without_it_keeping_json_and_exit_code(
    tmp_path, monkeypatch
):
    """Interpreted kernels cannot be compiled: ``static`` re-runs itself in a child without
    TRITON_INTERPRET, from the repository root, so a relative --json path must reach it made absolute and
    the child's exit status must be the run's."""
    import subprocess

    from benchmarks import static

    calls = []

    def child(command, env, cwd):
        calls.append((command, env, cwd))
        return subprocess.CompletedProcess(command, returncode=3)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(static.subprocess, "run", child)
    monkeypatch.chdir(tmp_path)
    assert static.main("out.json") == 3
    ((command, env, cwd),) = calls
    assert command[1:] == ["-m", "benchmarks", "static", "--json", str((tmp_path / "out.json").resolve())]
    assert "TRITON_INTERPRET" not in env and env["PATH"] == os.environ["PATH"]
    assert Path(cwd).resolve() == Path(static.__file__).resolve().parent.parent  # the repository root
