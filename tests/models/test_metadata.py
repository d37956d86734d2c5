"""Per-step metadata of the decoder layers: slots that would belong to another position are -1."""

import torch

from stepops.models.metadata import paged_slot_mapping
from stepops.ops.step_metadata import build_token_metadata


def _slots(query_start_loc, seq_lens, block_table, block_size, num_tokens):
    token = build_token_metadata(
        torch.tensor(query_start_loc, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), num_tokens
    )
    return paged_slot_mapping(token, torch.tensor(block_table, dtype=torch.int32), block_size).tolist()


def test_slots_inside_the_table():
    # Request 0: positions 2..5 of blocks [3, 5]; request 1: positions 0..1 of block 7; two padding tokens.
    got = _slots([0, 4, 6], [6, 2], [[3, 5], [7, -1]], 4, 8)
    assert got == [3 * 4 + 2, 3 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 7 * 4 + 0, 7 * 4 + 1, -1, -1]


def test_positions_past_the_table_get_no_slot():
    # Blocks [3, 5] with N = 4 map positions 0..7; positions 8 and 9 would have been clamped into block 5
    # (slots 20, 21: positions 4 and 5 of the same request).
    assert _slots([0, 4], [10], [[3, 5]], 4, 4) == [5 * 4 + 2, 5 * 4 + 3, -1, -1]


def test_an_unallocated_block_gets_no_slot():
    # Position 4 falls in the second column, whose entry is -1: -1 * 4 + 0 would be a negative slot.
    assert _slots([0, 2], [5], [[3, -1]], 4, 2) == [3 * 4 + 3, -1]
