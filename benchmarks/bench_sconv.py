"""``stepops::sconv``: Inkling's store-and-convolve over a ragged step, as the layers call it for K and V.

Shape: the Llama-8B-sized Inkling layout of the layout CLI's defaults (8 KV heads, head_dim 128, hidden
4096, W = 4, so D = 2048, N = W = 4), the K and V streams in one call (256 channels per head, 2048 in all),
fp32 weights stored tap-major, as the models keep them.
Only the blocks a step touches are distinct cache blocks; every older block-table entry points at block 0,
which nothing reads or writes (as a sliding-window engine points freed blocks at a null block).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Case, Settings, Workload
from benchmarks.steps import decode, generator as case_generator, standard_cases, verify
from stepops.layouts import INKLING_EXAMPLE_LAYOUT, InklingStream
from stepops.ops.sconv.reference import sconv_reference
from stepops.ops.sconv.samples import KV, step_metadata
from stepops.testing import TOLERANCES

OP = "sconv"
FLOOR = (
    "x read (real T x C x 2 B) + weight (C x W x 4 B) + 4 metadata tensors (4 x T x 4 B) + history taps "
    "(per request min(W-1, p0) rows x C x 2 B, and their block-table entries x 4 B) + y written (T x C x 2 B) "
    "+ stored rows (T x C x 2 B)"
)

# Inductor's Triton code may contract a multiply and an add into an FMA on a GPU; the op's kernel does not.
TOLERANCES = {("compiled", "out", "cuda"): TOLERANCES["sconv_fma_contraction"]}

LAYOUT = INKLING_EXAMPLE_LAYOUT


def cases(quick: bool) -> list[Case]:
    return standard_cases(quick)


def _block_table(prior_lens, new_lens, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """``[R, max_blocks]`` int32: fresh distinct blocks for every block the step reads or writes, else 0."""
    kernel_size = LAYOUT.kernel_size
    columns = [
        range(max(0, p - (kernel_size - 1)) // block_size, (p + n - 1) // block_size + 1)
        for p, n in zip(prior_lens, new_lens)
    ]
    num_blocks = 1 + sum(len(c) for c in columns)
    fresh = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(-(-(p + n) // block_size) for p, n in zip(prior_lens, new_lens))
    table = torch.zeros(len(new_lens), max_blocks, dtype=torch.int32)
    for r, cols in enumerate(columns):
        for c in cols:
            table[r, c] = fresh.pop()
    return table, num_blocks


def _workload(case: Case, device: torch.device, offset: int, width: int, salt: str = "") -> Workload:
    gen = case_generator(case, salt)
    prior_lens, new_lens = case.params["prior_lens"], case.params["new_lens"]
    kernel_size, heads = LAYOUT.kernel_size, LAYOUT.local_num_kv_heads
    block_size = kernel_size  # the layout's default N: one block per conv window
    table, num_blocks = _block_table(prior_lens, new_lens, block_size, gen)
    tokens = case.num_tokens
    metadata = step_metadata(prior_lens, new_lens, table.to(device), block_size, tokens)
    channels = heads * width
    x = torch.randn(tokens, channels, generator=gen).to(device=device, dtype=torch.bfloat16)
    weight = torch.randn(kernel_size, channels, generator=gen).to(device=device).t()  # fp32, tap-major
    cache_shape = LAYOUT.cache_shape(num_blocks, block_size)
    cache = torch.rand(cache_shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    row = channels * x.element_size()
    history_rows = sum(min(kernel_size - 1, p) for p in prior_lens)
    history_blocks = sum(
        len({q // block_size for q in range(max(0, p - (kernel_size - 1)), p)}) for p in prior_lens
    )
    floor = (
        tokens * row  # x
        + weight.numel() * weight.element_size()
        + sum(m.numel() * m.element_size() for m in metadata)
        + history_rows * row
        + history_blocks * table.element_size()
        + tokens * row  # y
        + tokens * row  # stores
    )
    return Workload((x, weight, cache, table.to(device), *metadata, offset), floor)



def build(case: Case, device: torch.device) -> Workload:
    return _workload(case, device, *LAYOUT.stream_range(KV))


naive = sconv_reference


def extras(settings: Settings, median_us: Callable[..., float]) -> dict[str, Any]:
    """What the layers' one K+V call saves: two launches (K, then V) against the one over both streams.

    K ``[0, hd)`` and V ``[hd, 2hd)`` are adjacent in each head's D, so one sconv call of width ``2 hd``
    (head ``h`` owning ``[k_h | v_h]``) moves exactly the bytes of both calls. On CPU this times the
    PyTorch kernel, where per-call cost is Python; the answer that matters is the CUDA one
    (``benchmarks/gpu_check.sh``).
    """
    from stepops._library import registered_op

    op = registered_op(OP).overload
    k_offset, k_width = LAYOUT.stream_range(InklingStream.K)
    v_offset, v_width = LAYOUT.stream_range(InklingStream.V)
    rows = []
    for case in (decode(1), decode(256), verify(64)) if not settings.quick else (decode(1), decode(256)):
        k = _workload(case, settings.device, k_offset, k_width, "k").args
        v = _workload(case, settings.device, v_offset, v_width, "v").args
        kv = _workload(case, settings.device, *LAYOUT.stream_range(KV), "kv")
        two = median_us(lambda: (op(*k), op(*v)), settings)
        one = median_us(lambda: op(*kv.args), settings)
        rows.append({"case": case.name, "floor_bytes_both": kv.floor_bytes, "two_launches_us": two,
                     "one_launch_us": one, "saving_pct": 100 * (two - one) / two})
    summary = ", ".join(f"{r['case']} {r['two_launches_us']:.1f} -> {r['one_launch_us']:.1f} us "
                        f"({r['saving_pct']:.0f}%)" for r in rows)
    return {"sconv_k_plus_v_fusion": {"rows": rows, "summary": "two launches -> one over both streams: " + summary}}
