"""stepops.models.paged_attention against two oracles: the dense path (stepops.testing.dense_attention's
``gather_paged_keys`` + ``masked_attention``) and an independent fp64 per-request recompute, on random paged
caches with ragged requests, prefill chunks, decode, verify, padding, sliding windows, bias tables, GQA and
unallocated (-1) block-table entries; eager and compiled (``fullgraph=True``); fp32 and bf16.

Tolerances (measured on these scenarios over seeds 0-19 and both windows; the softmax's
summation order is the only difference):
- fp32 output vs the dense path (fp32 inside too): the online softmax adds chunk sums in another order and
  divides once at the end instead of normalising the weights first: max |diff| 3.6e-7 (outputs |o| < 3),
  so atol = rtol = 1e-5 (~30x margin); a masking error moves outputs by O(0.1).
- bf16 output: both round their weights to bf16 into ``P V`` and the output once, the paged path its weights
  against each chunk's running max, the dense path against the row's; fp32 values 1e-7 apart can straddle a
  bf16 rounding boundary, one bf16 ulp apart: rtol 2**-7, atol 2**-10.
- vs the fp64 recompute (bias, windows): max |diff| 4.0e-7; atol = rtol = 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from stepops.testing.dense_attention import gather_paged_keys, masked_attention
from stepops.models.paged_attention import (
    csa_region_scorer,
    paged_attention,
    region_summary_slots,
    sparse_region_attention,
    streaming_topk,
)
from stepops.models.runner import INDUCTOR_OPTIONS
from stepops.ops.csa_ring_update import build_csa_ring_metadata
from stepops.ops.step_metadata import TokenMetadata, build_token_metadata
from stepops.testing import INDUCTOR_KEEPS_BF16_ROUNDINGS
from stepops.testing.memory import peak_transient_bytes

try:  # torch >= 2.12 keeps it in torch._inductor.utils; older releases in cudagraph_utils
    from torch._inductor.utils import get_first_incompatible_cudagraph_node
except ImportError:  # pragma: no cover - depends on the torch version
    from torch._inductor.cudagraph_utils import get_first_incompatible_cudagraph_node

HQ, HKV, D, DV = 4, 2, 8, 6  # Dv != D: a K/V mix-up cannot pass
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2**-10, rtol=2**-7)}


@dataclass
class Step:
    query: torch.Tensor  # [T, HQ, D]
    kv_cache: torch.Tensor  # [num_blocks, N, HKV, D + DV]
    block_table: torch.Tensor  # [R, max_blocks] int32
    token: TokenMetadata
    seq_lens: list[int]


def make_step(prior: list[int], new: list[int], num_tokens: int, *, block_size=4, max_blocks=12, seed=0,
              dtype=torch.float32, strided=False, heads=(HQ, HKV)) -> Step:
    """Requests with ``prior[r]`` cached tokens and ``new[r]`` in this step (padded to ``num_tokens``);
    ``heads``: (query heads, KV heads).

    Blocks are a random permutation; table entries past each request's need are -1 (unallocated); the
    cache is random everywhere (stale rows must be masked, not zero). ``strided``: the cache is a slice of
    a wider allocation (page stride != N * H * (D + Dv)).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prior, new)]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(new), max_blocks), -1, dtype=torch.int32)
    for r, n in enumerate(needed):
        table[r, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    width = D + DV + (5 if strided else 0)
    num_heads, num_kv_heads = heads
    kv = torch.randn(num_blocks, block_size, num_kv_heads, width, generator=gen).to(dtype)[..., : D + DV]
    qsl = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    token = build_token_metadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), num_tokens)
    query = torch.randn(num_tokens, num_heads, D, generator=gen).to(dtype)
    return Step(query, kv, table, token, seq_lens)


# (prior tokens, new tokens, padded T): decode, verify (k = 3), prefill chunks (one from 0, one continued),
# a mixed step; every one with padding and ragged context lengths.
SCENARIOS = {
    "decode": ([5, 37, 20], [1, 1, 1], 4),
    "verify": ([13, 30], [4, 4], 9),
    "prefill": ([0, 20], [9, 3], 16),
    "mixed": ([40, 0, 7], [1, 11, 4], 17),
}


def dense_oracle(step: Step, scale: float, window: int | None) -> torch.Tensor:
    """The dense path: every token gathers its request's whole table."""
    keys = gather_paged_keys(step.kv_cache, D, step.block_table, step.token)
    allowed = keys.causal
    if window is not None:
        key_position = torch.arange(allowed.shape[1])
        allowed = allowed & (key_position[None, :] > step.token.position.long()[:, None] - window)
    return masked_attention(step.query, keys.key, keys.value, allowed, scale)


