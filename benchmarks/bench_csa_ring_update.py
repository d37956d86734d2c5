"""``stepops::csa_ring_update``: the Step5 CSA tail ring's step update (ring rows and region summaries).

Shape: Step5's indexer (proxy_dim P = 256, rows ``[index_k | index_z]`` of 1024 B) in the layout CLI's
default page (block size 64: a ring of 72 rows, blocks 72 rows apart), bf16 summaries. Request 0 of every
decode and verify step closes a region, other requests close one where their position says so.
"""

from __future__ import annotations

import torch

from benchmarks.harness import Case, Workload
from benchmarks.steps import generator as case_generator, standard_cases
from stepops.layouts import REGION_SIZE
from stepops.ops.csa_ring_update.reference import csa_ring_update_reference
from stepops.ops.csa_ring_update.samples import make_step
from stepops.testing import TOLERANCES

OP = "csa_ring_update"
FLOOR = (
    "index_k + index_z read (T x 2P x 2 B) + 5 metadata tensors (5 x T x 4 B) + ring rows replayed from "
    "earlier steps (2P x 2 B each) + stored rows (min(n, capacity) per request x 2P x 2 B) + summaries "
    "written (closing tokens x P x 2 B)"
)
# On a GPU, Inductor's Triton code for the compiled kernel may contract the fold's multiply-adds into FMAs.
TOLERANCES = {
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


naive = csa_ring_update_reference
