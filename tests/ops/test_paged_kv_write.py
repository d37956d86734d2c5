"""``stepops::paged_kv_write``: its per-token reference, poisoned caches, the Triton kernel bitwise."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from stepops.ops.bounds import error_counter
from stepops.ops.paged_kv_write import paged_kv_write
from stepops.ops.paged_kv_write.reference import paged_kv_write_reference
from stepops.ops.paged_kv_write.torch_kernel import paged_kv_write_torch
from stepops.ops.paged_kv_write.triton_kernel import paged_kv_write_triton
from stepops.ops.paged_kv_write.validate import validate_paged_kv_write_inputs
from stepops.testing import copy_as_views, op_samples
from conftest import triton_device

_SAMPLES = list(op_samples(op_name="paged_kv_write"))


def _base(cache: torch.Tensor) -> torch.Tensor:
    """The whole storage behind a (possibly page-strided) cache view, to check bytes between pages too."""
    return torch.as_strided(cache, (cache.untyped_storage().nbytes() // cache.element_size(),), (1,))


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_matches_reference_and_touches_nothing_else(sample):
    key, value, key_cache, value_cache, slots = sample.args
    want_k, want_v = key_cache.clone(), value_cache.clone()
    paged_kv_write_reference(key, value, want_k, want_v, slots)
    base_k_before, base_v_before = _base(key_cache).clone(), _base(value_cache).clone()
    paged_kv_write(key, value, key_cache, value_cache, slots, validate=True)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    # Bytes outside the views (the gaps of page-strided caches) stay as they were.
    in_view_k = torch.zeros_like(_base(key_cache), dtype=torch.bool)
    _ = in_view_k.as_strided(key_cache.shape, key_cache.stride()).fill_(True)
    assert torch.equal(_base(key_cache)[~in_view_k], base_k_before[~in_view_k])
    in_view_v = torch.zeros_like(_base(value_cache), dtype=torch.bool)
    _ = in_view_v.as_strided(value_cache.shape, value_cache.stride()).fill_(True)
    assert torch.equal(_base(value_cache)[~in_view_v], base_v_before[~in_view_v])


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_triton_kernel_matches_torch_kernel_bitwise(sample):
    """A copy has no arithmetic: the Triton kernel (interpreter on CPU) must give the same bits."""
    device = triton_device()
    key, value, key_cache, value_cache, slots = sample.args
    want_k, want_v = key_cache.clone(), value_cache.clone()
    torch.ops.stepops.paged_kv_write(key, value, want_k, want_v, slots)
    # The caches start random: an unwritten slot keeps its bits, a wrongly written one changes them.
    moved = copy_as_views(sample.args, device)  # page-strided caches stay page-strided
    paged_kv_write_triton(*moved)
    assert torch.equal(moved[2].cpu(), want_k) and torch.equal(moved[3].cpu(), want_v)


def test_padding_only_writes_nothing():
    key = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    cache = torch.full((2, 4, 2, 4), float("nan"), dtype=torch.bfloat16)
    value_cache = cache.clone()
    paged_kv_write(key, key, cache, value_cache, torch.full((3,), -1, dtype=torch.int32))
    assert cache.isnan().all() and value_cache.isnan().all()


@pytest.mark.parametrize("bad", [12, 10**6, -2])
def test_triton_kernel_masks_a_bad_slot_and_writes_the_other_tokens(bad):
    """A slot out of range is counted and writes nothing (no other slot takes its row, slot 0 included);
    the call's good tokens land as the PyTorch kernel writes them with the bad slot as padding."""
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(3, 2, 4, generator=gen).to(torch.bfloat16) for _ in range(2))
    caches = [torch.zeros(3, 4, 2, 4, dtype=torch.bfloat16) for _ in range(2)]
    want = [c.clone() for c in caches]
    paged_kv_write_torch(key, value, *want, torch.tensor([5, -1, 7], dtype=torch.int32))
    args = copy_as_views((key, value, *caches, torch.tensor([5, bad, 7], dtype=torch.int32)), triton_device())
    errors = error_counter(triton_device())
    paged_kv_write_triton(*args, errors=errors)
    assert errors.tolist() == [1]
    assert torch.equal(args[2].cpu(), want[0]) and torch.equal(args[3].cpu(), want[1])


