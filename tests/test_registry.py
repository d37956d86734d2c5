"""Every stepops op is complete: a fake, a CPU kernel, a CUDA kernel, samples, error inputs, a naive
reference, a wrapper documented in the common shape; schemas are snapshotted."""

import importlib
import inspect

import pytest
import torch
from expecttest import TestCase

from stepops._library import NAMESPACE, declare_op, registered_op, registered_ops
from stepops.testing import op_samples, storage_bytes


def _namespace_op_names() -> set[str]:
    ns = getattr(torch.ops, NAMESPACE)
    return {n for n in dir(ns) if isinstance(getattr(ns, n, None), torch._ops.OpOverloadPacket)}


def test_every_namespace_op_is_declared_through_the_helper():
    assert _namespace_op_names() == {e.name for e in registered_ops()}


def test_registered_op_finds_each_op_and_names_the_declared_ones_otherwise():
    for entry in registered_ops():
        assert registered_op(entry.name) is entry
    declared = ", ".join(sorted(entry.name for entry in registered_ops()))
    assert "sconv" in declared
    with pytest.raises(KeyError) as info:
        registered_op("sconv_k")
    assert info.value.args == (f"no stepops op named 'sconv_k'; declared: {declared}",)


def test_declaring_an_op_name_twice_is_refused_before_anything_is_registered():
    entry = registered_op("sconv")
    with pytest.raises(ValueError, match="stepops op 'sconv' is declared twice"):
        declare_op(
            "sconv",
            mutates_args=(),
            torch_kernel=entry.torch_kernel,
            triton_kernel=entry.triton_kernel,
            fake=entry.fake,
            samples=entry.samples,
            error_inputs=entry.error_inputs,
        )
    assert registered_op("sconv") is entry


def test_every_op_has_fake_kernels_and_samples():
    for entry in registered_ops():
        qualname = entry.qualname
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"), qualname
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"), qualname
        assert entry.fake.__module__.startswith("stepops._meta."), f"{qualname}: fake lives outside _meta"
        assert entry.torch_kernel.__doc__, f"{qualname}: the PyTorch kernel documents the op"
        names = [s.name for s in op_samples(op_name=entry.name)]
        assert names, f"{qualname} has no samples"
        assert len(names) == len(set(names)), f"{qualname}: duplicate sample names {names}"
        errors = [e.sample.name for e in entry.error_inputs(torch.device("cpu"))]
        assert any(e.data for e in entry.error_inputs(torch.device("cpu"))), f"{qualname}: no error input in its ids"
        assert errors and len(errors) == len(set(errors)), f"{qualname}: no or duplicate error inputs {errors}"
        reference = getattr(importlib.import_module(f"stepops.ops.{entry.name}.reference"), f"{entry.name}_reference")
        schema_args = [a.name for a in entry.overload._schema.arguments if a.name != "errors"]
        assert list(inspect.signature(reference).parameters) == schema_args, f"{qualname}: reference's arguments"
        wrapper = getattr(importlib.import_module(f"stepops.ops.{entry.name}"), entry.name)
        sections = ("Shapes and dtypes:", "Writes:", "Returns:", "Example")
        assert all(s in wrapper.__doc__ for s in sections), f"{qualname}: the wrapper's docstring lacks {sections}"


class TestSchemas(TestCase):
    def test_schema_snapshot(self):
        schemas = "\n".join(str(e.overload._schema) for e in registered_ops())
        self.assertExpectedInline(schemas, """\
stepops::csa_ring_update(Tensor index_k, Tensor index_z, Tensor(a2!) ring, Tensor(a3!) summary_cache, Tensor token_position, Tensor token_chunk_start, Tensor token_chunk_len, Tensor token_ring_base, Tensor token_summary_slot, SymInt capacity, Tensor(a10!)? errors=None) -> ()
stepops::paged_kv_write(Tensor key, Tensor value, Tensor(a2!) key_cache, Tensor(a3!) value_cache, Tensor slot_mapping, Tensor(a5!)? errors=None) -> ()
stepops::sconv(Tensor x, Tensor weight, Tensor(a2!) cache, Tensor block_table, Tensor token_request, Tensor token_chunk_start, Tensor slot_mapping, Tensor token_position, SymInt stream_offset, bool residual=True, bool silu=False, Tensor(a11!)? errors=None) -> Tensor""")


def _layouts_and_bytes(calls) -> list:
    """Every argument of ``calls`` (samples) as comparable values: a tensor as its device, dtype, layout and
    the bytes of its whole storage."""
    described = []
    for call in calls:
        for value in (*call.args, *call.kwargs.values()):
            if isinstance(value, torch.Tensor):
                storage = storage_bytes(value)
                value = (value.device, value.dtype, value.shape, value.stride(), value.storage_offset())
                value = (*value, storage.tolist())
            described.append(value)
    return described


@pytest.mark.parametrize("entry", registered_ops(), ids=lambda entry: entry.name)
def test_samples_name_their_devices_so_the_default_device_does_not_reach_them(entry):
    """Samples and error inputs draw from host generators, then move to the device asked for: under another
    default device (a GPU suite's ``torch.set_default_device("cuda")``; meta here, which holds no data to
    copy) they are the same tensors, byte for byte, on the device asked for."""
    cpu = torch.device("cpu")
    want = [*entry.samples(cpu), *(error.sample for error in entry.error_inputs(cpu))]
    with torch.device("meta"):
        got = [*entry.samples(cpu), *(error.sample for error in entry.error_inputs(cpu))]
    assert [call.name for call in got] == [call.name for call in want]
    assert _layouts_and_bytes(got) == _layouts_and_bytes(want)
