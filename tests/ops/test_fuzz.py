"""Seeded fuzzing of every op's integer arguments (slots, block tables, per-token metadata) with garbage.

Whatever the ids, no op writes outside the tensors it was given: the PyTorch kernel either raises a
``ValueError`` with every byte unchanged or runs; the Triton kernel (the interpreter on CPU) never raises
for bad ids, writes only inside its tensors, and counts bad tokens exactly when the PyTorch kernel
raises (one rule, ``stepops.ops.bounds``, on both paths). Every tensor sits inside a guard buffer
(``stepops._library.guarded``) so a stray write lands on bytes the test checks.
"""

import random

import pytest
import torch

from stepops._library import guarded, registered_op, registered_ops
from stepops.ops.bounds import error_counter
from stepops.testing import StorageSnapshot, copy_as_views, op_samples

from conftest import triton_device

ITERATIONS = 24  # per op and kernel: bounded, ~1-3 s each under the interpreter
_MAX_ELEMENTS = 40_000  # small samples only (the interpreter is slow on model-sized ones)
_OPS = [e.name for e in registered_ops()]


def _garbage(ids: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """``ids`` with a random subset replaced: -1, other negatives, just past a plausible extent, huge."""
    out = ids.clone().view(-1)
    extent = max(int(ids.abs().max()) + 1 if ids.numel() else 1, 1)
    choices = [-1, -2, -(2**31), 2**31 - 1, extent, extent + 1, 10**6]
    for i in rng.sample(range(out.numel()), k=rng.randint(1, max(1, out.numel() // 2))) if out.numel() else []:
        out[i] = rng.choice(choices + [rng.randint(-extent, 2 * extent)])
    return out.view(ids.shape)


def _fuzzed_calls(op_name: str, seed: int):
    """``ITERATIONS`` calls ``(where, args, kwargs)`` of small samples with garbage ids; ``args()`` builds a
    fresh copy each time, every tensor inside its own guard buffer."""
    rng = random.Random(seed)
    samples = [
        s for s in op_samples(op_name=op_name)
        if sum(a.numel() for a in s.args if isinstance(a, torch.Tensor)) <= _MAX_ELEMENTS
    ]  # fmt: skip
    for i in range(ITERATIONS):
        sample = rng.choice(samples)
        base = [
            _garbage(a, rng) if isinstance(a, torch.Tensor) and _is_id(a) and rng.random() < 0.7 else a
            for a in sample.args
        ]

        def args(base=base):
            return [guarded(a) if isinstance(a, torch.Tensor) else a for a in base]

        yield f"seed {seed} iteration {i} ({sample.name})", args, sample.kwargs


def _is_id(tensor: torch.Tensor) -> bool:
    """Integer arguments are ids (slots, tables, metadata); uint8 is an fp8 summary cache's bytes."""
    return not tensor.dtype.is_floating_point and tensor.dtype != torch.uint8


@pytest.mark.parametrize("op_name", _OPS)
def test_both_kernels_write_only_their_tensors_and_agree_on_bad_ids(op_name):
    """The PyTorch kernel raises a ``ValueError`` naming the op with every byte unchanged, or runs; the
    Triton kernel never raises for ids and counts a bad token exactly when the PyTorch kernel raises.
    Neither writes a byte outside the tensors it was given."""
    entry = registered_op(op_name)
    device = triton_device()
    for where, make_args, kwargs in _fuzzed_calls(op_name, seed=1000 + _OPS.index(op_name)):
        args = make_args()
        snapshot = StorageSnapshot(args)
        raised = False
        try:
            entry.overload(*args, **kwargs)
        except ValueError as error:
            raised = True
            assert str(error).startswith(f"{op_name}: "), f"{where}: {error}"
            assert snapshot.changed_bytes() == 0, f"{where}: raised after writing"
        assert snapshot.changed_outside_views() == 0, where

        args = copy_as_views(make_args(), device)  # the guard bytes around each cache go along
        errors = error_counter(device)
        snapshot = StorageSnapshot([*args, errors])
        entry.triton_kernel(*args, **kwargs, errors=errors)
        assert snapshot.changed_outside_views() == 0, where
        counted = int(errors)
        assert 0 <= counted <= args[0].shape[0], where
        assert (counted > 0) == raised, f"{where}: Triton counted {counted} bad tokens, PyTorch raised: {raised}"