def _args(**over):
    args = dict(
        key=torch.zeros(2, 2, 4, dtype=torch.bfloat16),
        value=torch.zeros(2, 2, 4, dtype=torch.bfloat16),
        key_cache=torch.zeros(3, 4, 2, 4, dtype=torch.bfloat16),
        value_cache=torch.zeros(3, 4, 2, 4, dtype=torch.bfloat16),
        slot_mapping=torch.tensor([0, 5], dtype=torch.int32),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, error, text",
    [
        (dict(key=torch.zeros(2, 8, dtype=torch.bfloat16)), ValueError, "must be \\[T, H, D\\]"),
        (dict(key_cache=torch.zeros(3, 4, 8, dtype=torch.bfloat16)), ValueError, "num_blocks, block_size"),
        (dict(slot_mapping=torch.tensor([0.0, 1.0])), TypeError, "int32 or int64"),
        (dict(key_cache=torch.zeros(3, 4, 2, 4)), TypeError, "input's dtype"),
        (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "same token count"),
        (dict(value=torch.zeros(3, 2, 4, dtype=torch.bfloat16)), ValueError, "same token count; got 2, 3, 2"),
        (dict(value=torch.zeros(2, 3, 4, dtype=torch.bfloat16)), ValueError, "head count"),
        (dict(key_cache=torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)), ValueError, "head sizes"),
        # The value side of each rule on its own (no key mismatch to trip the check first); a value of
        # head size 1 would otherwise broadcast over every Dv of its slot in the PyTorch kernel.
        (dict(value_cache=torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)), ValueError, "value 4 vs value_cache 8"),
        (dict(value=torch.zeros(2, 2, 1, dtype=torch.bfloat16)), ValueError, "value 1 vs value_cache 4"),
        (dict(value_cache=torch.zeros(3, 4, 3, 4, dtype=torch.bfloat16)), ValueError, "head count H must agree"),
        (dict(value_cache=torch.zeros(2, 4, 2, 4, dtype=torch.bfloat16)), ValueError, "same \\[num_blocks"),
    ],
)
def test_bad_input_gets_a_clear_error(over, error, text):
    with pytest.raises(error, match=text):
        paged_kv_write(**_args(**over))
    with pytest.raises(error, match=text):
        paged_kv_write_triton(**_args(**over))
    with FakeTensorMode() as mode, pytest.raises(error, match=text):
        torch.ops.stepops.paged_kv_write(**{k: mode.from_tensor(v) for k, v in _args(**over).items()})


@pytest.mark.parametrize("validate", [
    lambda **args: paged_kv_write(**args, validate=True),
    # The validator alone, as validate=True runs it before the Triton kernel on a GPU, where no kernel raises
    # after it: on CPU the PyTorch kernel's own id check raises the same range message and would hide a gap.
    validate_paged_kv_write_inputs,
], ids=["wrapper", "validator_alone"])
def test_validate_checks_slot_ranges_and_duplicates(validate):
    validate(**_args())
    for slots in ([0, 12], [-2, 0]):
        with pytest.raises(ValueError, match="paged_kv_write: slot_mapping must be -1 or in \\[0, 12\\)"):
            validate(**_args(slot_mapping=torch.tensor(slots, dtype=torch.int32)))
    for slots in ([3, 3], [0, 0]):  # slot 0 is a real slot
        with pytest.raises(ValueError, match="two tokens of one call the same slot"):
            validate(**_args(slot_mapping=torch.tensor(slots, dtype=torch.int32)))


def test_triton_kernel_reads_a_strided_slot_mapping_by_its_stride():
    """slot_mapping as a column of a [T, 2] table (stride 2): each token's own slot, not its neighbour's."""
    device = triton_device()
    key = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    cache = torch.zeros(3, 2, 2, 4, dtype=torch.bfloat16)
    table = torch.tensor([[1, 4], [5, 0], [2, 3]], dtype=torch.int32)
    slots = table[:, 0]  # [1, 5, 2], stride 2
    want_k, want_v = cache.clone(), cache.clone()
    paged_kv_write_reference(key, key, want_k, want_v, slots)
    got_k, got_v = cache.clone().to(device), cache.clone().to(device)  # two caches, also on CPU
    paged_kv_write_triton(key.to(device), key.to(device), got_k, got_v, table.to(device)[:, 0])
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


