"""The Triton launchers run on their tensors' GPU, not on the current one (``stepops._triton``).

A Triton kernel launches on the current device; the dispatcher sets no device guard for a kernel registered
from Python. Pinned on a CPU-only wheel with fake ``cuda:1`` tensors, ``torch.cuda.current_device`` and
``torch.cuda.device`` replaced by stand-ins: every op's registered CUDA kernel enters ``cuda:1`` before it
launches anything, and a call whose GPU is already current launches without entering a guard.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from stepops._library import registered_ops
from stepops._triton import HAS_TRITON, on_tensors_device


# A CUDA wheel initialises the GPU a fake tensor names: cuda:1 fails on a one-GPU machine.
_CPU_ONLY_WHEEL = pytest.mark.skipif(torch.cuda.is_available(), reason="fake cuda:1 tensors need a CPU-only wheel")


class _Entered(Exception):
    """Raised by the ``torch.cuda.device`` stand-in: the guard was entered (and nothing launched yet)."""


@pytest.fixture
def current_gpu(monkeypatch):
    """A one-element list holding the "current GPU" index; ``torch.cuda.device(d)`` raises ``_Entered(d)``."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    @contextlib.contextmanager
    def device(d):
        raise _Entered(torch.device("cuda", d) if isinstance(d, int) else torch.device(d))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    return current


@_CPU_ONLY_WHEEL
@pytest.mark.skipif(not HAS_TRITON, reason="the stand-in of a missing Triton launches nothing")
@pytest.mark.parametrize("entry", registered_ops(), ids=lambda e: e.name)
def test_each_op_launches_on_its_tensors_gpu(current_gpu, entry):
    sample = next(entry.samples(torch.device("cpu")))
    with FakeTensorMode():
        # The same shapes, strides and dtypes on cuda:1 (a launcher reads no data on a GPU).
        args, kwargs = pytree.tree_map_only(
            torch.Tensor,
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda:1"),
            (sample.args, sample.kwargs),
        )
        with pytest.raises(_Entered) as entered:
            entry.triton_kernel(*args, **kwargs)
    assert entered.value.args == (torch.device("cuda:1"),)


@_CPU_ONLY_WHEEL
def test_a_launch_on_the_current_gpu_or_on_cpu_enters_no_guard(current_gpu):
    launches = []
    launch = on_tensors_device(lambda first, *args, **kwargs: launches.append((first.device, args, kwargs)))
    with FakeTensorMode():
        on_gpu_1 = torch.empty(2, device="cuda:1")
    current_gpu[0] = 1
    launch(on_gpu_1, 3, flag=True)
    launch(torch.empty(2), 4)  # CPU tensors: the interpreter; torch.cuda is never asked
    assert launches == [(torch.device("cuda:1"), (3,), {"flag": True}), (torch.device("cpu"), (4,), {})]
    current_gpu[0] = 0
    with pytest.raises(_Entered):
        launch(on_gpu_1)
    assert len(launches) == 2
