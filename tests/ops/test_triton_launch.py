"""``stepops.ops.triton_launch``: the host-side integer helpers equal Triton's, and ``CachedLaunch`` launches
exactly what ``kernel[grid]`` launches.

The launch comparison runs :mod:`stepops.testing.launch_check` in a subprocess without
``TRITON_INTERPRET`` (this process interprets the kernels, and an interpreted kernel never takes the
cached path) and with no GPU visible (the check stands in for one): Triton's own runtime picks a stub
kernel per cache key for every op sample, for each sample with one tensor moved off its 16-byte
alignment, and for a small kernel called across every int class, constexpr, option, dtype and device, and
the launches through the table must equal those through ``kernel[grid]`` argument for argument.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stepops._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the launchers are Triton's")

ROOT = Path(__file__).resolve().parents[2]


def test_host_integer_helpers_equal_tritons():
    import triton

    from stepops.ops.triton_launch import cdiv, next_power_of_2

    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for n in (2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for numerator in range(0, 300):
        for denominator in (1, 2, 3, 16, 17, 256):
            assert cdiv(numerator, denominator) == triton.cdiv(numerator, denominator)


def test_cached_launch_launches_what_kernel_grid_launches():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "-m", "stepops.testing.launch_check"],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = re.search(r"(\d+) calls, (\d+) launches, 0 problems", result.stdout)
    assert summary, result.stdout[-2000:]
    calls, launches = map(int, summary.groups())
    # Every op's samples (some with no token launch nothing), one misaligned variant per tensor, the
    # scalar calls: fewer launches would mean the check reached less than it claims.
    assert calls >= 250 and launches >= 240, summary.group(0)


def test_the_stand_in_gpu_refuses_interpreted_kernels_and_a_real_gpu(monkeypatch):
    """Its stub kernels replace compiled ones in Triton's caches: an interpreted kernel never reaches them,
    and a real GPU must never meet them."""
    from stepops.testing.launch_check import stand_in_gpu

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="needs a process without TRITON_INTERPRET"):
        with stand_in_gpu():
            pass
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="run it with none visible"):
        with stand_in_gpu():
            pass


def test_a_tensor_after_a_scalar_is_refused():
    """The table's key reads the leading tensors' pointers and takes the rest by value: a launcher that
    interleaves them is told so, rather than keyed on a tensor object."""
    from stepops.ops.triton_launch import leading_tensors

    def kernel():
        pass

    x = torch.zeros(4)
    assert leading_tensors(kernel, (x, x, 3, True)) == 2
    with pytest.raises(TypeError, match="kernel.*tensor arguments before the scalars"):
        leading_tensors(kernel, (x, 3, x))


def test_copies_as_views_keep_offset_strides_alignment_and_bytes():
    """The GPU test below relies on it: ``copy_as_views`` gives a copy whose key in the table is the
    original's."""
    from stepops._library import guarded
    from stepops.testing.storage import copy_as_views

    for pad in (0, 1, 64):
        view = guarded(torch.randn(3, 5).to(torch.bfloat16).t(), pad=pad)
        (copy,) = copy_as_views([view])
        assert copy.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
        assert (copy.storage_offset(), copy.stride(), copy.shape) == (view.storage_offset(), view.stride(), view.shape)
        assert copy.data_ptr() % 16 == view.data_ptr() % 16
        assert bytes(copy.untyped_storage()) == bytes(view.untyped_storage())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches compiled kernels: needs a GPU")
def test_on_a_gpu_launches_from_the_table_write_what_kernel_grid_writes():
    """Every sample of every op, on a GPU: the call through ``kernel[grid]`` and two calls through the
    table (the second one a hit) write the same bytes into every argument's storage and return the same."""
    from stepops._library import registered_ops
    from stepops.ops.triton_launch import plain_launches
    from stepops.testing.storage import copy_as_views

    device = torch.device("cuda")
    for entry in registered_ops():
        for sample in entry.samples(device):
            runs = []
            for path in ("plain", "table", "table"):
                # Same views of fresh storages: the same alignments, so the same table keys, each run.
                copied = copy_as_views([*sample.args, *sample.kwargs.values()])
                args, kwargs = copied[: len(sample.args)], dict(zip(sample.kwargs, copied[len(sample.args) :]))
                with plain_launches() if path == "plain" else contextlib.nullcontext():
                    out = entry.triton_kernel(*args, **kwargs)
                written = copy_as_views([*args, *kwargs.values(), out], "cpu")
                runs.append([bytes(t.untyped_storage()) for t in written if isinstance(t, torch.Tensor)])
            for got in runs[1:]:
                for i, (a, b) in enumerate(zip(got, runs[0])):
                    assert a == b, f"{entry.name}-{sample.name}: tensor {i} differs"