@pytest.mark.parametrize("heads, head_size, head_size_v", [(2, 8, 0), (2, 0, 8), (0, 8, 8)], ids=["dv0", "d0", "h0"])
def test_zero_sized_heads_or_head_dims_run_on_both_kernels(heads, head_size, head_size_v):
    """A packed latent passes an empty value (Dv = 0): both kernels write the key and nothing else."""
    device = triton_device()
    key = torch.randn(3, heads, head_size, dtype=torch.bfloat16)
    value = torch.randn(3, heads, head_size_v, dtype=torch.bfloat16)
    key_cache = torch.randn(3, 2, heads, head_size, dtype=torch.bfloat16)
    value_cache = torch.randn(3, 2, heads, head_size_v, dtype=torch.bfloat16)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    paged_kv_write_reference(key, value, want_k, want_v, slots)
    got_k, got_v = key_cache.clone(), value_cache.clone()
    paged_kv_write(key, value, got_k, got_v, slots, validate=True)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    got_k, got_v = key_cache.to(device), value_cache.to(device)
    paged_kv_write_triton(key.to(device), value.to(device), got_k, got_v, slots.to(device))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def test_heads_past_tritons_tensor_limit_are_not_implemented_on_triton_and_run_on_cpu():
    """H = 1025 heads of 1024: one token's [2048, 1024] tile is past the 2**20 elements of a Triton tensor,
    and Triton's compile error named no argument. The PyTorch kernel (the CPU path) runs it."""
    key = torch.randn(1, 1025, 1024).to(torch.bfloat16)
    slots = torch.tensor([1], dtype=torch.int32)
    key_cache, value_cache = torch.zeros(1, 2, 1025, 1024, dtype=torch.bfloat16), torch.zeros(1, 2, 1025, 0)
    paged_kv_write(key, key[..., :0].float(), key_cache, value_cache, slots)
    assert torch.equal(key_cache[0, 1], key[0])
    device = triton_device()
    with pytest.raises(NotImplementedError, match=r"paged_kv_write: H = 1025, D = 1024, Dv = 0 needs a \[2048, 1024\] tile"):
        paged_kv_write_triton(*copy_as_views([key, key[..., :0].float(), key_cache, value_cache, slots], device))


@pytest.mark.parametrize("mode", ["eager", "fake"])
def test_a_cache_with_block_size_zero_is_a_value_error_not_a_zero_division(mode):
    """N = 0 (``key_cache.shape[1]``): the checks refused nothing, so an all-padding step reached
    ``slots // N`` in the PyTorch kernel and failed with ``RuntimeError: ZeroDivisionError``."""
    key = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    cache = torch.zeros(4, 0, 2, 8, dtype=torch.bfloat16)
    slots = torch.full((3,), -1, dtype=torch.int32)
    args = (key, key, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match=r"paged_kv_write: key_cache must have a block size N >= 1"):
        if mode == "eager":
            paged_kv_write(*args)
        else:
            with FakeTensorMode() as fake_mode:
                paged_kv_write(*(fake_mode.from_tensor(a) for a in args))


_BIT_COPY_DTYPES = [
    torch.bool, torch.float16, torch.float64, torch.complex64, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.uint16, torch.uint32, torch.uint64, torch.bits16,
]  # fmt: skip


