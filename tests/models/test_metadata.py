"""Per-step metadata of the decoder layers: slots that would belong to another position are -1; the
models' block sizes come from every layer's bound caches, which must agree."""

import pytest
import torch

from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
from stepops.ops.step_metadata import paged_slot_mapping
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


def test_a_model_without_caches_cannot_build_metadata():
    model = Step5Model(Step5Config())
    with pytest.raises(ValueError, match=r"^CSA ring rows_per_block: no cache bound for layers.1.csa_ring "):
        model.rows_per_block
    with pytest.raises(ValueError, match=r"^attention block size: no cache bound for layers.0.attn, layers.1.attn "):
        model.attn_block_size
    inkling = InklingModel(InklingConfig())
    with pytest.raises(ValueError, match=r"^conv-state block size: no cache bound for layers.0.conv_state, "):
        inkling.conv_block_size


def test_layers_must_share_block_sizes():
    """One set of block tables addresses every layer: a layer bound with another geometry is an error."""
    model = Step5Model(Step5Config(layer_types=("csa", "csa")))
    model.allocate_caches(3, 1, "cpu")
    capacity, block_size = model.rows_per_block, model.attn_block_size
    second = model.layers[1]
    # The same pages, strided two rows wider: a valid ring on its own, but not the stride of layer 0's ring.
    buffer = torch.zeros(3 * (capacity + 2) * 512, dtype=torch.bfloat16)
    second.csa_ring.bind_kv_cache(buffer.as_strided((3, capacity, 1, 512), ((capacity + 2) * 512, 512, 512, 1)))
    with pytest.raises(ValueError) as info:
        model.rows_per_block
    assert str(info.value) == (
        "CSA ring rows_per_block must be the same for every layer (one block table serves them all), got "
        f"layers.0.csa_ring: {capacity}, layers.1.csa_ring: {capacity + 2}"
    )
    kv = second.attn.kv_cache
    second.attn.bind_kv_cache(torch.zeros(kv.shape[0], 2 * block_size, *kv.shape[2:], dtype=kv.dtype))
    with pytest.raises(ValueError, match=rf"got layers.0.attn: {block_size}, layers.1.attn: {2 * block_size}$"):
        model.attn_block_size


@pytest.mark.parametrize("num_tokens", [0, 3])
def test_model_metadata_of_a_step_without_requests(num_tokens):
    """R = 0 (and T = 0): every token is padding, no slot anywhere, and nothing gathers from an empty table."""
    from stepops.models.metadata import StepBuffers, build_inkling_metadata, build_step5_metadata

    def empty(*shape):
        return torch.zeros(*shape, dtype=torch.int32)

    buffers = StepBuffers(empty(1), empty(0), empty(0, 4), empty(0), empty(0, 2), empty(0, 3))
    step5 = build_step5_metadata(buffers, num_tokens, attn_block_size=16, rows_per_block=10, summary_block_size=4)
    inkling = build_inkling_metadata(buffers, num_tokens, attn_block_size=16, conv_block_size=4)
    pad = [-1] * num_tokens
    assert step5.attn_slot_mapping.tolist() == pad and step5.ring.summary_slot.tolist() == pad
    assert step5.summary_block_table is buffers.summary_block_table and step5.summary_block_size == 4
    assert inkling.attn_slot_mapping.tolist() == pad and inkling.sconv.slot_mapping.tolist() == pad
