"""The one per-comparison tolerance table. Each entry says why it is as wide as it is.

Bitwise comparisons (chunk invariance, incremental vs dense recompute with the same arithmetic order,
Triton interpreter vs PyTorch kernel) use ``torch.equal``, not this table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    why: str


TOLERANCES: dict[str, Tolerance] = {
    "csa_ring_summary_vs_softmax": Tolerance(
        atol=1e-5,
        rtol=2**-8,
        why="a bf16 CSA region summary vs an fp64 softmax(z, 0) * k sum: rounding to bf16 (8 significant "
        "bits) is off by at most half an ulp, 2**-8 relative; the fp32 online fold adds a few fp32 ulps of "
        "max |k| (|k| < 8 in tests), under 1e-5, which matters only when the sum cancels near 0",
    ),
    "csa_ring_summary_bf16_vs_bf16": Tolerance(
        atol=1e-5,
        rtol=2**-7,
        why="two formulations of a CSA region summary (the op's online fold; a textbook fp32 softmax(z) . k, "
        "the benchmarks' naive baseline), each rounded once to bf16: fp32 values a few fp32 ulps apart can "
        "round to neighbouring bf16 values, one bf16 ulp (2**-7 relative) apart; atol as above near 0",
    ),
    "sconv_fma_contraction": Tolerance(
        atol=1e-5,
        rtol=2**-7,
        why="sconv's conv sum with multiply-adds contracted into FMAs (Inductor's Triton code on a GPU, the "
        "benchmarks' compiled baseline) vs rounded separately (the op): the fp32 sums differ by a few fp32 "
        "ulps of the largest |w x| (< 1e-5 for randn inputs), so the bf16 results are at most one bf16 ulp "
        "(2**-7 relative) apart",
    ),
    "sconv_silu": Tolerance(
        atol=1e-5,
        rtol=2**-7,
        why="sconv with silu=True, Triton kernel vs PyTorch kernel: silu(a) = a / (1 + exp(-a)) uses the "
        "platform's exp (numpy's under the interpreter, ex2.approx on a GPU), which differs from PyTorch's in "
        "the last fp32 bits (relative error below 2**-18 for |a| < 64); the bf16 result then differs by at most "
        "one bf16 ulp (<= 2**-7 relative), and near 0 by the fp32 difference itself, under 1e-5",
    ),
    "sconv_dense_reference": Tolerance(
        atol=1e-4,
        rtol=2**-7,
        why="sconv outputs vs nn.Conv1d(padding=W-1, groups=C) + residual in fp32, rounded to bf16: the conv "
        "sums its W products in another order, so the fp32 sums differ by a few fp32 ulps of the terms "
        "(W + 1 roundings of at most 2**-24 * sum |terms| < 100 in tests: under 1e-4; with silu, F.silu vs "
        "a / (1 + exp(-a)) adds a few fp32 ulps more), and the bf16 roundings by at most one bf16 ulp "
        "(<= 2**-7 relative)",
    ),
    "model_vs_recompute": Tolerance(
        atol=2**-3,
        rtol=2**-6,
        why="a decoder stack's committed outputs (incremental with caches vs full recompute without) on a GPU, "
        "or compiled by Inductor vs eager: cuBLAS/SDPA/Triton or fused kernels sum in other orders, so each "
        "bf16-rounded stage (projections, norms, attention, convs, residual adds) may land one bf16 ulp "
        "apart (2**-8 relative) and a 2-layer stack compounds a few of them: 4 ulps = 2**-6 relative, and "
        "near 0 one ulp of the residual stream's typical magnitude (|x| < 16: 2**-3). A region-selection "
        "flip exceeds it (errors 0.18-0.78 seen on a GPU), so tokens whose k-th and (k+1)-th region scores "
        "are a near tie (stepops.testing.recompute.NEAR_TIE_MARGIN) are left out of the comparison, and their "
        "count is bounded; see model_vs_recompute_cpu for CPU eager",
    ),
    "model_vs_recompute_cpu": Tolerance(
        atol=0.0,
        rtol=2**-7,
        why="a decoder stack's committed outputs, incremental with caches vs the full recompute, both eager on "
        "CPU: not always bitwise, because the layers' attention (an online softmax over key chunks) and the "
        "recompute's one-pass softmax sum in other orders and round their weights to bf16 against another "
        "max, so a bf16-rounded attention output can land one ulp apart (seen: model seed 5). That flip "
        "propagates through the rest of its layer and each later layer at the scale of the residual stream, "
        "not of each output element (near-0 outputs were 32 ulps of their own value off), so the bound is "
        "per token: |err| <= num_layers * rtol * 2**floor(log2 max_j |recompute[t, j]|), one bf16 ulp "
        "(2**-7 of the binade) of the token's largest value per layer. Seen over 8 model seeds x 6 configs "
        "(both models, bf16 and fp8 experts): bitwise in all but 4 runs, at most 1 such ulp and 0.9% of a "
        "workload's elements on most CPUs, 3.5% on an AVX-512 one (tests allow 1/8). A wrong mask or stale "
        "cache is off by 0.1 or more",
    ),
    "model_vs_recompute_cpu_fp8_experts": Tolerance(
        atol=0.0,
        rtol=2**-4,
        why="added, per MoE layer with fp8 experts, to model_vs_recompute_cpu's per-token bound: the reference's "
        "fp8 GEMM rounds its input to e4m3 (codes 1/8 of their binade apart) per 128-wide block scaled by the "
        "block's max, so where the layer's and the recompute's input rows are one bf16 ulp apart (the attention "
        "flips above), a code may cross a rounding boundary (and every code of a block whose max moved), and the "
        "expert output moves by a few ulps of the residual stream instead of one. Seen: 4 ulps (2**-5) in one of "
        "16 runs, with 5.4% of the elements differing, while the attention kept its weights in fp32 (since it "
        "rounds them as the recompute does: at most 1 ulp and 0.9% in 8 runs); equal inputs give equal outputs but for rare fp32 "
        "sum-order ulps (test_step5_reference). Wide: a layer without the input rounding can stay inside it (seen up to "
        "0.082 against the 2-layer bound 0.078); what tells it apart is the share of differing elements (~92% "
        "against at most 5.4%), which the tests bound at 1/8",
    ),
    "csa_summary_cache_vs_model": Tolerance(
        atol=2**-3,
        rtol=2**-6 + 2**-3,
        why="a Step5 summary cache (e4m3 codes, compared as the values they decode to) written by two runs whose "
        "outputs are within model_vs_recompute, e.g. compiled by Inductor vs eager on a GPU: the summaries' "
        "inputs differ as the residual stream does (2**-6 relative, 2**-3 near 0) and e4m3 keeps 3 mantissa "
        "bits, so a value near a rounding boundary lands one code (2**-3 relative) further. Seen on an H200: "
        "27 of 8192 codes apart, all subnormals (0.004 vs 0.008), which the raw codes' integer distance took "
        "for a 50% error",
    ),
    "tensor_parallel_vs_single_rank": Tolerance(
        atol=2**-3,
        rtol=2**-6,
        why="a tensor-parallel Inkling stack (tp ranks) vs the same weights unsharded: o_proj and the MLP's "
        "down are row-parallel, so each rank's partial rounds to bf16 and the bf16 reduce-scatter rounds the "
        "sum again, where one matmul rounds once; the output-stream conv's input lands up to ~1.5 bf16 ulps "
        "of the partials apart, the conv (1 + sum |w| < 3) and the next layer (norms, attention, MLP) carry "
        "it on, and a 2-layer stack compounds four such sums: a few ulps of the residual stream, 4 ulps = "
        "2**-6 relative and, near 0, 4 ulps at |x| < 8 (2**-3). Seen on CPU (tp = 2, 6 seeds and configs): "
        "44% of outputs differ, by at most 0.047 (1.5 ulps at |x| < 5). Values before any reduction (K/V "
        "streams, the first layer's KV cache) are compared bitwise; a wrongly sliced shard is off by O(1)",
    ),
    "tensor_parallel_reduced_stream": Tolerance(
        atol=2**-6,
        rtol=2**-7,
        why="the first Inkling layer's attention- and MLP-output conv-stream rows (the reduce-scattered sums "
        "of tp bf16 partials) vs one unsharded matmul rounded once: each partial rounds by half an ulp and "
        "the sum by half an ulp, at most 1.5 ulps of max(|partials|, |sum|); with unit-scale inputs and "
        "1/sqrt(fan_in) weights the partials stay under 2, where an ulp is 2**-7, so 2**-6 + 2**-7 |x|. "
        "Seen on CPU (tp = 2): at most 2**-8 for values up to 1.3. Tighter than the residual-stream bound, "
        "so a sublayer output a few percent off (e.g. scaled by 1.05) fails it",
    ),
}

# CPU Inductor honours emulate_precision_casts (the runner's INDUCTOR_OPTIONS) from torch 2.13 on: a model
# compiled with them equals eager bitwise. Before, it drops bf16 roundings inside fused kernels (measured on
# 2.11 and 2.12), so a compiled model is only as close as ``model_vs_recompute``.
INDUCTOR_KEEPS_BF16_ROUNDINGS = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)