def fp64_recompute(step: Step, scale: float, window=None, bias=None, regions=None, *, as_the_kernel=False) -> torch.Tensor:
    """Per token, in fp64: its request's K/V read position by position through the table, a boolean mask,
    softmax, weighted sum. ``regions [T, G, K]``: CSA selection (own region added); None = all causal keys.

    ``as_the_kernel``: in fp32 as StepFun's ``sparse_attention_*`` kernel folds one tile instead: the weights
    ``exp(s - max)`` summed in fp32 and rounded to the values' dtype into ``P V``
    (``tl.dot(probabilities.to(values.dtype), values)``), divided by the sum once, rounded to the query's dtype."""
    block_size, num_heads, num_kv_heads = step.kv_cache.shape[1], step.query.shape[1], step.kv_cache.shape[2]
    dtype = torch.float32 if as_the_kernel else torch.float64
    out = torch.zeros(step.query.shape[0], num_heads, DV, dtype=dtype)
    for t in range(step.query.shape[0]):
        p, r = int(step.token.position[t]), int(step.token.request[t])
        if p < 0:
            continue
        k_pos = torch.arange(p + 1)
        slots = step.block_table[r, k_pos // block_size].long() * block_size + k_pos % block_size
        rows = step.kv_cache.flatten(0, 1)[slots]  # [p + 1, Hkv, D + DV]
        for h in range(num_heads):
            kv_head = h // (num_heads // num_kv_heads)
            scores = rows[:, kv_head, :D].to(dtype) @ step.query[t, h].to(dtype) * scale
            keep = torch.ones(p + 1, dtype=torch.bool)
            if window is not None:
                keep &= k_pos > p - window
            if bias is not None:
                d = p - k_pos
                extent = bias.shape[-1]
                scores = scores + torch.where(d < extent, bias[t, h].to(dtype)[d.clamp(max=extent - 1)], 0.0)
            if regions is not None:
                g = kv_head // (num_kv_heads // regions.shape[1])
                chosen = set(regions[t, g].tolist()) | {p // 8}
                keep &= torch.tensor([int(k) // 8 in chosen for k in k_pos])
            values = rows[:, kv_head, D:]
            if as_the_kernel:
                weights = torch.exp(scores[keep] - scores[keep].max())
                out[t, h] = (weights.to(values.dtype).float()[:, None] * values[keep].float()).sum(0) / weights.sum()
            else:
                weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), 0)
                out[t, h] = weights @ values.double()
    return out.to(step.query.dtype) if as_the_kernel else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_paged_attention_matches_dense_path(scenario, window, dtype):
    prior, new, num_tokens = SCENARIOS[scenario]
    step = make_step(prior, new, num_tokens, dtype=dtype, strided=scenario == "mixed")
    want = dense_oracle(step, 0.3, window)
    # keys_per_chunk 8 = 2 blocks: several chunks and a short last one; query_tile 3 splits prefill chunks.
    got = paged_attention(step.query, step.kv_cache, step.block_table, step.token, scale=0.3,
                          sliding_window=window, query_tile=3, keys_per_chunk=8)
    assert got.dtype == dtype and got.shape == (num_tokens, HQ, DV)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    padding = step.token.position < 0
    assert padding.any() and got[padding].eq(0).all()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("scenario", ["verify", "mixed"])
def test_paged_attention_with_distance_bias_matches_fp64(scenario, window):
    prior, new, num_tokens = SCENARIOS[scenario]
    step = make_step(prior, new, num_tokens)
    bias = torch.randn(num_tokens, HQ, 7)  # extent 7: distances 7+ get none, inside and outside the window
    got = paged_attention(step.query, step.kv_cache, step.block_table, step.token, scale=0.25,
                          sliding_window=window, distance_bias=bias, query_tile=2, keys_per_chunk=4)
    torch.testing.assert_close(got.double(), fp64_recompute(step, 0.25, window, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_tile", [1, 4, 16])
def test_tiling_and_chunking_change_only_the_summation_order(query_tile):
    step = make_step(*SCENARIOS["mixed"])
    want = fp64_recompute(step, 0.5)
    for keys_per_chunk in (4, 12, 1024):
        got = paged_attention(step.query, step.kv_cache, step.block_table, step.token, scale=0.5,
                              query_tile=query_tile, keys_per_chunk=keys_per_chunk)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_sliding_window_reads_only_its_columns():
    """With a window, the table's columns before it are never gathered: poisoning those blocks with NaN, or
    freeing them (-1, as an engine frees blocks that left every window), changes nothing."""
    step = make_step([40, 33], [1, 4], 6, max_blocks=16)
    want = paged_attention(step.query, step.kv_cache, step.block_table, step.token, scale=0.5, sliding_window=6)
    kv, table = step.kv_cache.clone(), step.block_table.clone()
    for r, length in enumerate(step.seq_lens):
        before_window = slice(0, (length - 10) // 4)
        kv[table[r, before_window].long()] = float("nan")
        table[r, before_window] = -1
    assert torch.equal(paged_attention(step.query, kv, step.block_table, step.token, scale=0.5, sliding_window=6), want)
    assert torch.equal(paged_attention(step.query, step.kv_cache, table, step.token, scale=0.5, sliding_window=6), want)


@pytest.mark.parametrize("unallocated", [-1, -(2**31)])
def test_unallocated_block_inside_the_context_is_masked(unallocated):
    """A negative entry among a request's columns (a block the engine never wrote or freed) hides its keys,
    in both attentions and in the dense oracle; it is never read as block 0 (another request's), and an entry
    far below ``-num_blocks`` is no out-of-range index."""
    step = make_step(*SCENARIOS["verify"], block_size=8, max_blocks=7)
    table = step.block_table.clone()
    table[1, 1] = unallocated  # request 1's positions 8..15: region 1
    keys = gather_paged_keys(step.kv_cache, D, table, step.token)
    full = gather_paged_keys(step.kv_cache, D, step.block_table, step.token).causal
    region = torch.arange(keys.causal.shape[1]) // 8
    hole = (region == 1) & (step.token.request == 1)[:, None]
    assert full[hole].any() and torch.equal(keys.causal, full & ~hole)
    got = paged_attention(step.query, step.kv_cache, table, step.token, scale=0.5, keys_per_chunk=8)
    want = masked_attention(step.query, keys.key, keys.value, keys.causal, 0.5)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    ids = torch.tensor([1, 0]).expand(step.query.shape[0], 1, 2)
    got = sparse_region_attention(step.query, step.kv_cache, table, step.token, ids, scale=0.5)
    own = region[None, :] == step.token.position.long()[:, None] // 8
    want = masked_attention(step.query, keys.key, keys.value, keys.causal & ((region < 2) | own), 0.5)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_a_table_without_columns_reads_nothing():
    """``max_blocks = 0``: every key is unallocated, so every output row is zero (no gather from column -1)."""
    step = make_step(*SCENARIOS["decode"], block_size=8, max_blocks=7)
    table = step.block_table[:, :0]
    ids = torch.full((step.query.shape[0], 1, 2), -1)
    for got in (paged_attention(step.query, step.kv_cache, table, step.token, scale=0.5),
                sparse_region_attention(step.query, step.kv_cache, table, step.token, ids, scale=0.5)):
        assert torch.equal(got, torch.zeros_like(got))


def poison_unused_rows(step: Step, fill: float) -> torch.Tensor:
    """The cache with every row that holds no committed position of a request (past a request's length, in
    spare blocks, and block 0, which -1 table entries are clamped to when not a request's) set to ``fill``."""
    block_size = step.kv_cache.shape[1]
    used = torch.zeros(step.kv_cache.shape[:2], dtype=torch.bool)
    for r, length in enumerate(step.seq_lens):
        position = torch.arange(length)
        used[step.block_table[r, position // block_size].long(), position % block_size] = True
    return step.kv_cache.masked_fill(~used[:, :, None, None], fill)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
@pytest.mark.parametrize("scenario", ["verify", "mixed"])
def test_unused_cache_rows_holding_nan_or_inf_change_nothing(scenario, fill):
    """A masked key contributes an exact 0 whatever its row holds: its score is replaced by -inf and its
    value by 0 (``0 * NaN`` would be NaN), in every attention; outputs stay finite and bitwise equal."""
    step = make_step(*SCENARIOS[scenario], block_size=8, max_blocks=7)
    poisoned = poison_unused_rows(step, fill)
    assert not poisoned.isfinite().all()
    bias = torch.randn(step.query.shape[0], HQ, 5)
    ids = selection(step.query.shape[0], 2, 2, step.token.position, seed=5)

    def attend(kv):
        full = paged_attention(step.query, kv, step.block_table, step.token, scale=0.3, distance_bias=bias,
                               query_tile=2, keys_per_chunk=16)
        window = paged_attention(step.query, kv, step.block_table, step.token, scale=0.3, sliding_window=6)
        sparse = sparse_region_attention(step.query, kv, step.block_table, step.token, ids, scale=0.3)
        return full, window, sparse

    for got, want in zip(attend(poisoned), attend(step.kv_cache)):
        assert got.isfinite().all()
        assert torch.equal(got, want)


def selection(num_tokens: int, groups: int, k: int, position: torch.Tensor, seed: int) -> torch.Tensor:
    """Random distinct earlier-region ids per (token, group); -1 where fewer exist, sometimes the own id."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((num_tokens, groups, k), -1, dtype=torch.int64)
    for t in range(num_tokens):
        own = int(position[t]) // 8
        for g in range(groups):
            pick = torch.randperm(own + 1, generator=gen)[:k]  # may include the own region: ignored
            ids[t, g, : len(pick)] = pick
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sparse_region_attention_matches_dense_path(scenario, dtype):
    prior, new, num_tokens = SCENARIOS[scenario]
    step = make_step(prior, new, num_tokens, block_size=8, max_blocks=7, dtype=dtype)
    ids = selection(num_tokens, 1, 2, step.token.position, seed=1)
    got = sparse_region_attention(step.query, step.kv_cache, step.block_table, step.token, ids, scale=0.3)
    keys = gather_paged_keys(step.kv_cache, D, step.block_table, step.token)
    region = torch.arange(keys.causal.shape[1]) // 8
    chosen = (region[None, :, None] == ids[:, 0][:, None, :]).any(-1)
    own = region[None, :] == step.token.position.long()[:, None] // 8
    want = masked_attention(step.query, keys.key, keys.value, keys.causal & (chosen | own), 0.3)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert got[step.token.position < 0].eq(0).all()


@pytest.mark.parametrize("scenario", ["prefill", "mixed"])
def test_bf16_attention_rounds_its_weights_into_p_v_as_the_reference_kernel(scenario):
    """The weights enter ``P V`` rounded to bf16 (they stay fp32 in the sum): against a per-token transcription of
    the reference kernel's fold, within the bf16 rule and differing on at most 2% of the elements (the sums run in
    other orders; measured bitwise), where weights kept in fp32 differ on 18% of them."""
    step = make_step(*SCENARIOS[scenario], block_size=8, max_blocks=7, dtype=torch.bfloat16)
    ids = selection(step.query.shape[0], 1, 2, step.token.position, seed=1)
    # One chunk for paged_attention: its online softmax then folds once, as the kernel's one tile.
    for got, regions in (
        (sparse_region_attention(step.query, step.kv_cache, step.block_table, step.token, ids, scale=0.3), ids),
        (paged_attention(step.query, step.kv_cache, step.block_table, step.token, scale=0.3, keys_per_chunk=56), None),
    ):
        want = fp64_recompute(step, 0.3, regions=regions, as_the_kernel=True)
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])
        assert (got != want).float().mean() <= 0.02  # measured 0; fp32 weights: 18%


# Hkv = 4 in 2 groups: group g is KV heads 2g, 2g + 1 (consecutive), which interleaved heads (g, g + 2) are not.
@pytest.mark.parametrize("kv_heads, groups", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_sparse_region_attention_per_kv_group_matches_fp64(kv_heads, groups):
    step = make_step(*SCENARIOS["mixed"], block_size=16, max_blocks=4, heads=(2 * kv_heads, kv_heads))
    ids = selection(step.query.shape[0], groups, 3, step.token.position, seed=2)
    got = sparse_region_attention(step.query, step.kv_cache, step.block_table, step.token, ids, scale=0.4)
    want = fp64_recompute(step, 0.4, regions=ids)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "num_items,k,chunk", [(37, 5, 8), (37, 5, 3), (4, 6, 2), (16, 16, 5), (300, 5, 64), (300, 40, 128)]
)
def test_streaming_topk_equals_stable_sort(num_items, k, chunk):
    """Many ties (scores in {0, 1, 2}) and -inf entries, with per-(token, group) scores [T, G, items]. The
    model's chunks are 128 wide: CPU's unstable sort reorders ties from 17 items on, so those sizes too."""
    scores = torch.randint(0, 3, (6, 2, num_items)).float()
    scores[torch.rand(scores.shape) < 0.3] = float("-inf")
    values, ids = streaming_topk(lambda start, size: scores[..., start : start + size], num_items, k, chunk)
    ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    n = min(k, num_items)
    assert values.shape == ids.shape == (6, 2, k)
    assert torch.equal(values[..., :n], ranked.values[..., :n]) and torch.equal(ids[..., :n], ranked.indices[..., :n])
    assert ids[..., n:].eq(-1).all() and values[..., n:].eq(float("-inf")).all()


def test_csa_region_scorer_selects_as_the_dense_indexer():
    """The dense per-KV-group selection (the Step5 layer's before it streamed: [T, G, num_regions] scores over
    the e4m3 summaries of every region) and the streaming one select the same regions, ties included (a
    zeroed query ties every region at exactly 0). Scores match to an fp32 ulp, not bitwise: a chunk's einsum is a smaller BLAS call."""
    gen = torch.Generator().manual_seed(3)
    step = make_step([70, 9, 33], [1, 4, 2], 8, block_size=8, max_blocks=12)
    groups, heads, proxy, summary_block_size, num_regions = 2, 3, 32, 4, 12
    iq = torch.randn(8, groups, heads, proxy, generator=gen).to(torch.float8_e4m3fn).float()
    iq[1:3] = 0  # every score 0: ties resolved by id
    weights = torch.randn(8, groups, heads, generator=gen)
    summary = torch.randn(40, proxy, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)  # as the cache
    summary_table = torch.randperm(10, generator=gen)[:9].view(3, 3).int()
    scorer = csa_region_scorer(iq, weights, summary, summary_table, summary_block_size, step.token)
    values, ids = streaming_topk(scorer, num_regions, 3, 5)

    slots = region_summary_slots(summary_table, summary_block_size, step.token.request, 0, num_regions)
    dense = torch.einsum("tghp,trp->tghr", iq, summary[slots].view(torch.float8_e4m3fn).float())
    dense = (torch.relu(dense) * weights[..., None]).sum(2)
    later = torch.arange(num_regions) >= (step.token.position.long() // 8)[:, None, None]
    ranked = torch.sort(dense.masked_fill(later, float("-inf")), dim=-1, descending=True, stable=True)
    assert torch.equal(ids, ranked.indices[..., :3])
    torch.testing.assert_close(values, ranked.values[..., :3], atol=1e-6, rtol=1e-6)


def test_indexer_reads_each_summary_where_the_csa_op_writes_it():
    """The CSA builder's slot for a closing token and the indexer's slot for the region it closes are one
    slot, and both are the written-out paged rule: -1 for an unallocated (negative) entry and for a column
    past the table (request 0 reaches column 2 of a 2-column table; request 1's column 1 is -1)."""
    summary_block_size, seq_lens, new = 2, [40, 24, 24], [16, 8, 9]  # closes at positions 31, 39; 23; 15, 23
    summary_table = torch.tensor([[3, 0], [4, -1], [1, 2]], dtype=torch.int32)
    qsl = torch.tensor([0, 16, 24, 33], dtype=torch.int32)
    meta = build_csa_ring_metadata(
        qsl, torch.tensor(seq_lens, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 16, summary_table,
        summary_block_size, 36,
    )
    token = build_token_metadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), 36)
    read = region_summary_slots(summary_table, summary_block_size, token.request, 0, 6)
    closing = []
    for r in range(3):
        for position in range(seq_lens[r] - new[r], seq_lens[r]):
            if position % 8 == 7:
                t = int(qsl[r]) + position - (seq_lens[r] - new[r])
                column, offset = divmod(position // 8, summary_block_size)
                entry = int(summary_table[r, column]) if column < summary_table.shape[1] else -1
                want = entry * summary_block_size + offset if entry >= 0 else -1
                closing.append(t)
                assert int(meta.summary_slot[t]) == want == int(read[t, position // 8]), (r, position)
    assert [int(meta.summary_slot[t]) for t in closing] == [1, -1, -1, 3, 4]
    assert meta.summary_slot[[t for t in range(36) if t not in closing]].eq(-1).all()


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_dense_oracle_ignores_non_finite_values_of_masked_keys(per_kv_head):
    """The oracle's documented contract: a masked key (stale or never written, NaN) reaches no output, and a
    token with no allowed key (padding) is zero."""
    gen = torch.Generator().manual_seed(5)
    query, key = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 5, 2, 8, generator=gen)
    value = torch.randn(3, 5, 2, 6, generator=gen)
    allowed = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    if per_kv_head:
        allowed = allowed[:, None, :].expand(3, 2, 5)
    poisoned = value.clone()
    poisoned[0, 2:] = float("nan")
    poisoned[1, 4] = float("inf")
    poisoned[2] = float("nan")
    want = masked_attention(query, key, value, allowed, 0.3)
    got = masked_attention(query, key, poisoned, allowed, 0.3)
    assert torch.equal(got, want) and got[2].eq(0).all()


def test_dense_oracle_refuses_a_distance_bias_without_positions():
    """A relative bias has no distances to index without each token's position: an error, not a guess."""
    query, key, value = torch.zeros(2, 2, 4), torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4)
    allowed = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="rel_bias needs each token's position"):
        masked_attention(query, key, value, allowed, 1.0, rel_bias=torch.zeros(2, 2, 3))


def test_dense_oracle_per_kv_head_masks_reach_their_own_query_heads():
    """``allowed [T, Hkv, S]``: KV head ``g``'s key set is its query heads' alone, as if attention ran on that
    group with the ``[T, S]`` mask (KV head g's query heads are 2g and 2g + 1 here)."""
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(s, generator=gen) for s in ((3, 4, 8), (3, 5, 2, 8), (3, 5, 2, 6)))
    allowed = torch.rand(3, 2, 5, generator=gen) < 0.5
    allowed[..., 0] = True
    assert not torch.equal(allowed[:, 0], allowed[:, 1])
    got = masked_attention(query, key, value, allowed, 0.3)
    for g in range(2):
        heads = slice(2 * g, 2 * g + 2)
        want = masked_attention(query[:, heads], key[:, :, g : g + 1], value[:, :, g : g + 1], allowed[:, g], 0.3)
        torch.testing.assert_close(got[:, heads], want, atol=0, rtol=0)


def test_csa_region_scorer_never_scores_an_unallocated_summary_block():
    """Regions whose summary block is -1, or past the table's columns, score -inf (they read block 0, another
    request's summaries); the allocated ones score as before."""
    gen = torch.Generator().manual_seed(4)
    step = make_step([70, 9, 33], [1, 4, 2], 8, block_size=8, max_blocks=12)
    iq = torch.randn(8, 1, 2, 16, generator=gen).to(torch.float8_e4m3fn).float()
    weights = torch.rand(8, 1, 2, generator=gen) + 0.5
    summary = torch.randn(40, 16, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
    full_table = torch.tensor([[3, 5, 7], [1, 2, 4], [6, 8, 9]], dtype=torch.int32)
    table = full_table.clone()
    table[0, 1] = -1  # request 0's regions 4..7
    narrow = table[:, :2]  # request 0's regions 8.. fall past the table
    region = torch.arange(12)
    for t, unallocated in ((table, (region >= 4) & (region < 8)), (narrow, (region >= 4))):
        got = csa_region_scorer(iq, weights, summary, t, 4, step.token)(0, 12)
        want = csa_region_scorer(iq, weights, summary, full_table, 4, step.token)(0, 12)
        request_0 = step.token.request == 0
        assert got[request_0][..., unallocated].eq(float("-inf")).all()
        assert torch.equal(got[request_0][..., ~unallocated], want[request_0][..., ~unallocated])
        assert torch.equal(got[~request_0][:, :, :8], want[~request_0][:, :, :8])


def _all_three(step: Step, bias: torch.Tensor, ids: torch.Tensor):
    # Three one-block chunks (Inductor compiles each chunk's kernels apart: few chunks keep this fast); one
    # block per chunk with a bias is the shape torch 2.11's Inductor once failed to compile.
    full = paged_attention(step.query, step.kv_cache, step.block_table, step.token, scale=0.3,
                           distance_bias=bias, query_tile=3, keys_per_chunk=16)
    window = paged_attention(step.query, step.kv_cache, step.block_table, step.token, scale=0.3, sliding_window=6)
    scores = step.query.float().sum(-1)  # [T, HQ]: any scores; 4 "regions" chunked by 3
    topk = streaming_topk(lambda s, n: scores[:, s : s + n], HQ, 2, 3)
    sparse = sparse_region_attention(step.query, step.kv_cache, step.block_table, step.token, ids, scale=0.3)
    return full, window, topk[0], topk[1], sparse


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_matches_eager(backend):
    """fullgraph (no graph break); the AOT graph has no CUDA-graph-incompatible node (no host sync, no
    data-dependent shape); aot_eager runs the same kernels, bitwise; Inductor, with the runner's options,
    within the bf16 rule."""
    step = make_step(*SCENARIOS["mixed"], block_size=16, max_blocks=3, dtype=torch.bfloat16)
    bias = torch.randn(step.query.shape[0], HQ, 5)
    ids = selection(step.query.shape[0], 2, 2, step.token.position, seed=4)
    want = _all_three(step, bias, ids)
    incompatible = []

    def inspect(gm, example_inputs):
        incompatible.append(get_first_incompatible_cudagraph_node(gm))
        return gm

    torch._dynamo.reset()
    counters.clear()
    compiler = aot_autograd(fw_compiler=inspect) if backend == "aot_eager" else backend
    options = INDUCTOR_OPTIONS if backend == "inductor" else None  # as the runner compiles
    got = torch.compile(_all_three, fullgraph=True, backend=compiler, options=options)(step, bias, ids)
    assert not counters["graph_break"]
    tolerance = dict(TOL[torch.bfloat16])
    if not INDUCTOR_KEEPS_BF16_ROUNDINGS:
        # The weights' bf16 rounding before P V dropped: each weight moves by at most 2**-9 of itself, so an
        # output by at most 2**-9 max |V|.
        tolerance["atol"] += 2**-9 * float(step.kv_cache[..., D:].abs().max())
    for g, w in zip(got, want):
        if backend == "aot_eager":
            assert incompatible == [None]
            assert torch.equal(g, w)
        else:  # Inductor fuses the fp32 sums in another order: the bf16 rule above
            torch.testing.assert_close(g.float(), w.float(), **tolerance)


def test_one_inductor_graph_for_every_token_count():
    """A dynamic T (as the runner compiles a step), first traced where the tile count equals the chunk's
    column count and the request count (8 decode tiles, 8 columns, 8 requests). Both failed mark_dynamic's
    range before (mutation-checked): a tile count built with min(R, T) made guards Dynamo could not prove,
    and Inductor's x + zeros no-op removal, on a zeros start column, guarded tiles == columns.
    """
    from torch._dynamo.testing import CompileCounterWithBackend

    def attend(query, kv_cache, table, position, request, chunk_start):
        token = TokenMetadata(request=request, chunk_start=chunk_start, position=position)
        return paged_attention(query, kv_cache, table, token, scale=0.5, query_tile=2, keys_per_chunk=32)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    for new in ([1] * 8, [2, 2, 1, 1] * 2, [1, 1, 2, 4] * 2):  # T = 8, 12, 16
        step = make_step([13, 9, 2, 10] * 2, new, sum(new), max_blocks=8)
        args = (step.query, step.kv_cache, step.block_table, step.token.position, step.token.request,
                step.token.chunk_start)
        for tensor in (args[0], *args[3:]):
            torch._dynamo.mark_dynamic(tensor, 0, min=2, max=16)
        torch._dynamo.mark_dynamic(step.kv_cache, 0)  # each step's cache has its own block count
        torch.testing.assert_close(compiled(*args), attend(*args), **TOL[torch.float32])
    assert counter.frame_count == 1


def test_compiled_memory_does_not_grow_with_the_context():
    """Inductor may schedule a static loop's independent chunks together (it did: every chunk's gather
    fused into one kernel); a decode step's compiled peak must stay that of one chunk from 1 to 4 chunks."""
    peaks = []
    for context in (16, 64):
        step = make_step([context - 1] * 8, [1] * 8, 8, block_size=4, max_blocks=context // 4)
        args = (step.query, step.kv_cache, step.block_table, step.token)
        torch._dynamo.reset()
        fn = torch.compile(lambda *a: paged_attention(*a, scale=0.5, query_tile=1, keys_per_chunk=16), fullgraph=True)
        fn(*args)
        peaks.append(peak_transient_bytes(lambda: fn(*args)))
    assert peaks[1] <= 1.5 * peaks[0], peaks


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda s: paged_attention(s.query[0], s.kv_cache, s.block_table, s.token, scale=1.0), "query must be"),
        (lambda s: paged_attention(s.query[:, :3], s.kv_cache, s.block_table, s.token, scale=1.0), "multiple of KV"),
        (lambda s: paged_attention(s.query, s.kv_cache[..., : s.query.shape[-1]], s.block_table, s.token, scale=1.0),
         r"must hold K \(\d+\) and V after it"),
        (lambda s: paged_attention(s.query, s.kv_cache, s.block_table, s.token, scale=1.0, sliding_window=0),
         "sliding_window"),
        (lambda s: paged_attention(s.query, s.kv_cache, s.block_table, s.token, scale=1.0,
                                   distance_bias=torch.zeros(1, HQ, 3)), "distance_bias"),
        (lambda s: paged_attention(s.query, s.kv_cache, s.block_table, s.token, scale=1.0,
                                   distance_bias=torch.zeros(4, HQ, 0)), "E >= 1"),
        (lambda s: paged_attention(s.query, s.kv_cache, s.block_table.float(), s.token, scale=1.0), "block_table"),
        (lambda s: paged_attention(s.query, s.kv_cache, s.block_table, s.token, scale=1.0, query_tile=0),
         r"query_tile \(0\) and keys_per_chunk \(1024\) must be >= 1"),
        (lambda s: paged_attention(s.query, s.kv_cache, s.block_table, s.token, scale=1.0, keys_per_chunk=0),
         r"query_tile \(4\) and keys_per_chunk \(0\) must be >= 1"),
        (lambda s: paged_attention(s.query[:3], s.kv_cache, s.block_table, s.token, scale=1.0), "token metadata"),
        (lambda s: sparse_region_attention(s.query, s.kv_cache, s.block_table, TokenMetadata(*(m[:3] for m in s.token)),
                                           torch.zeros(4, 1, 1, dtype=torch.long), scale=1.0), "token metadata"),
        (lambda s: sparse_region_attention(s.query, s.kv_cache, s.block_table, s.token,
                                           torch.zeros(4, 3, 1, dtype=torch.long), scale=1.0), "selected_regions"),
        (lambda s: sparse_region_attention(s.query, s.kv_cache[:, :4], s.block_table, s.token,
                                           torch.zeros(4, 1, 1, dtype=torch.long), scale=1.0),
         "multiple of the region"),
        (lambda s: streaming_topk(lambda a, b: torch.zeros(1, b), 5, 0, 2), "k \\(0\\)"),
        (lambda s: csa_region_scorer(torch.zeros(4, 3, 8), torch.zeros(4, 3), torch.zeros(5, 8), s.block_table, 4,
                                     s.token), "index_query must be"),
    ],
)
def test_bad_inputs_are_value_errors(call, match):
    step = make_step(*SCENARIOS["decode"], block_size=8, max_blocks=7)
    with pytest.raises(ValueError, match=match):
        call(step)


def test_region_ids_that_are_not_integers_are_a_type_error():
    step = make_step(*SCENARIOS["decode"], block_size=8, max_blocks=7)
    with pytest.raises(TypeError, match="selected_regions must be int32/int64"):
        sparse_region_attention(step.query, step.kv_cache, step.block_table, step.token, torch.zeros(4, 1, 1), scale=1.0)


@pytest.mark.parametrize("family", ["step5", "inkling"])
def test_the_models_attend_in_the_chunks_their_configs_set(family, monkeypatch):
    """``attention_keys_per_chunk`` reaches every ``paged_attention`` call of a step, and Step5's
    ``indexer_regions_per_chunk`` every ``streaming_topk`` call (the oracle tests run the small chunks)."""
    import stepops.models.inkling as inkling_module
    import stepops.models.step5 as step5_module
    from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
    from stepops.models.runner import ScheduledRequest, StepRunner

    seen = []

    def spy(module, name, chunk_of):
        original = getattr(module, name)

        def recorded(*args, **kwargs):
            seen.append((name, chunk_of(args, kwargs)))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)

    if family == "step5":
        spy(step5_module, "paged_attention", lambda args, kwargs: kwargs["keys_per_chunk"])
        spy(step5_module, "streaming_topk", lambda args, kwargs: args[3])
        model = Step5Model(Step5Config(attention_keys_per_chunk=48, indexer_regions_per_chunk=3))
        want = {("paged_attention", 48), ("streaming_topk", 3)}
    else:
        spy(inkling_module, "paged_attention", lambda args, kwargs: kwargs["keys_per_chunk"])
        model = InklingModel(InklingConfig(attention_keys_per_chunk=48))
        want = {("paged_attention", 48)}
    runner = StepRunner(model, max_requests=1, max_model_len=32, max_tokens=8, device="cpu")
    runner.step([ScheduledRequest(0, 0, torch.randn(8, model.config.hidden_size).to(torch.bfloat16))])
    assert set(seen) == want and len(seen) == len(model.layers)


def test_no_model_module_imports_test_support():
    """The dense oracle and the recomputes live in stepops.testing; no model path may reach them."""
    import ast
    from pathlib import Path

    import stepops.models

    for path in Path(stepops.models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("stepops.testing") for n in names), f"{path.name} imports {names}"
