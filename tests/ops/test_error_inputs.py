"""Every op's error inputs (``samples.py``), run one generic way: the right error, and not a byte changed.

Eagerly and under ``torch.compile`` the PyTorch kernel (CPU) must raise the listed error before writing
anything: every byte of every argument's storage (the views and the guard bytes around them) is compared
before and after. The Triton kernel (the interpreter on CPU) raises the same shape/dtype errors; for an
error in the ids it writes nothing outside its tensors and counts the bad token in ``errors``.
"""

import pytest
import torch

from stepops._library import written_arguments
from stepops.ops.bounds import error_counter
from stepops.testing import StorageSnapshot, copy_as_views, op_error_inputs, op_samples

from conftest import triton_device

_CASES = list(op_error_inputs())


def _call(case, mode):
    sample = case.error.sample
    op = case.entry.overload
    if mode == "eager":
        return op(*sample.args, **sample.kwargs)
    torch._dynamo.reset()
    # aot_eager: Dynamo tracing through the fake plus AOTAutograd's functionalization of the mutated
    # arguments (where a copy-back could write), without Inductor's C++ build time.
    compiled = torch.compile(lambda *args: op(*args, **sample.kwargs), fullgraph=True, backend="aot_eager")
    return compiled(*sample.args)


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
def test_error_input_raises_its_error_and_changes_no_byte(case, mode):
    error = case.error
    snapshot = StorageSnapshot([*error.sample.args, *error.sample.kwargs.values()])
    expected = error.error_type
    if mode == "compile" and not error.data:
        # A shape error is raised by the fake while Dynamo traces; Dynamo re-raises it as a
        # TorchRuntimeError that carries the op's own message (checked by the regex).
        expected = (expected, torch._dynamo.exc.TorchRuntimeError)
    with pytest.raises(expected, match=error.error_regex):
        _call(case, mode)
    assert snapshot.changed_bytes() == 0


@pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
def test_error_input_on_the_triton_kernel_masks_and_counts(case):
    sample = case.error.sample
    device = triton_device()
    args = copy_as_views(sample.args, device)  # the guard bytes around each cache go along
    if not case.error.data:
        snapshot = StorageSnapshot([*args, *sample.kwargs.values()])
        with pytest.raises(case.error.error_type, match=case.error.error_regex):
            case.entry.triton_kernel(*args, **sample.kwargs)
        assert snapshot.changed_bytes() == 0
        return
    kwargs = {"errors": error_counter(device), **sample.kwargs}
    snapshot = StorageSnapshot([*args, *kwargs.values()])
    case.entry.triton_kernel(*args, **kwargs)
    assert snapshot.changed_outside_views() == 0
    assert kwargs["errors"].tolist() == [1], "the one bad token must be counted once"


_DATA_CASES = [c for c in _CASES if c.error.data]


@pytest.mark.parametrize("case", _DATA_CASES, ids=[c.name for c in _DATA_CASES])
def test_error_input_on_the_triton_kernel_without_a_counter_writes_only_its_caches(case):
    """No ``errors`` counter: the bad token is still masked, and nothing is counted anywhere (a kernel that
    counted without a counter added 1 to the stand-in pointer it was given instead: an input's id)."""
    sample = case.error.sample
    args = copy_as_views(sample.args, triton_device())
    written = written_arguments(case.entry.overload)
    inputs = [a for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in written]
    everything, read_only = StorageSnapshot([*args, *sample.kwargs.values()]), StorageSnapshot(inputs)
    case.entry.triton_kernel(*args, **sample.kwargs)
    assert everything.changed_outside_views() == 0
    assert read_only.changed_bytes() == 0


def test_error_counter_on_a_cuda_device_without_cuda_is_a_value_error(monkeypatch):
    """torch raised ``AssertionError: Torch not compiled with CUDA enabled``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="error_counter: device cuda:0 is CUDA, but this torch build sees no CUDA"):
        error_counter("cuda:0")
    assert error_counter().tolist() == [0]


_FIRST_SAMPLES = {name: next(op_samples(op_name=name)) for name in sorted({c.entry.name for c in _CASES})}
_TENSOR_ARGS = [
    (name, index)
    for name, sample in _FIRST_SAMPLES.items()
    for index, arg in enumerate(sample.args)
    if isinstance(arg, torch.Tensor)
]


@pytest.mark.parametrize("name, index", _TENSOR_ARGS, ids=[f"{name}-arg{index}" for name, index in _TENSOR_ARGS])
def test_a_tensor_on_another_device_is_a_value_error_naming_both(name, index):
    """Each tensor argument in turn on ``meta`` (any second device): the argument check names both devices
    before a kernel runs (on a GPU, a CPU metadata tensor would be read through a host pointer)."""
    op, args, kwargs = _FIRST_SAMPLES[name]
    args = list(args)
    args[index] = args[index].to("meta")
    snapshot = StorageSnapshot([a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"])
    with pytest.raises(ValueError, match=r"(?s)(meta.*cpu|cpu.*meta)"):
        op(*args, **kwargs)
    assert snapshot.changed_bytes() == 0
