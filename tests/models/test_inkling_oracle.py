"""stepops' Inkling == transformers 5.23.0's ``InklingForCausalLM`` (the oracle), on a checkpoint it wrote.

A tiny random ``InklingTextConfig`` covers every part: sliding and global layers with different geometry
(sliding: 4 query heads / 1 KV head of 8; global: 4 / 2 of 16, GQA both), a dense and two sparse MLP
layers (4 routed experts, top-2, 2 shared), W = 4 short convs, a relative bias whose global extent (12)
is shorter than the sequences, log scaling from position 4, a muP logit divisor and a padded head
(``unpadded_vocab_size`` 120 of 128). Weights that transformers initialises to constants (norms, scales,
the router's correction bias, the convs) are randomised too, so a part that ignores one of them fails.

- fp32, no cache: every layer (stepops' modules through the no-cache recompute) vs transformers' layer on
  the same input; pieces with the same arithmetic order bitwise, the rest within ``FP32_LAYER``.
- bf16 steps (caches, chunked ragged prefill, decode, verify with rejected drafts), every layer's output
  and the logits of every committed token vs transformers on the whole sequence: the error to transformers'
  fp32 is within ``BF16_FACTOR`` times transformers' own bf16-vs-fp32 error, measured here on the same
  tokens.
- Greedy generation: two prompts of different lengths in one ragged batch, 32 new tokens, equal to
  ``generate(do_sample=False)``, eager and compiled, with speculative drafts that are partly wrong, and
  with stop tokens (``eos_token_id``): given, or the checkpoint's where transformers' ``generate`` reads them.

What the loader reads from the checkpoint, and the config checks: ``test_inkling_checkpoint``.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

from inkling_oracle_helpers import (
    FP32_LAYER,
    HF_CONFIG,
    VOCAB,
    load_transformers_inkling,
    save_random_inkling,
    single_file_copy,
)
from transformers import InklingForCausalLM, InklingTextConfig  # the test extra pins 5.23.0

from stepops.models.inkling import InklingModel, InklingRMSNorm
from stepops.models.inkling_checkpoint import config_from_transformers, load_inkling
from stepops.testing.dense_attention import masked_attention
from stepops.testing.inkling_reference import inkling_layer_reference
from stepops.models.runner import COMPILED, EAGER, TOKENS, ScheduledRequest, StepRunner

# Two bf16 implementations round at different places (transformers: bf16 scores and bf16 expert sums;
# stepops: fp32 attention), so stepops' bf16 error to the fp32 truth is of the size of transformers' own,
# not equal to it; twice transformers' error on the same tokens bounds it (seen: <= 1.25x, max and RMS).
BF16_FACTOR = 2.0
# A routing choice closer than this in transformers' fp32 scores flipped under bf16 here (seen: a gap
# between 2**-10 and 2**-8 flipped); such rows are left out, and at most a quarter may be (seen: 52 of 288).
ROUTING_NEAR_TIE = 2**-7
MAX_ROUTING_TIE_FRACTION = 1 / 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_inkling(tmp_path_factory.mktemp("inkling"))


@pytest.fixture(scope="module")
def gen_checkpoint(tmp_path_factory):
    """Routing fixed by the correction bias (sigmoid scores lie in (0, 1), so a bias 2 apart decides the
    top-2): 40 greedy steps through bf16 cannot meet a routing near tie, which two correct bf16 models
    may break either way. The router's weights, the shared experts and every other part still vary."""
    return save_random_inkling(
        tmp_path_factory.mktemp("inkling_gen"), correction_bias=lambda shape: torch.arange(shape[0], 0, -1.0) * 2.0
    )


@pytest.fixture(scope="module")
def hf32(checkpoint):
    return load_transformers_inkling(checkpoint, torch.float32)


@pytest.fixture(scope="module")
def hf16(checkpoint):
    return load_transformers_inkling(checkpoint, torch.bfloat16)


