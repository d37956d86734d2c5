"""``benchmarks/gpu_check.sh`` on a machine without a GPU stops at once with one line saying so, instead of
running its parts' 445 s of limits on CPU fallbacks; its test part collects on a machine without transformers."""

import os
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


def test_its_gpu_tests_collect_without_transformers(tmp_path):
    """GPU machines may lack transformers: the pytest run of the ``gpu_tests`` part, its arguments read from
    the script, collects every module with ``import transformers`` failing (test_inkling_multimodal, which
    imports it, was not ignored)."""
    script = _SCRIPT.read_text()
    command = script[script.index("part gpu_tests") : script.index("--junitxml")].replace("\\\n", " ").split()
    args = command[command.index("pytest") + 1 :]
    block = "import sys; sys.modules['transformers'] = None; import pytest; "
    run = f"{block}sys.exit(pytest.main({args + ['--collect-only', '-p', 'no:cacheprovider']!r}))"
    root = _SCRIPT.parents[1]
    result = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
