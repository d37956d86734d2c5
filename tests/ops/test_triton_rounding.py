"""The bit-level rounding helpers of the Triton kernels against PyTorch's casts."""

import torch
import triton
import triton.language as tl

from stepops.ops.triton_rounding import fp8_e4m3_code, round_fp32_to_bf16
from conftest import triton_device


@triton.jit
def _encode_kernel(x_ptr, bf16_ptr, fp8_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    rounded = round_fp32_to_bf16(x)
    tl.store(bf16_ptr + offsets, rounded.to(tl.bfloat16), mask=mask)
    tl.store(fp8_ptr + offsets, fp8_e4m3_code(rounded), mask=mask)


def test_rounding_helpers_match_torch_casts():
    """fp32 -> bf16 on random normal fp32 values, and bf16 -> float8_e4m3fn on every finite bf16 value in
    [-448, 448] plus values beyond (which must saturate, like the documented clamp) and NaN of either sign
    (torch's NaN code, 0x7F or 0xFF), against torch's casts."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every_bf16[torch.isfinite(every_bf16)]
    beyond = torch.tensor([449.0, -480.0, 1e4, -3e38, float("inf"), -float("inf")])
    fp8_inputs = torch.cat([finite[finite.abs() <= 448], beyond]).float()
    # NaN enters as bf16 bits (the kernels feed the helper bf16-rounded values): torch's own fp32 -> bf16
    # cast of NaN is path-dependent (vectorised CPU code gives 0xFFFF whatever the sign), bf16 -> fp8 is not.
    nans = torch.tensor([0x7FC0, -0x0040, 0x7F81, -0x007F], dtype=torch.int16).view(torch.bfloat16)
    # fp32 NaNs whose low 16 bits carry into the exponent (or wrap the sign) under the rounding's add.
    payload_nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, -0x007FFFFF], dtype=torch.int32).view(torch.float32)
    random = (torch.randn(4096) * torch.exp2(torch.randint(-60, 60, (4096,)).float())).float()
    x = torch.cat([fp8_inputs, nans.float(), payload_nans, random])
    device = triton_device()
    bf16 = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    fp8 = torch.empty(x.shape, dtype=torch.uint8, device=device)
    block = 4096
    _encode_kernel[(triton.cdiv(x.numel(), block),)](
        x.to(device), bf16, fp8, x.numel(), BLOCK=block, enable_fp_fusion=False
    )
    # fp32 subnormals are excluded: the interpreter (numpy) flushes them; a region summary below 2**-126 is
    # a softmax-weighted mean of bf16 rows, which does not happen outside contrived inputs.
    normal = (x.abs() >= 2**-126) | (x == 0)
    assert torch.equal(bf16.cpu()[normal].view(torch.int16), x[normal].to(torch.bfloat16).view(torch.int16))
    n = fp8_inputs.numel()
    expected = fp8_inputs.to(torch.bfloat16).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(fp8.cpu()[:n], expected)
    # NaN keeps its sign: torch's code is 0x7F or 0xFF (a GPU's tl.minimum alone would give +-448, 0x7E/0xFE).
    expected_nan = nans.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert expected_nan.tolist() == [0x7F, 0xFF, 0x7F, 0xFF]
    assert torch.equal(fp8.cpu()[n : n + nans.numel()], expected_nan)
    payload = slice(n + nans.numel(), n + nans.numel() + payload_nans.numel())
    assert bf16.cpu()[payload].isnan().all(), bf16.cpu()[payload].view(torch.int16)
    assert fp8.cpu()[payload].tolist() == [0x7F, 0xFF, 0x7F, 0xFF]
