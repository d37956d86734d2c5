"""Each op's PyTorch kernel traced by Dynamo: no more graph breaks than its host reads, and eager's bytes.

The benchmarks compile the PyTorch kernels as the ``compiled`` baseline; a data-dependent shape or a host
read that creeps back in splits that graph (and made the baseline slower than eager before), so the count
is pinned here per op, with the reason for each break.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from stepops._library import registered_ops
from stepops.testing import op_samples, storage_bytes

ALLOWED_GRAPH_BREAKS = {
    "paged_kv_write": 1,  # the bounds check's one host read (stepops.ops.bounds.any_bad_ids)
    "sconv": 1,  # the same
    "csa_ring_update": 2,  # the same, and the number of closing tokens (only they fold their region)
}
_KERNELS = {entry.overload: entry.torch_kernel for entry in registered_ops()}
# The samples with padding, strided views, nothing to write or fp8 (tracing every sample takes a minute).
_NAMES = [
    "csa_ring_update-t1_decode_closes", "csa_ring_update-ragged_padding_strided",
    "csa_ring_update-ragged_fp8_strided", "csa_ring_update-empty_t0",
    "paged_kv_write-ragged_padding", "paged_kv_write-all_padding_fp16", "paged_kv_write-page_strided_int64",
    "paged_kv_write-empty_t0",
    "sconv-ragged_prefill_decode_verify_padded", "sconv-page_strided_cache", "sconv-padding_only",
    "sconv-no_requests_r0", "sconv-model_layout_k_plus_v",
]


def _sample(name):
    """A fresh copy of the sample called ``name`` (op_samples builds new tensors on each call)."""
    return next(s for s in op_samples(op_name=name.split("-")[0]) if s.name == name)


def _state(args, out):
    """A copy of every byte behind every tensor argument (views' gaps included), and the output."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return [storage_bytes(a).clone() for a in tensors] + [out]


def _assert_compiled_keeps_eager_bytes(name, backend, **compile_kwargs):
    """Run the sample's kernel eagerly and compiled with ``backend`` on fresh copies; the same bytes."""
    op, args, kwargs = _sample(name)
    kernel = _KERNELS[op]
    want = _state(args, kernel(*args, **kwargs))
    op, args, kwargs = _sample(name)
    torch._dynamo.reset()
    got = _state(args, torch.compile(kernel, backend=backend, **compile_kwargs)(*args, **kwargs))
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("name", _NAMES)
def test_kernel_breaks_only_at_its_host_reads_and_keeps_eager_bytes(name):
    graphs = CompileCounter()
    _assert_compiled_keeps_eager_bytes(name, graphs, dynamic=True)
    assert graphs.frame_count <= ALLOWED_GRAPH_BREAKS[name.split("-")[0]] + 1


# One sample per op (Inductor compiles each kernel for 5-30 s on CPU): float caches, padding, strides.
_INDUCTOR_NAMES = [
    "csa_ring_update-ragged_padding_strided", "paged_kv_write-ragged_padding", "paged_kv_write-fp8_e4m3fn_padding",
    "sconv-ragged_prefill_decode_verify_padded",
]  # fmt: skip


@pytest.mark.parametrize("name", _INDUCTOR_NAMES)
def test_kernel_compiled_by_inductor_keeps_eager_bytes(name):
    """The benchmarks' ``compiled`` baseline is Inductor's code, not the traced graph run eagerly: Inductor
    miscompiled ``paged_kv_write``'s put through an integer view of a bf16 cache (it wrote the integers'
    values as floats), which the test above, running Dynamo's graphs eagerly, could not see."""
    _assert_compiled_keeps_eager_bytes(name, "inductor")
