"""Test-session set-up.

Without a GPU, the Triton kernels run under the Triton interpreter on CPU tensors. ``TRITON_INTERPRET``
is read when a kernel is decorated, so it must be set before stepops (and its kernels) is imported.
Tests that compile Triton kernels for real GPUs run in a separate process without it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import stepops  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """Seed every test from its id, so a failure reproduces; the seed is in the failure report."""
    seed = sum(map(ord, request.node.nodeid)) % (2**31)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


def triton_device() -> torch.device:
    """Where Triton launchers run in tests: the GPU if there is one, else CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