def _layer_io(hf, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Each transformers decoder layer's ``(input, output)`` ``[L, hidden]`` and the logits for ``ids [L]``."""
    io, hooks = [], []
    for layer in hf.model.layers:
        hooks.append(layer.register_forward_hook(lambda m, a, k, out: io.append((k["hidden_states"] if not a else a[0], out)), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = hf(ids[None]).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return [(x[0], y[0]) for x, y in io], logits


# -- fp32, no cache -----------------------------------------------------------------------------------


def test_checkpoint_is_sharded_and_keeps_sconv_weights_fp32(checkpoint, hf16):
    assert (checkpoint / "model.safetensors.index.json").exists()
    assert len(set(json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    model = load_inkling(checkpoint)
    layer = model.layers[1]
    assert {p.dtype for name, p in model.named_parameters() if name.split(".")[-1].startswith("conv_")} == {torch.float32}
    assert layer.mlp.gate.global_scale.dtype == layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.q_proj.weight.dtype == torch.bfloat16
    # Loaded, not initialised: the same bits as transformers' bf16 model (whose sconv weights are fp32 too).
    assert hf16.model.layers[1].attn_sconv.conv1d.weight.dtype == torch.float32
    assert torch.equal(layer.conv_attn, hf16.model.layers[1].attn_sconv.conv1d.weight[:, 0])
    assert torch.equal(layer.mlp.experts_down, hf16.model.layers[1].mlp.experts.down_proj)


def test_every_layer_equals_transformers_in_fp32(checkpoint, hf32):
    _every_layer_equals_transformers_in_fp32(checkpoint, hf32)


def _every_layer_equals_transformers_in_fp32(checkpoint, hf32, length: int = 21) -> None:
    model = load_inkling(checkpoint, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (length,))
    io, want_logits = _layer_io(hf32, ids)
    with torch.no_grad():
        assert torch.equal(model.embed(ids), io[0][0])  # the normed embedding, bitwise
        x = io[0][0]
        for index, (layer, (hf_in, hf_out)) in enumerate(zip(model.layers, io)):
            got = inkling_layer_reference(layer, hf_in)
            err = (got - hf_out).abs().max() / hf_out.abs().max()
            assert err <= FP32_LAYER, f"layer {index} ({layer.kind}, {layer.mlp_kind}): relative error {err:.3g}"
            x = inkling_layer_reference(layer, x)
        logits = model.logits(x)
    assert logits.shape == want_logits.shape == (length, model.config.output_vocab_size)
    torch.testing.assert_close(logits, want_logits, atol=FP32_LAYER * want_logits.abs().max(), rtol=0)


def test_parts_with_the_same_arithmetic_are_bitwise_in_fp32(checkpoint, hf32):
    """RMSNorm, the dense MLP, the router, the shared experts, the relative bias with log scaling and the
    attention itself: bitwise against transformers' modules on the same inputs."""
    model = load_inkling(checkpoint, dtype=torch.float32)
    x = torch.randn(13, 64)
    with torch.no_grad():
        norm = InklingRMSNorm(64, 1e-6, torch.float32)
        norm.weight.copy_(hf32.model.norm.weight)
        assert torch.equal(norm(x), hf32.model.norm(x))
        assert torch.equal(model.layers[0].mlp(x), hf32.model.layers[0].mlp(x[None])[0])
        router, hf_moe = model.layers[1].mlp.gate, hf32.model.layers[1].mlp
        weights, gammas = router(x)
        _, hf_weights, hf_chosen, hf_gammas = hf_moe.gate(x[None])
        assert torch.equal(weights, torch.zeros_like(weights).scatter(1, hf_chosen, hf_weights))
        assert torch.equal(gammas, hf_gammas)
        assert torch.equal(model.layers[1].mlp._shared(x, gammas), hf_moe.shared_experts(x[None], gammas=hf_gammas)[0])
        for index in (0, 1):  # sliding (extent = window) and global (extent 12, log-scaled from position 4)
            layer, attn = model.layers[index], hf32.model.layers[index].self_attn
            _attention_is_bitwise(layer, attn, x)


@pytest.mark.parametrize("experts, top_k", [(16, 4), (9, 5), (8, 8)])
def test_router_is_bitwise_for_other_expert_counts(experts, top_k):
    """The router against transformers' ``InklingTopkRouter`` where k > 2: the softmax sums the chosen
    logits in ``topk(sorted=False)``'s order, which a sorted top-k changes (seen: 16 experts, top-4)."""
    from transformers.models.inkling.modeling_inkling import InklingTopkRouter

    hf_config = InklingTextConfig(**{**HF_CONFIG, "n_routed_experts": experts, "num_experts_per_tok": top_k})
    hf_router = InklingTopkRouter(hf_config)
    router = InklingModel(config_from_transformers(hf_config.to_dict()), dtype=torch.float32)
    router = router.layers[1].mlp.gate
    gen = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(hf_router.weight.shape, generator=gen))
        hf_router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
        router.load_state_dict(hf_router.state_dict())
        x = torch.randn(64, HF_CONFIG["hidden_size"], generator=gen) * 0.1
        weights, gammas = router(x)
        _, hf_weights, hf_chosen, hf_gammas = hf_router(x[None])
    assert torch.equal(weights, torch.zeros_like(weights).scatter(1, hf_chosen, hf_weights))
    assert torch.equal(gammas, hf_gammas)


def test_parts_with_the_same_arithmetic_are_bitwise_in_bf16(checkpoint, hf16):
    """The same pieces in bf16, where the rounding order shows: transformers' RMSNorm rounds the normed
    input to bf16 before the bf16 weight multiply, the dense MLP multiplies by ``global_scale`` in bf16, and
    the log scaling of the query and the bias is fp32 rounded once. An fp32 layer cannot tell these orders
    apart, and the bf16 step test's tolerance (twice transformers' own bf16 error) is far wider than the one
    ulp they move (seen: an fp32 norm weight multiply, a bf16 log-scale multiply and an fp32 MLP scale all
    passed every other oracle test)."""
    model = load_inkling(checkpoint)
    x = torch.randn(13, 64).to(torch.bfloat16)
    with torch.no_grad():
        for norm, hf_norm in ((model.norm, hf16.model.norm), (model.embed_norm, hf16.model.embed_tokens.embed_norm)):
            assert torch.equal(norm(x), hf_norm(x))
        assert torch.equal(model.layers[0].mlp(x), hf16.model.layers[0].mlp(x[None])[0])
        assert torch.equal(model.layers[1].mlp(x), hf16.model.layers[1].mlp(x[None])[0])  # router, experts, shared
        for index in (0, 1):
            _attention_is_bitwise(model.layers[index], hf16.model.layers[index].self_attn, x, compare_output=False)
        # Past log_scaling_n_floor (4) the global layer's query and bias are scaled: positions up to 12 here.
        assert model.layers[1].log_scaling


@pytest.mark.parametrize("num_experts, top_k", [(8, 3), (16, 6)])
def test_routed_experts_are_summed_as_transformers_default_experts_bitwise(tmp_path, num_experts, top_k):
    """transformers' default experts (``grouped_mm``, what ``from_pretrained`` runs) multiply each chosen
    output by its weight in bf16, sum the top-k in fp32 and round once; its eager loop rounds after each add.
    Equal at top-2 (the first add into 0 is exact), one ulp apart on 15-40% of outputs from top-3 on (6 is
    Inkling's): stepops followed the eager loop before. Both paths here: every expert on every token (64
    tokens) and only the chosen ones (one token per call, ``T * k < E``)."""
    config = {**HF_CONFIG, "n_routed_experts": num_experts, "num_experts_per_tok": top_k}
    checkpoint = save_random_inkling(tmp_path, config)
    hf = load_transformers_inkling(checkpoint, torch.bfloat16)
    assert hf.config._experts_implementation == "grouped_mm"
    model = load_inkling(checkpoint)
    moe, hf_moe = model.layers[1].mlp, hf.model.layers[1].mlp
    x = torch.randn(64, config["hidden_size"], generator=torch.Generator().manual_seed(top_k)).to(torch.bfloat16)
    with torch.no_grad():
        want = hf_moe(x[None])[0]
        assert torch.equal(moe(x), want)
        assert moe.small_step_max_tokens >= 1  # so a one-token call runs only the chosen experts
        assert torch.equal(torch.cat([moe(row[None]) for row in x]), want)


def _attention_is_bitwise(layer, attn, x: torch.Tensor, compare_output: bool = True) -> None:
    """Transformers' attention forward (no cache, eager) vs stepops' pieces on the same projections
    (``compare_output``: the attention output too, within ``FP32_LAYER``; fp32 only)."""
    from transformers.models.inkling import modeling_inkling as hf_module

    length = x.shape[0]
    position = torch.arange(length)
    captured = {}

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, position_bias=None, **kwargs):
        captured.update(query=query, key=key, value=value, bias=position_bias, scaling=scaling)
        return hf_module.eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, position_bias)

    mask = torch.full((length, length), float("-inf")).triu(1)
    if layer.sliding_window is not None:
        mask = mask.masked_fill(torch.ones(length, length, dtype=torch.bool).tril(-layer.sliding_window), float("-inf"))
    original = hf_module.ALL_ATTENTION_FUNCTIONS.get_interface
    hf_module.ALL_ATTENTION_FUNCTIONS.get_interface = lambda *a: eager
    try:
        want = attn(x[None], attention_mask=mask[None, None])[0][0]
    finally:
        hf_module.ALL_ATTENTION_FUNCTIONS.get_interface = original
    assert captured["scaling"] == 1.0 / layer.head_dim
    q = layer.scaled_query(layer.q_norm(layer.q_proj(x).view(length, layer.num_heads, -1)), position)
    assert torch.equal(q, captured["query"][0].transpose(0, 1))
    table = layer.relative_bias_table(x, position)
    # The dense bias transformers built, read back from the table: entry d at distance d, 0 elsewhere.
    distance = position[:, None] - position[None, :]
    dense = table.gather(-1, distance.clamp(0, table.shape[-1] - 1)[:, None, :].expand(-1, layer.num_heads, -1))
    dense = dense.masked_fill(((distance < 0) | (distance >= table.shape[-1]))[:, None], 0.0)
    assert torch.equal(dense.transpose(0, 1), captured["bias"][0])
    if not compare_output:
        return
    key = captured["key"][0].transpose(0, 1)[None].expand(length, -1, -1, -1)
    value = captured["value"][0].transpose(0, 1)[None].expand(length, -1, -1, -1)
    allowed = mask == 0
    got = masked_attention(q, key, value, allowed, 1.0 / layer.head_dim, rel_bias=table, position=position)
    # Both compute matmul * scale + bias and a softmax in fp32; the weighted sums reduce in another order.
    torch.testing.assert_close(layer.o_proj(got.flatten(1)), want, atol=FP32_LAYER * want.abs().max(), rtol=0)


# -- bf16 steps through the caches ------------------------------------------------------------------------


class _LayerTap:
    """Record every stepops decoder layer's output rows during steps."""

    def __init__(self, model) -> None:
        self.outputs: list[torch.Tensor] = []
        self.hooks = [layer.register_forward_hook(lambda m, a, out: self.outputs.append(out.clone())) for layer in model.layers]

    def take(self) -> list[torch.Tensor]:
        taken, self.outputs = self.outputs, []
        return taken


@pytest.mark.parametrize("keys_per_chunk", [None, 1], ids=["default_chunks", "one_block_chunks"])
def test_steps_equal_transformers_in_bf16(checkpoint, hf16, hf32, keys_per_chunk):
    """Ragged chunked prefill, decode and verify steps with rejected drafts: every committed token's layer
    outputs and logits vs transformers on the whole sequence. With one-block attention chunks a global
    layer folds its up to 40 keys in three chunks (by default, one)."""
    chunking = {} if keys_per_chunk is None else dict(attention_keys_per_chunk=keys_per_chunk)
    _steps_equal_transformers_in_bf16(checkpoint, hf16, hf32, **chunking)


def _steps_equal_transformers_in_bf16(checkpoint, hf16, hf32, **settings) -> None:
    model = load_inkling(checkpoint, **settings)
    runner = StepRunner(model, max_requests=3, max_model_len=40, max_tokens=16, device="cpu", inputs=TOKENS)
    tap = _LayerTap(model)
    rng = random.Random(0)
    lengths = (31, 17, 24)
    truth = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    layers = len(model.layers)
    widths = [model.config.hidden_size] * layers + [model.config.output_vocab_size]
    got = [[torch.full((n, width), float("nan")) for width in widths] for n in lengths]
    committed, rejected = [0, 0, 0], 0
    prompt = (20, 5, 11)
    while any(c < n for c, n in zip(committed, lengths)):
        batch, plans, room = [], [], 16
        for i, c in enumerate(committed):
            if c >= lengths[i] or room == 0:
                continue
            if c < prompt[i]:
                count = min(prompt[i] - c, room, 7)  # chunks of up to 7: prompts take 1-3 steps
                rows, commit = truth[i][c : c + count], count
            else:
                drafts = min(3, room - 1) if (c + i) % 2 else 0
                accept = rng.randint(0, drafts)
                commit = min(1 + accept, lengths[i] - c)
                wrong = [(t + 1 + rng.randrange(VOCAB - 1)) % VOCAB for t in truth[i][c : c + 1 + drafts]]
                rows = (truth[i][c : c + 1 + accept] + wrong)[: 1 + drafts]
                rows += wrong[len(rows) :]
                rows = rows + [0] * (1 + drafts - len(rows))
                rejected += len(rows) - commit
            room -= len(rows)
            batch.append(ScheduledRequest(i, c, torch.tensor(rows)))
            plans.append((i, c, commit))
        logits = runner.step(batch)
        outs = tap.take()
        start = 0
        for (i, c, commit), scheduled, row_logits in zip(plans, batch, logits):
            for j, out in enumerate(outs):
                got[i][j][c : c + commit] = out[start : start + commit].float()
            got[i][layers][c : c + commit] = row_logits[:commit].float()
            start += len(scheduled.inputs)
            committed[i] = c + commit
    assert rejected > 0
    excluded = compared = 0
    for i, tokens in enumerate(truth):
        ids = torch.tensor(tokens)
        io32, logits32 = _layer_io(hf32, ids)
        io16, logits16 = _layer_io(hf16, ids)
        wants = [y for _, y in io32] + [logits32]
        hf16s = [y.float() for _, y in io16] + [logits16.float()]
        keep = _rows_without_routing_near_ties(hf32, ids)
        for j, (mine, want, hf) in enumerate(zip(got[i], wants, hf16s)):
            what = f"request {i} " + (f"layer {j}" if j < layers else "logits")
            rows = keep[min(j, layers - 1)]
            excluded += int((~rows).sum())
            compared += len(rows)
            if not rows.any():  # all left out: the count below says so
                continue
            mine, want, hf = mine[rows], want[rows], hf[rows]
            for name, norm in (("max", lambda e: e.abs().max()), ("rms", lambda e: e.pow(2).mean().sqrt())):
                err, hf_err = norm(mine - want), norm(hf - want)
                assert err <= BF16_FACTOR * hf_err, f"{what}: {name} error {err:.3g}, transformers' bf16 {hf_err:.3g}"
    assert excluded <= MAX_ROUTING_TIE_FRACTION * compared, f"{excluded} of {compared} rows left out"


def _rows_without_routing_near_ties(hf32, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, ``[L]`` bool: the rows whose output cannot depend on a routing near tie.

    A token whose k-th and (k + 1)-th expert choice scores (transformers' fp32) are within
    ``ROUTING_NEAR_TIE`` may be routed either way by two correct bf16 models, and the other expert changes
    its MLP output by O(1). That reaches its own row and the next ``W - 1`` (the MLP-output conv) in that
    layer, and every later row of the request in later layers (their attention reads it).
    """
    scores, hooks = {}, []
    for j, layer in enumerate(hf32.model.layers):
        if hasattr(layer.mlp, "gate"):
            def record(module, args, out, j=j):
                logits = torch.nn.functional.linear(args[0][0].float(), module.weight.float())
                scores[j] = logits.sigmoid()[:, : module.num_experts] + module.e_score_correction_bias
            hooks.append(layer.mlp.gate.register_forward_hook(record))
    try:
        with torch.no_grad():
            hf32(ids[None])
    finally:
        for hook in hooks:
            hook.remove()
    length, width, top_k = len(ids), hf32.config.conv_kernel_size, hf32.config.num_experts_per_tok
    later = torch.zeros(length, dtype=torch.bool)
    keep = []
    for j in range(len(hf32.model.layers)):
        here = torch.zeros(length, dtype=torch.bool)
        if j in scores and 0 < top_k < scores[j].shape[-1]:  # (k = 0 or k = n_routed_experts: no choice to flip)
            ranked = scores[j].sort(-1, descending=True).values
            near = ranked[:, top_k - 1] - ranked[:, top_k] < ROUTING_NEAR_TIE
            for t in near.nonzero().flatten().tolist():
                here[t : t + width] = True
            keep.append(~(here | later))
            later |= near.cumsum(0) > 0
        else:
            keep.append(~later)
    return keep


# -- other configurations ---------------------------------------------------------------------------------

# Configs transformers accepts that differ from HF_CONFIG where stepops once refused them: only the layer kinds
# in use are validated (transformers builds no others), and an unpadded_vocab_size above vocab_size keeps
# every logit (transformers slices only below). Each also varies the geometry: MQA and GQA 4, k = E, k = 1 and
# k = 0 routing, W = 3 and W = 2, no log scaling, a window of 3, no muP divisor.
CONFIG_VARIANTS = {
    "all_global_unused_swa_geometry": dict(
        layer_types=["hybrid", "hybrid"], mlp_layer_types=["sparse", "dense"], num_hidden_layers=2,
        num_key_value_heads=1, swa_num_attention_heads=4, swa_num_key_value_heads=3, sliding_window_size=0,
        n_routed_experts=3, num_experts_per_tok=3, conv_kernel_size=3, log_scaling_n_floor=None,
        unpadded_vocab_size=200,
    ),
    "all_sliding_unused_global_geometry": dict(
        layer_types=["hybrid_sliding", "hybrid_sliding"], mlp_layer_types=["dense", "sparse"], num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=3, rel_extent=0, log_scaling_n_floor=0,
        swa_num_attention_heads=8, swa_num_key_value_heads=2, sliding_window_size=3,
        num_experts_per_tok=1, conv_kernel_size=2, logits_mup_width_multiplier=1.0,
    ),
    # hidden 64 over 3 sliding KV heads: chunks of 22, the last one padded by 2 zero channels.
    "hidden_not_divisible_by_kv_heads": dict(swa_num_attention_heads=6, swa_num_key_value_heads=3),
    # top-0 routing: every token gets only the shared experts (stepops refused it; transformers runs it).
    "shared_experts_only": dict(num_experts_per_tok=0),
}


def _equals_transformers(config: dict, tmp_path, **settings) -> None:
    """A random checkpoint of ``config`` equals transformers' in fp32 layer by layer and in the bf16 steps
    (run with the serving ``settings`` of ``load_inkling``)."""
    checkpoint = save_random_inkling(tmp_path, config)
    hf32, hf16 = load_transformers_inkling(checkpoint, torch.float32), load_transformers_inkling(checkpoint, torch.bfloat16)
    _every_layer_equals_transformers_in_fp32(checkpoint, hf32)
    _steps_equal_transformers_in_bf16(checkpoint, hf16, hf32, **settings)


@pytest.mark.parametrize("variant", sorted(CONFIG_VARIANTS))
def test_config_variants_equal_transformers(variant, tmp_path):
    _equals_transformers({**HF_CONFIG, **CONFIG_VARIANTS[variant]}, tmp_path)


def _random_config(rng: random.Random) -> dict:
    """A transformers config drawn from the space the variants above vary one option at a time: 2-3 layers
    of either kind and MLP, MHA to GQA 3 in each attention, hidden sizes KV heads may not divide, head dims
    4-16, windows of 1-64, relative extents of 1-100, log scaling or none, top-k 0 to E of 2-8 experts with
    1-3 shared, W = 2-5."""
    layers, experts = rng.randint(2, 3), rng.choice((2, 4, 5, 8))
    kv_heads, swa_kv_heads = rng.choice((1, 2, 3, 4)), rng.choice((1, 2, 4))
    return dict(
        hidden_size=rng.choice((32, 40, 48, 64)), num_hidden_layers=layers,
        num_attention_heads=kv_heads * rng.choice((1, 2)), num_key_value_heads=kv_heads, head_dim=rng.choice((8, 12, 16)),
        swa_num_attention_heads=swa_kv_heads * rng.choice((1, 2, 3)), swa_num_key_value_heads=swa_kv_heads,
        swa_head_dim=rng.choice((4, 8, 16)), sliding_window_size=rng.choice((1, 2, 5, 8, 64)),
        d_rel=rng.choice((2, 4, 8)), rel_extent=rng.choice((1, 5, 12, 100)),
        log_scaling_n_floor=rng.choice((None, 1, 4, 30)), log_scaling_alpha=rng.choice((0.1, 0.5)),
        layer_types=[rng.choice(("hybrid", "hybrid_sliding")) for _ in range(layers)],
        mlp_layer_types=[rng.choice(("dense", "sparse")) for _ in range(layers)],
        intermediate_size=rng.choice((24, 96)), moe_intermediate_size=rng.choice((8, 32)),
        n_routed_experts=experts, num_experts_per_tok=rng.randint(0, experts), n_shared_experts=rng.choice((1, 2, 3)),
        route_scale=rng.choice((1.0, 2.5)), logits_mup_width_multiplier=rng.choice((1.0, 3.0)),
        conv_kernel_size=rng.choice((2, 3, 4, 5)), rms_norm_eps=rng.choice((1e-6, 1e-5)),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_random_configs_equal_transformers(seed, tmp_path):
    """Combinations no variant has: fp32 layer by layer and the bf16 steps, as the variants. Of 60 draws, all
    were within the fp32 bound; 3 left out more than a quarter of the steps' rows for routing near ties
    (random weights, 4-8 experts), which the bf16 check refuses as saying too little; one had a layer's
    largest error 2.1x transformers' bf16 one (``BF16_FACTOR`` 2), at one element one bf16 ulp from
    transformers' bf16 value: over 30 draws the ratio of the rms errors is 0.98 on average, at most 1.2.
    The steps attend in chunks of one block, two, or all (up to 40 keys in blocks of 16)."""
    rng = random.Random(seed)
    config = _random_config(rng)
    _equals_transformers({**HF_CONFIG, **config}, tmp_path, attention_keys_per_chunk=rng.choice((1, 32, 1024)))


def test_a_negative_log_scaling_floor_scales_by_one_as_in_transformers(tmp_path):
    """transformers' ``clamp(min=1)`` makes a negative floor scale the global layers by exactly 1 (it was
    refused); fp32 layer by layer, the bf16 steps being no different from HF_CONFIG's."""
    config = {**HF_CONFIG, "log_scaling_n_floor": -3}
    checkpoint = save_random_inkling(tmp_path, config)
    assert load_inkling(checkpoint).layers[1].log_scaling
    _every_layer_equals_transformers_in_fp32(checkpoint, load_transformers_inkling(checkpoint, torch.float32))


# 16 routed experts, top-2: steps of up to 7 tokens run only the chosen experts (``T * k < E``), so the
# decode and verify steps here (padded to 2 or 4) take that path and the prefill steps (8, 16) the
# all-experts one, both against transformers. With 16 scores the k-th and next lie closer than with 4: a
# correction bias of std 0.5 left 26% of the rows out as routing near ties, std 1.25 leaves 10% (30 of
# 288) while tokens still pick different pairs (5 experts in 4 pairs over 40 random inputs of layer 2).
SMALL_STEP_CONFIG = dict(n_routed_experts=16)
SMALL_STEP_BIAS_STD = 1.25


def test_small_steps_run_only_the_chosen_experts_and_equal_transformers(tmp_path, monkeypatch):
    from stepops.models.inkling import InklingMoE

    taken = []
    chosen = InklingMoE.chosen_experts
    monkeypatch.setattr(InklingMoE, "chosen_experts", lambda self, *a: (taken.append(a[0].shape[0]), chosen(self, *a))[1])
    checkpoint = save_random_inkling(
        tmp_path, {**HF_CONFIG, **SMALL_STEP_CONFIG}, correction_bias=lambda shape: torch.randn(shape) * SMALL_STEP_BIAS_STD
    )
    hf32, hf16 = load_transformers_inkling(checkpoint, torch.float32), load_transformers_inkling(checkpoint, torch.bfloat16)
    _every_layer_equals_transformers_in_fp32(checkpoint, hf32, length=5)  # no cache: T = 5 per layer
    assert taken == [5, 5, 5, 5], taken  # each sparse layer twice (its own input, then the stack's)
    taken.clear()
    _steps_equal_transformers_in_bf16(checkpoint, hf16, hf32)
    assert taken and set(taken) <= {2, 4}, taken  # (T = 1 never: the runner pads a lone token to 2)
    assert len(taken) >= 2 * 4, f"{len(taken) // 2} small steps (two sparse layers each)"


# Configs transformers builds at the edges of stepops' value checks: zero-width relative states and MLPs (which
# transformers also runs; its grouped-GEMM experts refuse zero width on CPU, its eager ones do not), and any
# int in the fields of an MLP kind no layer uses.
EDGE_CONFIGS = {
    "zero_widths": dict(d_rel=0, intermediate_size=0, moe_intermediate_size=0),
    "all_sparse_unused_dense_width": dict(mlp_layer_types=["sparse"] * 3, intermediate_size=-5),
    "all_dense_unused_experts": dict(
        mlp_layer_types=["dense"] * 3, moe_intermediate_size=-5, n_routed_experts=-1, num_experts_per_tok=-2,
        n_shared_experts=-1,
    ),
}


@pytest.mark.parametrize(
    "edit",
    [{}, *CONFIG_VARIANTS.values(), SMALL_STEP_CONFIG, *EDGE_CONFIGS.values()],
    ids=["oracle", *CONFIG_VARIANTS, "small_step", *EDGE_CONFIGS],
)
def test_configs_transformers_builds_stepops_builds(edit):
    """The oracle tests' configs and the edge cases above: transformers builds the model, and so does stepops
    from transformers' config dict (what ``save_pretrained`` writes)."""
    hf_config = InklingTextConfig(**{**HF_CONFIG, **edit})
    InklingForCausalLM(hf_config)
    InklingModel(config_from_transformers(hf_config.to_dict()))


# -- greedy generation ------------------------------------------------------------------------------------

# Two prompts whose greedy continuations have no near tie: at every one of the 32 steps transformers'
# fp32 top logit leads the next by >= GREEDY_MARGIN (checked below), several times the bf16 logit error
# (~0.05 here). Two correct bf16 models may break a closer tie either way, and on random weights one in a
# few 32-token runs meets one; these prompts were picked from seeded random ones for their margin.
PROMPTS = ([79, 24, 51, 104, 85, 48, 112, 81, 117, 1, 40, 59], [88, 13, 3, 79, 84, 60, 99])
NEW_TOKENS = 32
GREEDY_MARGIN = 0.15


@pytest.fixture(scope="module")
def hf_gen16(gen_checkpoint):
    return load_transformers_inkling(gen_checkpoint, torch.bfloat16)


def _hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    """transformers' greedy new tokens for one prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_tokens(gen_checkpoint, hf_gen16):
    """transformers' greedy tokens for each prompt (bf16), after checking their margins in fp32."""
    hf32 = load_transformers_inkling(gen_checkpoint, torch.float32)
    out = []
    for prompt in PROMPTS:
        tokens = _hf_generate(hf_gen16, prompt)
        with torch.no_grad():
            logits = hf32(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        top = logits.topk(2, dim=-1).values
        assert logits.argmax(-1).tolist() == tokens, "transformers' fp32 and bf16 greedy tokens differ"
        assert (top[:, 0] - top[:, 1]).min() >= GREEDY_MARGIN, "a greedy step of the test prompts is a near tie"
        out.append(tokens)
    return out


def _generate(path, mode=EAGER, backend="aot_eager", draft=None, stop_tokens=None):
    """Greedy tokens from stepops and the number of steps taken."""
    model = load_inkling(path)
    runner = StepRunner(
        model, max_requests=2, max_model_len=64, max_tokens=16, device="cpu", mode=mode, compile_backend=backend, inputs=TOKENS
    )
    return runner.generate(PROMPTS, NEW_TOKENS, draft=draft, stop_tokens=stop_tokens), runner.steps


def test_greedy_generation_equals_transformers(gen_checkpoint, hf_tokens):
    assert len(set(map(len, PROMPTS))) == 2 and all(len(t) == NEW_TOKENS for t in hf_tokens)
    tokens, steps = _generate(gen_checkpoint)
    assert tokens == hf_tokens
    # 19 prompt tokens, 16 per step: the second prompt's prefill is split over two steps (the second also
    # decodes the first prompt's second token), then one step per token.
    assert steps == NEW_TOKENS + 1


def test_compiled_generation_equals_transformers_one_graph(gen_checkpoint, hf_tokens):
    counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    assert _generate(gen_checkpoint, COMPILED, backend)[0] == hf_tokens
    assert backend.frame_count == 1, f"{backend.frame_count} graphs"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_speculative_generation_with_rejections_emits_the_same_tokens(gen_checkpoint, hf_tokens):
    """Drafts of 3 from the true continuation, one in three corrupted: verify steps reject the rest and the
    next step overwrites the rejected rows in both caches."""
    corrupted = []

    def draft(i: int, tokens: list[int]) -> list[int]:
        done = len(tokens) - len(PROMPTS[i])
        proposal = hf_tokens[i][done : done + 3]
        if (done + i) % 3 == 1 and proposal:
            proposal[len(proposal) // 2] = (proposal[len(proposal) // 2] + 1) % 120
            corrupted.append(i)
        return proposal

    tokens, steps = _generate(gen_checkpoint, draft=draft)
    assert tokens == hf_tokens
    assert len(corrupted) >= 4 and steps < NEW_TOKENS // 2  # drafts were rejected, and many accepted


def test_generation_stops_at_a_stop_token_as_transformers_stops_at_eos(gen_checkpoint, hf_gen16, hf_tokens):
    """Each prompt's continuation holds one of two stop tokens partway (transformers' ``eos_token_id``):
    that request ends with it and the other goes on. With drafts from the true continuation, a verify step
    accepts the stop token and drafts after it, and those are not emitted."""
    stops = [hf_tokens[0][9], hf_tokens[1][20]]
    want = [_hf_generate(hf_gen16, prompt, eos_token_id=stops) for prompt in PROMPTS]
    assert len(want[0]) != len(want[1]) and max(map(len, want)) < NEW_TOKENS

    def draft(i: int, tokens: list[int]) -> list[int]:
        done = len(tokens) - len(PROMPTS[i])
        return hf_tokens[i][done : done + 3]

    assert _generate(gen_checkpoint, stop_tokens=stops)[0] == want
    assert _generate(gen_checkpoint, draft=draft, stop_tokens=stops)[0] == want


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_generation_stops_at_the_checkpoints_eos_by_default_as_transformers_does(gen_checkpoint, hf_tokens, tmp_path, where):
    """Without ``stop_tokens``, ``generate`` stops where transformers' ``generate`` stops by default: at
    config.json's ``eos_token_id``, or at generation_config.json's when that file is there (it wins over
    config.json's, here an id neither continuation emits). ``stop_tokens=()`` runs to ``max_new_tokens``."""
    never = min(set(range(HF_CONFIG["unpadded_vocab_size"])) - set(hf_tokens[0] + hf_tokens[1]))
    in_config = hf_tokens[0][9] if where == "config.json" else never
    path = single_file_copy(gen_checkpoint, tmp_path, config_edit=lambda config: config.update(eos_token_id=in_config))
    if where == "generation_config.json":
        (path / where).write_text(json.dumps({"eos_token_id": [never, hf_tokens[1][20]]}))
    hf = load_transformers_inkling(path, torch.bfloat16)
    want = [_hf_generate(hf, prompt) for prompt in PROMPTS]
    assert min(map(len, want)) < NEW_TOKENS
    assert _generate(path)[0] == want
    assert _generate(path, stop_tokens=())[0] == hf_tokens
