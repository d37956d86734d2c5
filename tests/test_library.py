"""The registration every op goes through (``stepops._library``): what autograd sees of the ops.

The ops have no derivative. A call whose inputs require grad computes what it computes without grad, and a
backward through its output raises a clear error instead of returning the gradient of the CPU kernel's
internals; the arguments the schema marks written get their version bumped, so autograd refuses a backward
that would read a tensor the op overwrote; with grad mode on, a written tensor that requires grad is refused.
``opcheck``'s ``test_autograd_registration`` (tests/test_opcheck.py) returns early when no input requires
grad, which is every sample: here it runs with inputs that do.
"""

import pytest
import torch
from torch.testing._internal.optests import autograd_registration_check

from stepops._library import written_arguments
from stepops.testing import op_samples

_SAMPLES = [s for s in op_samples() if "empty" not in s.name]


def _with_grad(op, args):
    """Copies of ``args``; the floating-point inputs the op does not write require grad."""
    written = written_arguments(op)
    return tuple(
        a.detach().clone().requires_grad_(a.is_floating_point() and i not in written) if isinstance(a, torch.Tensor)
        else a
        for i, a in enumerate(args)
    )


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_inputs_that_require_grad(sample):
    op, args, kwargs = sample
    want = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    grad_args = _with_grad(op, args)
    assert any(isinstance(a, torch.Tensor) and a.requires_grad for a in grad_args)
    autograd_registration_check(op, _with_grad(op, args), kwargs)
    versions = {i: grad_args[i]._version for i in written_arguments(op) if i < len(grad_args) and grad_args[i] is not None}
    out = op(*grad_args, **kwargs)
    for i, version in versions.items():
        assert grad_args[i]._version > version, f"{op}: argument {i} is written but its version did not change"
    if out is None:
        return
    assert torch.equal(out.detach(), want)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="has no derivative"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not op(*_with_grad(op, args), **kwargs).requires_grad


def test_register_op_takes_the_given_cpu_kernel_tags_pt2_compliant_and_bumps_written_versions():
    """A twin of ``torch_kernel`` whose CPU kernel writes nothing (how the benchmarks' no-op twins are
    built): the CPU call runs that kernel, the op traces as pt2-compliant like a ``custom_op``, and the
    written argument's version is bumped by the registration itself, not by the kernel's own writes (on
    CUDA a Triton kernel bumps nothing)."""
    from stepops._library import register_op

    def add_into(x: torch.Tensor, cache: torch.Tensor) -> None:
        """cache += x."""
        cache.add_(x)

    def write_nothing(x: torch.Tensor, cache: torch.Tensor) -> None:
        pass

    op = register_op(
        "stepops_test_library::add_into", mutates_args=["cache"], torch_kernel=add_into, cpu_kernel=write_nothing,
        cuda_kernel=add_into, fake=write_nothing,
    )  # fmt: skip
    assert torch.Tag.pt2_compliant_tag in op.tags
    cache = torch.zeros(3)
    version = cache._version
    op(torch.ones(3), cache)
    assert torch.equal(cache, torch.zeros(3))
    assert cache._version > version


def _written_float(op, args):
    """Positions of the floating-point tensors ``op`` writes (the ones that can require grad)."""
    return [
        i for i in written_arguments(op)
        if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].is_floating_point()
    ]  # fmt: skip


def _same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


_WRITING_SAMPLES = [s for s in _SAMPLES if _written_float(s.op, s.args)]


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non-leaf"])
@pytest.mark.parametrize("sample", _WRITING_SAMPLES, ids=[s.name for s in _WRITING_SAMPLES])
def test_a_written_tensor_that_requires_grad_is_refused_with_grad_on(sample, leaf):
    """Autograd records none of an op's writes, so a cache that requires grad would give the gradient of what
    it held before (a non-leaf silently; PyTorch refuses an in-place op on a leaf). With grad on, the op
    names the tensor and writes nothing; under no_grad / inference_mode it writes as for any cache."""
    op, args, kwargs = sample
    want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    op(*want, **kwargs)
    for i in _written_float(op, args):
        base = args[i].detach().clone().requires_grad_()
        with_grad = list(args)
        with_grad[i] = base if leaf else base.clone()
        before = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in with_grad]
        with pytest.raises(ValueError, match=f"{op.name()} writes {op._schema.arguments[i].name}, which requires grad"):
            op(*with_grad, **kwargs)
        for got, was in zip(with_grad, before):
            if isinstance(got, torch.Tensor):
                assert _same_bits(got.detach(), was)
        for mode in (torch.no_grad, torch.inference_mode):
            written = [a.clone() if isinstance(a, torch.Tensor) else a for a in with_grad]
            with mode():
                op(*written, **kwargs)
            assert _same_bits(written[i].detach(), want[i]), mode


@pytest.mark.parametrize("sample", _WRITING_SAMPLES, ids=[s.name for s in _WRITING_SAMPLES])
def test_a_negative_view_of_a_written_tensor_is_refused_by_the_op_itself(sample):
    """Called through ``torch.ops`` (no wrapper), a written argument that is a negative view is a
    ``ValueError`` naming it, with nothing written; PyTorch's fallback for the bit failed with "Expected
    Tensor but got None" or an internal assert."""
    op, args, kwargs = sample
    name = op.name().split("::")[-1]
    for i in _written_float(op, args):
        base = args[i].clone()
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        with_bit = list(args)
        with_bit[i] = torch._neg_view(base)
        with pytest.raises(ValueError, match=f"{name}: {op._schema.arguments[i].name} is a negative view"):
            op(*with_bit, **kwargs)
        assert _same_bits(base, before[i])
        assert all(_same_bits(a, b) for a, b in zip(args, before) if isinstance(a, torch.Tensor))
