"""``put_rows_``: a masked row write with static shapes writes the kept rows and not one other byte."""

import pytest
import torch

from stepops.ops.put_rows import put_rows_


def _random_bf16(*shape, generator):
    """Random bit patterns, NaNs with payloads included: a copy that passes through arithmetic shows."""
    return torch.randint(0, 1 << 16, shape, dtype=torch.int32, generator=generator).to(torch.uint16).view(torch.bfloat16)


def _expected(dest, index, values, keep):
    want = dest.clone()
    for t in range(keep.numel()):
        if keep[t]:
            want[tuple(int(i[t]) for i in index)] = values[t]
    return want


@pytest.mark.parametrize("keep", ["none", "some", "all", "empty"])
@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
def test_writes_the_kept_rows_and_no_other_byte(keep, mode):
    gen = torch.Generator().manual_seed(0)
    num_tokens = 0 if keep == "empty" else 6
    dest = _random_bf16(5, 4, 3, 8, generator=gen)  # rows addressed by (block, offset): [5, 4] of [3, 8]
    values = _random_bf16(num_tokens, 3, 8, generator=gen)
    flat = torch.randperm(20, generator=gen)[:num_tokens]
    keep_mask = {
        "none": torch.zeros(num_tokens, dtype=torch.bool),
        "some": torch.tensor([False, True, False, True, True, False]),
        "all": torch.ones(num_tokens, dtype=torch.bool),
        "empty": torch.zeros(0, dtype=torch.bool),
    }[keep]
    # Rows outside the mask carry indices that address nothing: -1 and far out of range.
    flat = torch.where(keep_mask, flat, torch.tensor([-1, 10**6] * 3)[:num_tokens])
    index = (flat // 4, flat % 4)
    want = _expected(dest, index, values, keep_mask)
    put = put_rows_
    if mode != "eager":  # one graph (fullgraph), and the same bytes: Inductor must not touch NaN payloads
        torch._dynamo.reset()
        put = torch.compile(put_rows_, fullgraph=True, dynamic=True, backend=mode)
    put(dest, index, values, keep_mask)
    assert torch.equal(dest.view(torch.uint16), want.view(torch.uint16))
