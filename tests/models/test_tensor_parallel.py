"""Tensor-parallel Inkling (tp = 2, two CPU processes over gloo) == the unsharded model (tp = 1).

Both ranks build the full model from one seed, slice its weights with ``shard_inkling_state_dict`` and run
the same scripted workload (chunked prefill, decode, verify with rejected drafts) through a tp = 2 model
(eager, and compiled with ``fullgraph=True`` on ``aot_eager``) and through the full model. What is compared:

- K/V conv streams and the attention KV cache of the first layer, before any reduction: bitwise equal to
  the tp = 1 cache's slice of this rank's heads (column-parallel projections compute the same dot products).
- The first layer's output-stream cache rows (reduce-scattered sums of bf16 partials, which round once
  more than one matmul): within ``TOLERANCES["tensor_parallel_reduced_stream"]``, a few bf16 ulps.
- Everything downstream (outputs, every cache row of both layers): within
  ``TOLERANCES["tensor_parallel_vs_single_rank"]``. A rank that loads the other rank's shard must fall
  outside it.
- Compiled tp = 2 == eager tp = 2 bitwise (outputs and caches), one graph per token range (decode steps
  of T = 2 run only the chosen experts, on each rank its shard of them), no graph break; every rank's
  outputs are the same bits.
- Each rank's steps write only its own rows of its own caches: the containment check of
  tests/models/test_write_containment.py (every cache byte poisoned, the bytes a step may change derived
  from the schedule and the block tables) on a rank's sharded model, whose caches hold its KV heads only.

The two processes start once per module (about 30-40 s on 2 cores); each rank records its checks in a
JSON file that the tests below read.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from rank_checks import assert_every_rank_passed, record_checks, run_sharded, shared_checks, spawn_checks
from test_write_containment import run_contained_steps

from stepops.layouts import InklingStream
from stepops.models import InklingConfig, InklingDecoderLayer, InklingModel
from stepops.models.inkling import DENSE, SPARSE, InklingMLP, InklingMoE, inkling_sharding, shard_inkling_state_dict
from stepops.models.runner import Workload
from stepops.models.tensor_parallel import spawn_ranks
from stepops.testing import TOLERANCES

TP = 2
# 2 KV heads in both layer kinds (sliding: head size 8, global: 16), 4 query heads, hidden 64: one KV head
# per rank; a dense MLP in the sliding layer and a sparse one (8 experts top-2, each split over the ranks) in
# the global: steps of T = 2 run only the chosen experts' shards (T * k < 8), longer ones every expert's.
CONFIG = InklingConfig(mlp_layer_types=(DENSE, SPARSE), n_routed_experts=8)
WORKLOAD = Workload(prompt_lens=(13, 6, 3), decode_lens=(6, 8, 7), num_speculative_tokens=3, token_budget=8)
CHECKS = (
    "eager_outputs_within_bound",
    "kv_streams_bitwise",
    "reduced_streams_within_ulps",
    "caches_within_bound",
    "swapped_shards_fail_the_bound",
    "ranks_replicated",
    "compiled_equals_eager",
    "compiled_one_graph_per_token_range_no_breaks",
    "small_steps_ran_the_chosen_experts",
    "tp_above_kv_heads_refused",
    "steps_write_only_their_own_rows",
)


def _sharded(full: InklingModel, rank: int, shard_of: int) -> InklingModel:
    model = InklingModel(CONFIG, process_group=dist.group.WORLD)
    model.load_state_dict(shard_inkling_state_dict(full.state_dict(), CONFIG, tp_rank=shard_of, tp_size=TP))
    return model


def _within(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = TOLERANCES["tensor_parallel_vs_single_rank"]
    torch.testing.assert_close(got.float(), want.float(), atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{what}: {m}")


def _head_slices(full: InklingModel, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the tp = 1 caches' rows of this rank's KV heads: (attention KV, conv state)."""
    heads = slice(rank * CONFIG.num_kv_heads // TP, (rank + 1) * CONFIG.num_kv_heads // TP)
    return [(layer.attn.kv_cache[:, :, heads], layer.conv_state.kv_cache[:, heads]) for layer in full.layers]


def _rank_checks(rank: int, tp_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on two shared cores
    torch.manual_seed(0)
    full = InklingModel(CONFIG)
    runs = run_sharded(full, lambda shard_of: _sharded(full, rank, shard_of), InklingMoE, WORKLOAD, rank, tp_size)
    got, want, eager = runs.eager, runs.whole, runs.eager_model

    def eager_outputs_within_bound():
        for i, (y, x) in enumerate(zip(got.outputs, want.outputs)):
            _within(y, x, f"request {i}")

    def kv_streams_bitwise():
        attn, conv = _head_slices(full, rank)[0]
        layer = eager.layers[0]
        assert torch.equal(layer.attn.kv_cache, attn), "layer 0 attention KV cache"
        for stream in (InklingStream.K, InklingStream.V):
            offset, width = layer.conv_state.stream_ranges[stream.value]
            assert torch.equal(
                layer.conv_state.kv_cache[..., offset : offset + width], conv[..., offset : offset + width]
            ), f"layer 0 {stream.name} stream"

    def reduced_streams_within_ulps():
        tol = TOLERANCES["tensor_parallel_reduced_stream"]
        conv = _head_slices(full, rank)[0][1]
        layer = eager.layers[0].conv_state
        for stream in (InklingStream.ATTN_OUT, InklingStream.MLP_OUT):
            offset, width = layer.stream_ranges[stream.value]
            got_rows, want_rows = (c[..., offset : offset + width].float() for c in (layer.kv_cache, conv))
            torch.testing.assert_close(got_rows, want_rows, atol=tol.atol, rtol=tol.rtol, msg=stream.name)

    def caches_within_bound():
        for i, (layer, (attn, conv)) in enumerate(zip(eager.layers, _head_slices(full, rank))):
            assert layer.conv_state.kv_cache.shape == conv.shape and layer.attn.kv_cache.shape == attn.shape
            _within(layer.attn.kv_cache, attn, f"layer {i} attention KV cache")
            _within(layer.conv_state.kv_cache, conv, f"layer {i} conv state")

    def swapped_shards_fail_the_bound():
        tol = TOLERANCES["tensor_parallel_vs_single_rank"]
        outside = [
            bool(((y.float() - x.float()).abs() > tol.atol + tol.rtol * x.float().abs()).any())
            for y, x in zip(runs.swapped.outputs, want.outputs)
        ]
        assert all(outside), f"outputs with the other rank's weights stayed inside the bound: {outside}"

    def tp_above_kv_heads_refused():
        context: dict = {}
        config = InklingConfig(num_heads=2, num_kv_heads=1, hidden_size=32)
        with pytest.raises(ValueError, match=re.escape("tp_size <= num_kv_heads (1), got 2")):
            InklingDecoderLayer(config, 0, static_forward_context=context, process_group=dist.group.WORLD)
        assert not context, f"a refused layer registered {list(context)}"

    def steps_write_only_their_own_rows():
        # A rank whose step fails here stops stepping: the other waits in its next collective until the
        # group's timeout and records that error as well.
        run_contained_steps(_sharded(full, rank, shard_of=rank))

    # steps of T = 2 run the chosen experts' shards, T = 4 and 8 every expert's (one dynamic graph)
    checks = {**locals(), **shared_checks(runs, token_ranges=((2, 3), (4, 8)), small_step_sizes={2})}
    record_checks({name: checks[name] for name in CHECKS}, rank, out_dir)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict[str, str]]:
    return spawn_checks(_rank_checks, TP, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("check", CHECKS)
def test_two_ranks_match_one(rank_results, check):
    assert_every_rank_passed(rank_results, check)


def _rank_one_fails(rank: int, tp_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gave up")


def test_a_failing_rank_is_raised_and_the_others_ended():
    """Rank 1 raises, rank 0 finishes (and leaves through ``os._exit``): the parent gets rank 1's error and
    traceback, not a plain exit code."""
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="rank 1 gave up"):
        spawn_ranks(_rank_one_fails, TP, timeout=timedelta(seconds=60))


# -- single process: the weight slicer -------------------------------------------------------------------


def test_shards_reassemble_the_full_state_dict():
    """Each parameter's shards, put back along the axis (and within the chunks) its rule splits, are the
    full tensor; replicated ones are whole on every rank; every MoE expert weight is split."""
    torch.manual_seed(0)
    full = InklingModel(CONFIG).state_dict()
    shards = [shard_inkling_state_dict(full, CONFIG, tp_rank=r, tp_size=TP) for r in range(TP)]
    rules = inkling_sharding(full)
    assert all(rules[k] is not None for k in full if ".mlp.experts_" in k or ".mlp.shared_" in k)
    assert all(rules[k] is None for k in full if ".mlp.gate." in k)  # the router: every rank routes alike
    for key, value in full.items():
        parts, rule = [s[key] for s in shards], rules[key]
        if rule is None:
            assert all(torch.equal(p, value) for p in parts), key
            continue
        chunks = [p.unflatten(rule.dim, (rule.parts, -1)) for p in parts]
        assert torch.equal(torch.cat(chunks, dim=rule.dim + 1).flatten(rule.dim, rule.dim + 1), value), key
        assert parts[0].shape[rule.dim] == value.shape[rule.dim] // TP, key


@pytest.mark.parametrize("layer", [0, 1], ids=["dense_mlp", "sparse_moe"])
def test_each_ranks_mlp_shard_computes_its_part_of_the_full_mlp(layer):
    """One process, no collectives: each rank's MLP (dense, or routed and shared experts) built from its
    shard, on the same input, gives a partial sum; the partials add up to the full MLP's output. Unit-gain
    weights: at the default std 0.02 the MLP's output is too small for a wrong slice (the halves of the
    fused experts' [gate; up] swapped between ranks) to pass the multi-layer test's bound. The same input
    on every rank routes alike, so no near tie can flip an expert between the two sides."""
    torch.manual_seed(0)
    full, prefix = InklingModel(CONFIG), f"layers.{layer}.mlp."
    with torch.no_grad():
        for name, parameter in full.named_parameters():
            if name.startswith(prefix) and ".gate." not in name:  # the router keeps its init
                parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    mlp = full.layers[layer].mlp
    x = torch.randn(6, CONFIG.hidden_size).to(torch.bfloat16)
    partials = []
    for rank in range(TP):
        shard = shard_inkling_state_dict(full.state_dict(), CONFIG, tp_rank=rank, tp_size=TP)
        if layer == 0:
            rank_mlp = InklingMLP(CONFIG.hidden_size, CONFIG.intermediate_size // TP, torch.bfloat16)
        else:
            rank_mlp = InklingMoE(CONFIG, CONFIG.moe_intermediate_size // TP, torch.bfloat16)
        rank_mlp.load_state_dict({k[len(prefix) :]: v for k, v in shard.items() if k.startswith(prefix)})
        with torch.no_grad():
            partials.append(rank_mlp(x).float())
    with torch.no_grad():
        want = mlp(x).float()
    # Each partial and the full output round to bf16 once: a few bf16 ulps of the output's scale apart.
    torch.testing.assert_close(sum(partials), want, atol=2**-6 * float(want.abs().max()), rtol=2**-6)


def test_shard_refuses_tp_above_kv_heads_and_unknown_keys():
    full = InklingModel(CONFIG).state_dict()
    with pytest.raises(ValueError, match=r"tp_size <= num_kv_heads \(2\), got 4"):
        shard_inkling_state_dict(full, CONFIG, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="no sharding rule for 'layers.0.extra'"):
        shard_inkling_state_dict({**full, "layers.0.extra": torch.zeros(1)}, CONFIG, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="tp_rank < tp_size"):
        shard_inkling_state_dict(full, CONFIG, tp_rank=2, tp_size=2)
    for name in ("intermediate_size", "moe_intermediate_size"):  # both kinds are in use: one odd size each
        odd = dataclasses.replace(CONFIG, **{name: getattr(CONFIG, name) + 1})
        with pytest.raises(ValueError, match=rf"^{name} \(\d+\) must be divisible by the tensor-parallel size \(2\)"):
            shard_inkling_state_dict(full, odd, tp_rank=0, tp_size=2)
    # Keys that are not layers.<index>.<parameter>: an IndexError, and a rule for a non-numeric layer.
    for key in ("layers.0", "layers.foo.q_proj.weight"):
        with pytest.raises(ValueError, match=f"no sharding rule for '{key}'"):
            inkling_sharding([key])


def test_shard_state_dict_slices_by_hand():
    """The generic slicer on a hand-made state dict (its own checks, not inkling_sharding's): rank 1 of 2 keeps
    the second half of rows / columns, of each chunk of a fused ``[gate; up]``, and every replicated tensor
    whole; each value is a contiguous copy (a rank writing its shard must not write the full dict)."""
    from stepops.models.tensor_parallel import ShardRule, shard_state_dict

    w = torch.arange(24.0).view(6, 4)
    fused = torch.arange(16.0).view(8, 2)  # gate rows 0..3, up rows 4..7
    norm = torch.ones(4)
    state = {"rows": w, "cols": w, "fused": fused, "norm": norm}
    rules = {"rows": ShardRule(0), "cols": ShardRule(1), "fused": ShardRule(0, parts=2), "norm": None}
    shard = shard_state_dict(state, rules, tp_rank=1, tp_size=2)
    assert torch.equal(shard["rows"], w[3:6])
    assert torch.equal(shard["cols"], w[:, 2:4])
    assert torch.equal(shard["fused"], torch.cat([fused[2:4], fused[6:8]]))  # gate rows 2, 3 then up rows 6, 7
    assert torch.equal(shard["norm"], norm)
    for key, value in shard.items():
        assert value.is_contiguous(), key
        assert value.untyped_storage().data_ptr() != state[key].untyped_storage().data_ptr(), key
    # 6 rows split 2 x 2 ways: divisible by tp alone, not by parts * tp.
    with pytest.raises(ValueError, match=r"fused: dim 0 of shape \(6, 1\) does not split into 2 x 2 slices"):
        shard_state_dict({"fused": torch.zeros(6, 1)}, {"fused": ShardRule(0, parts=2)}, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="no sharding rule for 'extra'"):
        shard_state_dict({**state, "extra": torch.zeros(2)}, rules, tp_rank=0, tp_size=2)
    for rank, size in ((False, 2), (0, InklingStream.ATTN_OUT)):  # were taken as rank 0 and size 2
        with pytest.raises(TypeError, match="tp_rank and tp_size must be ints"):
            shard_state_dict(state, rules, tp_rank=rank, tp_size=size)
    with pytest.raises(ValueError, match="need 0 <= tp_rank < tp_size, got tp_rank=-1"):
        shard_state_dict(state, rules, tp_rank=-1, tp_size=2)


def test_no_group_is_one_rank():
    from stepops.models.tensor_parallel import TensorParallel

    assert TensorParallel.from_group(None) == TensorParallel(None, 1, 0)


def test_a_group_this_rank_is_not_in_says_so():
    """On a rank outside it, ``dist.new_group`` returns an int, which was a TypeError about the type."""
    import torch.distributed as dist

    from stepops.models.tensor_parallel import TensorParallel

    with pytest.raises(ValueError, match="this process is not a member of process_group"):
        TensorParallel.from_group(dist.GroupMember.NON_GROUP_MEMBER)


@pytest.mark.parametrize("group", ["tp", 2, object()])
def test_a_group_that_is_no_process_group_is_a_type_error(group):
    """Not a rank count or a name: the layers need the group itself for their collectives."""
    from stepops.models.tensor_parallel import TensorParallel

    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup or None, got"):
        TensorParallel.from_group(group)


@pytest.mark.parametrize("tp_size", [0, -1])
def test_spawning_no_rank_is_a_value_error(tp_size):
    """It returned at once with ``fn`` never run."""
    with pytest.raises(ValueError, match=f"tp_size must be >= 1, got {tp_size}"):
        spawn_ranks(print, tp_size)


def test_tensor_parallel_imports_no_model():
    """The dependency is one-way: models import tensor_parallel, never the reverse."""
    import ast
    import inspect

    import stepops.models.tensor_parallel as module

    tree = ast.parse(inspect.getsource(module))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [name for name in imported if name.startswith("stepops.models")], imported
