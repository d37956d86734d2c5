"""``benchmarks/gpu_check.sh`` on a machine without a GPU stops at once with one line saying so, instead of
running its parts' 565 s of limits on CPU fallbacks; its test part collects on a machine without
transformers and expecttest; an unknown part stops it before any part runs."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_a_gpu_it_stops_before_any_part(tmp_path):
    started = time.monotonic()
    env = {**os.environ, "PYTHON": sys.executable}  # this interpreter, whatever `python` is on PATH
    result = subprocess.run(["bash", str(_SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA device visible" in result.stderr
    assert "run it on a GPU machine" in result.stderr
    assert "=== gpu_tests" not in result.stdout
    assert time.monotonic() - started < 60


def test_a_python_without_torch_stops_before_any_part(tmp_path):
    """The environment check itself failing (PYTHON pointing at an interpreter without torch) stops too;
    before, the script went on to run every part."""
    env = {**os.environ, "PYTHON": str(tmp_path / "no-such-python")}
    result = subprocess.run(["bash", str(_SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot import torch and triton" in result.stderr
    assert "=== gpu_tests" not in result.stdout


def test_an_unknown_part_stops_before_any_part(tmp_path):
    result = subprocess.run(["bash", str(_SCRIPT), str(tmp_path), "gpu_tests", "benchmark"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unknown part 'benchmark'" in result.stderr
    assert "=== gpu_tests" not in result.stdout


def test_a_part_given_as_out_dir_stops_before_any_part():
    """``gpu_check.sh demo`` (meaning: rerun the demo) ran every part into ./demo/."""
    result = subprocess.run(["bash", str(_SCRIPT), "demo"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "'demo' is a part; the first argument is OUT_DIR" in result.stderr


@pytest.mark.parametrize("flag", ["--help", "-x"])
def test_an_option_prints_the_usage_and_runs_nothing(flag, tmp_path):
    """``--help`` was taken as OUT_DIR: mkdir's usage, then errors about ``--help/summary.txt``."""
    result = subprocess.run(["bash", str(_SCRIPT), flag], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == (0 if flag == "--help" else 2), result.stdout + result.stderr
    assert "benchmarks/gpu_check.sh [OUT_DIR [PART ...]]" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_its_gpu_tests_collect_without_transformers_and_expecttest():
    """GPU machines may lack transformers and expecttest (the lent H200 image has neither in its package
    list): the ``gpu_tests`` part's test paths, read from the script, collect with both imports failing.
    test_inkling_multimodal (transformers) and test_compile (expecttest) once broke its collection."""
    paths = re.search(r"^gpu_test_paths=\((.*)\)$", _SCRIPT.read_text(), re.MULTILINE).group(1).split()
    assert "tests/models/test_cudagraph.py" in paths
    block = "import sys; sys.modules['transformers'] = sys.modules['expecttest'] = None; import pytest; "
    run = f"{block}sys.exit(pytest.main({paths + ['--collect-only', '-q', '-p', 'no:cacheprovider']!r}))"
    root = _SCRIPT.parents[1]
    result = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test_cuda_graph_replay_equals_eager" in result.stdout
