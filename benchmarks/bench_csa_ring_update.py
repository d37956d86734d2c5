"""``stepops::csa_ring_update``: the Step5 CSA tail ring's step update (ring rows and region summaries).

Shape: Step5's indexer (proxy_dim P = 256, rows ``[index_k | index_z]`` of 1024 B) in the layout CLI's
default page (block size 64: a ring of 72 rows, blocks 72 rows apart), bf16 summaries. Request 0 of every
decode and verify step closes a region, other requests close one where their position says so.
"""

from __future__ import annotations

import torch

from benchmarks.harness import Case, Workload
from benchmarks.steps import generator as case_generator, standard_cases
from stepops._meta.csa_ring_update import REGION_SIZE
from stepops.ops.csa_ring_update.samples import make_step
from stepops.testing import TOLERANCES

OP = "csa_ring_update"
FLOOR = (
    "index_k + index_z read (T x 2P x 2 B) + 5 metadata tensors (5 x T x 4 B) + ring rows replayed from "
    "earlier steps (2P x 2 B each) + stored rows (min(n, capacity) per request x 2P x 2 B) + summaries "
    "written (closing tokens x P x 2 B)"
)
# The naive baseline computes the textbook softmax(z) . k in fp32, not the op's fixed-order online fold:
# both round once to bf16, so they may differ by one bf16 ulp.
# On a GPU, Inductor's Triton code for the compiled kernel may contract the fold's multiply-adds into FMAs.
TOLERANCES = {
    ("naive", "summary_cache"): TOLERANCES["csa_ring_summary_bf16_vs_bf16"],
    ("compiled", "summary_cache", "cuda"): TOLERANCES["csa_ring_summary_bf16_vs_bf16"],
}

PROXY_DIM, CAPACITY = 256, 72


def cases(quick: bool) -> list[Case]:
    return standard_cases(quick)


def build(case: Case, device: torch.device) -> Workload:
    prior_lens, new_lens = case.params["prior_lens"], case.params["new_lens"]
    step = make_step(
        new_lens,
        [p + n for p, n in zip(prior_lens, new_lens)],
        proxy_dim=PROXY_DIM,
        capacity=CAPACITY,
        device=device,
        generator=case_generator(case),
    )
    row = 2 * PROXY_DIM * step.index_k.element_size()
    replayed = closing = 0
    for p0, n in zip(prior_lens, new_lens):
        for p in range(p0, p0 + n):
            if p % REGION_SIZE == REGION_SIZE - 1:
                closing += 1
                replayed += max(0, p0 - (p - (REGION_SIZE - 1)))
    stored = sum(min(n, CAPACITY) for n in new_lens)
    metadata = sum(m.numel() * m.element_size() for m in step.metadata)
    floor = (
        case.num_tokens * row
        + metadata
        + replayed * row
        + stored * row
        + closing * PROXY_DIM * step.summary_cache.element_size()
    )
    return Workload(step.op_args(), floor)


def naive(
    index_k, index_z, ring, summary_cache, token_position, token_chunk_start, token_chunk_len, token_ring_base,
    token_summary_slot, capacity,
) -> None:
    """What a user writes first: walk the tokens; for a closing token gather its region's 8 rows (ring rows
    before the step, this step's rows after), write ``sum(softmax(z) * k)`` (fp32, then bf16); then store the last
    ``capacity`` rows of each request. Summaries first, so every replay reads the ring before the stores."""
    if summary_cache.dtype != torch.bfloat16:
        raise TypeError("the naive baseline writes bf16 summaries only")
    proxy_dim = index_k.shape[1]
    rows = torch.cat([index_k, index_z], dim=1)
    position, start = token_position.tolist(), token_chunk_start.tolist()
    length, base, slot = token_chunk_len.tolist(), token_ring_base.tolist(), token_summary_slot.tolist()
    for t, p in enumerate(position):
        if p < 0 or p % REGION_SIZE != REGION_SIZE - 1 or slot[t] < 0:
            continue
        first = p - (t - start[t])
        from_ring = max(0, first - (p - (REGION_SIZE - 1)))
        ring_rows = torch.tensor(
            [base[t] + q % capacity for q in range(p - (REGION_SIZE - 1), p - (REGION_SIZE - 1) + from_ring)],
            dtype=torch.long, device=ring.device,
        )
        region = torch.cat([ring.index_select(0, ring_rows), rows[t + 1 - (REGION_SIZE - from_ring) : t + 1]])
        k, z = region.float().split(proxy_dim, dim=1)
        summary_cache[slot[t]] = (torch.softmax(z, dim=0) * k).sum(0).to(summary_cache.dtype)
    for t, p in enumerate(position):
        if p >= 0 and t - start[t] >= length[t] - capacity:
            ring[base[t] + p % capacity] = rows[t]
