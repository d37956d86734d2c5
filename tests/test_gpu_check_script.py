"""``benchmarks/gpu_check.sh`` on a machine without a GPU stops at once with one line saying so, instead of
running its parts' 445 s of limits on CPU fallbacks."""

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
