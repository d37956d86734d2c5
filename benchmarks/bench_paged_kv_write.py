"""``stepops::paged_kv_write``: one step's keys and values into an NHD paged KV cache.

Shape: the Llama-8B-sized Inkling attention layer (8 KV heads, head size 128, bf16, 16-token pages);
each real token writes its own slot (distinct random slots, as an allocator hands them out).
"""

from __future__ import annotations

import torch

from benchmarks.harness import Case, Workload
from benchmarks.steps import generator as case_generator, standard_cases
from stepops.ops.paged_kv_write.reference import paged_kv_write_reference

OP = "paged_kv_write"
FLOOR = "slot_mapping (T x 4 B) + real tokens x H x (D + Dv) x 2 B read + the same written"

NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 128, 16


def cases(quick: bool) -> list[Case]:
    return standard_cases(quick)


def build(case: Case, device: torch.device) -> Workload:
    generator = case_generator(case)
    tokens = case.num_tokens
    num_blocks = 2 * (-(-tokens // BLOCK_SIZE)) + case.num_requests
    shape = (tokens, NUM_HEADS, HEAD_SIZE)
    key = torch.randn(shape, generator=generator).to(device=device, dtype=torch.bfloat16)
    value = torch.randn(shape, generator=generator).to(device=device, dtype=torch.bfloat16)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    key_cache = torch.randn(cache_shape, generator=generator).to(device=device, dtype=torch.bfloat16)
    value_cache = torch.randn(cache_shape, generator=generator).to(device=device, dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator)[:tokens].to(device=device, dtype=torch.int32)
    row_bytes = NUM_HEADS * 2 * HEAD_SIZE * key.element_size()
    floor = tokens * slots.element_size() + 2 * tokens * row_bytes
    return Workload((key, value, key_cache, value_cache, slots), floor)


naive = paged_kv_write_reference