def _random_bits(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (valid bools only), for dtypes that ``randn`` cannot make."""
    size = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 2 if dtype == torch.bool else 256, (size,), dtype=torch.uint8).view(dtype).view(shape)


@pytest.mark.parametrize("dtype", _BIT_COPY_DTYPES, ids=str)
def test_both_kernels_copy_the_bits_of_any_dtype(dtype):
    """The op copies bits, whatever the dtype: complex64 (no Triton type) failed in the Triton kernel, and
    uint16-64, float8_e8m0fnu, float4_e2m1fn_x2 and bits16 (no CPU index_put) in the PyTorch kernel. The
    key is a strided view (every other element of a wider tensor)."""
    key, value = _random_bits(dtype, 3, 2, 16)[..., ::2], _random_bits(dtype, 3, 2, 8)
    caches = (_random_bits(dtype, 2, 4, 2, 8), _random_bits(dtype, 2, 4, 2, 8))
    slots = torch.tensor([5, -1, 0], dtype=torch.int32)
    want = [c.clone() for c in caches]
    paged_kv_write_reference(key, value, *want, slots)
    kernels = ((torch.ops.stepops.paged_kv_write, torch.device("cpu")), (paged_kv_write_triton, triton_device()))
    for kernel, device in kernels:
        moved_key, moved_value, *got, moved_slots = copy_as_views((key, value, *caches, slots), device)
        kernel(moved_key, moved_value, *got, moved_slots)
        assert all(torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want)), kernel


def test_pytorch_kernel_compiled_by_inductor_copies_the_bits_of_float_caches():
    """Compiled by Inductor, the PyTorch kernel still copies bits (NaN payloads included): a put through an
    integer view of a bf16 cache came out as the integers' values converted to bf16."""
    key, value = _random_bits(torch.bfloat16, 3, 2, 16)[..., ::2], _random_bits(torch.bfloat16, 3, 2, 8)
    caches = (_random_bits(torch.bfloat16, 2, 4, 2, 8), _random_bits(torch.bfloat16, 2, 4, 2, 8))
    slots = torch.tensor([5, -1, 0], dtype=torch.int32)
    want = [c.clone() for c in caches]
    paged_kv_write_reference(key, value, *want, slots)
    torch._dynamo.reset()
    torch.compile(paged_kv_write_torch, backend="inductor")(key, value, *caches, slots)
    assert all(torch.equal(c.view(torch.int16), w.view(torch.int16)) for c, w in zip(caches, want))


def test_triton_kernel_compiles_for_gpus_with_every_float8_cache():
    """float8_e4m3fnuz/e5m2fnuz caches ran under the interpreter, but Triton cannot compile loads of them
    for sm_90 or sm_80: the kernel copies integers of the element's width. Compiled in a subprocess without
    TRITON_INTERPRET (interpreted kernels cannot be compiled)."""
    import os
    import subprocess
    import sys
    import textwrap

    from stepops.testing.gpu_build import unsupported_reason

    if unsupported_reason():
        pytest.skip(unsupported_reason())
    script = textwrap.dedent("""
        import torch
        from stepops.testing import gpu_build
        calls = []
        for dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e4m3fn, torch.float8_e5m2):
            key, cache = torch.zeros(3, 2, 8, dtype=dtype), torch.zeros(4, 4, 2, 8, dtype=dtype)
            args = (key, key.clone(), cache, cache.clone(), torch.tensor([0, 5, -1], dtype=torch.int32))
            calls.append(gpu_build.OpCall("paged_kv_write", str(dtype), args, {}))
        builds = gpu_build.build_calls(tuple(calls))
        assert len(builds) == len(calls) * len(gpu_build.TARGETS)  # one launch per call, every target
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_triton_kernel_reaches_heads_past_2_gib_of_a_head_major_cache():
    """A cache whose head stride times its heads passes 2**31 elements (a head-major allocation viewed
    ``[num_blocks, N, H, D]``): the head offsets were int32 products and wrapped to a negative address
    (a segfault under the interpreter, a write before the cache on a GPU). uint8 keeps the storage at 2 GiB
    of address space, of which only the written bytes are touched."""
    heads, head_size, head_stride = 3, 16, 2**30
    device = triton_device()
    storage = torch.empty((heads - 1) * head_stride + head_size, dtype=torch.uint8, device=device)
    key_cache = storage.as_strided((1, 1, heads, head_size), (head_size, head_size, head_stride, 1))
    value_cache = torch.zeros(1, 1, heads, head_size, dtype=torch.uint8, device=device)
    key, value = (torch.randint(0, 256, (1, heads, head_size), dtype=torch.uint8, device=device) for _ in range(2))
    paged_kv_write_triton(key, value, key_cache, value_cache, torch.tensor([0], dtype=torch.int32, device=device))
    assert torch.equal(key_cache[0, 0], key[0]) and torch.equal(value_cache[0, 0], value[0])
