"""Expert-parallel Step5 (ep = 2, two CPU processes over gloo) == the unsharded model, bit for bit.

Each rank holds half of every MoE layer's routed experts; attention, router, shared expert, norms and every
cache are whole on each rank. A (token, slot)'s expert output comes from the one rank holding that expert
and zeros from the others, so the all-reduce is exact and the layers' outputs are the unsharded ones'. Both
ranks build the full model from one seed and run the scripted workload (chunked prefill, decode, verify with
rejected drafts) through an ep = 2 model (eager, and compiled with ``fullgraph=True`` on ``aot_eager``) and
through the full model. What is compared:

- outputs and every cache: bitwise equal to the unsharded model's, on every rank (bf16 experts: steps of
  4 tokens take the all-experts path here and the chosen-experts path on one rank, which give the same
  bits in bf16 on CPU, tests/models/test_moe_small_step.py); a rank that holds the other rank's experts
  differs;
- compiled ep = 2 == eager ep = 2 bitwise, one graph per token range, no graph break; steps of T = 2 ran
  only the chosen experts (``T * k <`` the rank's 8 experts), longer ones every expert of the rank;
- ``load_step5(process_group=)`` of a saved fp8 checkpoint: each rank holds its experts' e4m3 codes and
  block scales, the rest whole, and steps to the unsharded load's logits;
- refusals: experts that do not split over the ranks, a checkpoint without all of them.

The two processes start once per module; each rank records its checks in a JSON file the tests read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rank_checks import assert_every_rank_passed, record_checks, run_sharded, shared_checks, spawn_checks
from safetensors.torch import save_file
from test_step5_weights import reference_config

from stepops.models import Step5Config, Step5Model
from stepops.models.runner import ScheduledRequest, StepRunner, Workload
from stepops.models.step5 import Step5MoE
from stepops.models.step5_weights import load_step5, load_step5_state_dict, step5_config_from_reference
from stepops.testing.step5_checkpoint import random_step5_checkpoint

EP = 2
# Both layers MoE (the sliding one and the CSA one), 16 experts top-2: 8 per rank, so steps of T = 2 run the
# rank's chosen experts (T * k < 8) and steps of 4 and 8 all of its experts.
CONFIG = Step5Config(moe_layers=(0, 1), moe_num_experts=16)
PER_RANK = CONFIG.moe_num_experts // EP
# The tensors an expert-parallel rank holds a share of: the routed experts' weights and their fp8 scales.
ROUTED_EXPERT = re.compile(r"layers\.\d+\.moe\.(gate|up|down)_proj\.weight(_scale_inv)?")
WORKLOAD = Workload(prompt_lens=(13, 6, 3), decode_lens=(6, 8, 7), num_speculative_tokens=3, token_budget=8)
CHECKS = (
    "holds_its_experts",
    "eager_outputs_bitwise",
    "caches_bitwise",
    "other_ranks_experts_differ",
    "ranks_replicated",
    "compiled_equals_eager",
    "compiled_one_graph_per_token_range_no_breaks",
    "small_steps_ran_the_chosen_experts",
    "fp8_checkpoint_loads_its_experts",
    "uneven_experts_refused",
    "a_sliced_checkpoint_refused",
)


def _expert_parallel(state_dict: dict[str, torch.Tensor], *, other_ranks_experts: bool = False) -> Step5Model:
    """An ep = 2 model loaded from the whole ``state_dict`` (this rank keeps its experts; with
    ``other_ranks_experts``, the other rank's, by rolling the expert dimension by a rank's share)."""
    if other_ranks_experts:
        state_dict = {k: v.roll(PER_RANK, 0) if ROUTED_EXPERT.fullmatch(k) else v for k, v in state_dict.items()}
    model = Step5Model(CONFIG, process_group=dist.group.WORLD)
    load_step5_state_dict(model, state_dict)
    return model


def _save_fp8_checkpoint(directory: Path) -> None:
    """A reference-layout directory (fp8 routed experts with their scales) of a two-layer MoE model."""
    reference = reference_config(  # the last layer type is the MTP layer's: a checkpoint may leave it out
        ["sliding_attention", "full_attention", "full_attention"], moe_layer_list=[0, 1], moe_num_experts=16
    )
    checkpoint = random_step5_checkpoint(step5_config_from_reference(reference), seed=5, causal_lm=True)
    saved = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in checkpoint.items()}
    save_file(saved, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(reference))


def _logits(model) -> list[torch.Tensor]:
    """Logits of a prefill step of 8 tokens (every expert runs, on either model) and a decode step of 2
    (only the chosen ones): the same path at both sizes on one rank and on two, so equal bit for bit."""
    ids = torch.randint(0, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    runner = StepRunner(model, max_requests=1, max_model_len=16, max_tokens=8, device="cpu", inputs="tokens")
    return [runner.step([ScheduledRequest(0, 0, ids[:8])])[0], runner.step([ScheduledRequest(0, 8, ids[8:])])[0]]


def _rank_checks(rank: int, ep_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on two shared cores
    torch.manual_seed(0)
    full = Step5Model(CONFIG)
    whole = full.state_dict()
    runs = run_sharded(
        full, lambda shard_of: _expert_parallel(whole, other_ranks_experts=shard_of != rank), Step5MoE, WORKLOAD, rank,
        ep_size,
    )
    eager = runs.eager_model
    ours = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def holds_its_experts():
        for (name, param), (full_name, full_param) in zip(eager.named_parameters(), full.named_parameters(), strict=True):
            assert name == full_name
            expected = full_param[ours] if ROUTED_EXPERT.fullmatch(name) else full_param
            assert torch.equal(param, expected), name

    def eager_outputs_bitwise():
        for i, (y, x) in enumerate(zip(runs.eager.outputs, runs.whole.outputs)):
            assert torch.equal(y, x), f"request {i}: {(y.float() - x.float()).abs().max()}"

    def caches_bitwise():
        for a, b in zip(eager.cache_tensors(), full.cache_tensors(), strict=True):
            assert torch.equal(a, b)

    def other_ranks_experts_differ():
        same = [torch.equal(y, x) for y, x in zip(runs.swapped.outputs, runs.whole.outputs)]
        assert not any(same), f"outputs with the other rank's experts equal the unsharded ones: {same}"

    def fp8_checkpoint_loads_its_experts():
        directory = Path(out_dir, f"fp8_rank{rank}")  # one per rank: no rank reads a file another writes
        directory.mkdir()
        _save_fp8_checkpoint(directory)
        sharded, unsharded = load_step5(directory, process_group=dist.group.WORLD), load_step5(directory)
        moe, full_moe = sharded.layers[1].moe, unsharded.layers[1].moe
        assert moe.down_proj.fp8 and moe.down_proj.weight.shape[0] == PER_RANK
        for a, b in zip([*sharded.named_parameters(), *sharded.named_buffers()],
                        [*unsharded.named_parameters(), *unsharded.named_buffers()], strict=True):
            expected = b[1][ours] if ROUTED_EXPERT.fullmatch(b[0]) else b[1]
            assert a[0] == b[0] and a[1].dtype == expected.dtype and a[1].stride() == expected.contiguous().stride(), a[0]
            assert torch.equal(a[1].view(torch.uint8), expected.view(torch.uint8)), a[0]
        for step, (x, y) in enumerate(zip(_logits(sharded), _logits(unsharded), strict=True)):
            assert torch.equal(x, y), f"step {step}"
        assert torch.equal(full_moe.down_proj.weight_scale_inv[ours], moe.down_proj.weight_scale_inv)

    def uneven_experts_refused():
        with pytest.raises(ValueError, match=re.escape("needs moe_num_experts (3) divisible by the process group's size (2)")):
            Step5Model(Step5Config(moe_num_experts=3), process_group=dist.group.WORLD)

    def a_sliced_checkpoint_refused():
        sliced = {k: v[ours] if ROUTED_EXPERT.fullmatch(k) else v for k, v in whole.items()}
        with pytest.raises(ValueError, match=re.escape("takes the whole checkpoint, 16 experts along dim 0 (it keeps 8)")):
            _expert_parallel(sliced)

    # steps of T = 2 run the rank's chosen experts, T = 4 and 8 all of its experts (one dynamic graph)
    checks = {**locals(), **shared_checks(runs, token_ranges=((2, 3), (4, 8)), small_step_sizes={2})}
    record_checks({name: checks[name] for name in CHECKS}, rank, out_dir)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict[str, str]]:
    return spawn_checks(_rank_checks, EP, tmp_path_factory.mktemp("ep"))


@pytest.mark.parametrize("check", CHECKS)
def test_two_ranks_match_one(rank_results, check):
    assert_every_rank_passed(rank_results, check)
