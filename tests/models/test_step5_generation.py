"""``Step5ForCausalLM``: token ids through the cached steps to logits and greedy tokens, against the independent
recompute of StepFun's formulas (``stepops.testing.step5_reference``) with the reference's head
(``Step4ForCausalLM.forward``: ``lm_head(hidden.to(bf16))``, bf16 logits; the embedding a row lookup).

Greedy choices are compared where the recompute's choice is clear: two correct bf16 models may break a near
tie of the top two logits either way (with 128 random logits, 8 of the 48 steps here are within ``NEAR_TIE``,
2 exact bf16 ties; stepops chose the recompute's top token at all 48 where seen).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch._dynamo.utils import counters

from stepops.models.runner import COMPILED, EAGER, TOKENS, ScheduledRequest, StepRunner
from stepops.models.step5 import Step5ForCausalLM
from stepops.models.step5_config import Step5Config
from stepops.models.step5_weights import load_step5_state_dict
from stepops.testing.recompute import NEAR_TIE_MARGIN
from stepops.testing.step5_checkpoint import random_step5_checkpoint
from stepops.testing.step5_reference import step5_recompute

CONFIG = Step5Config()  # sliding + MoE, CSA + dense MLP; 128-token vocabulary
_RNG = random.Random(0)
PROMPTS = ([_RNG.randrange(CONFIG.vocab_size) for _ in range(19)], [_RNG.randrange(CONFIG.vocab_size) for _ in range(12)])
NEW_TOKENS = 24  # the sequences reach 43 tokens: five regions, more than index_top_k = 2 to choose from
# A logit within this fraction of the row's largest |logit| of the top one is a near tie: a few bf16 ulps
# (2**-8 relative each) for the logits' own rounding and the hidden state's (model vs recompute, per layer).
NEAR_TIE = 2**-6


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, torch.Tensor]:
    return random_step5_checkpoint(CONFIG, seed=0, causal_lm=True)


def _runner(checkpoint, mode=EAGER, backend="aot_eager", max_tokens=16, config=CONFIG) -> StepRunner:
    model = Step5ForCausalLM(config)
    load_step5_state_dict(model, checkpoint)
    return StepRunner(
        model, max_requests=2, max_model_len=64, max_tokens=max_tokens, device="cpu", mode=mode,
        compile_backend=backend, inputs=TOKENS,
    )  # fmt: skip


def _recompute_logits(checkpoint, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's bf16 logits (as fp32) of every position of ``tokens``, and which positions depend on a
    near-tie region choice (either choice is right there; see stepops.testing.recompute)."""
    hidden, near = step5_recompute(CONFIG, checkpoint, checkpoint["embed_tokens.weight"][torch.tensor(tokens)], NEAR_TIE_MARGIN)
    return F.linear(hidden, checkpoint["lm_head.weight"]).float(), near


def test_prefill_logits_equal_the_recompute(checkpoint):
    prompt = PROMPTS[0] + PROMPTS[1]
    (logits,) = _runner(checkpoint, max_tokens=32).step([ScheduledRequest(0, 0, torch.tensor(prompt))])
    want, near = _recompute_logits(checkpoint, prompt)
    assert not near.any(), "a region choice of the test prompt is a near tie"
    assert logits.dtype == torch.bfloat16 and logits.shape == (len(prompt), CONFIG.vocab_size)
    bound = NEAR_TIE * want.abs().amax(-1, keepdim=True)
    assert ((logits.float() - want).abs() <= bound).all(), (logits.float() - want).abs().max()


def _check_greedy(checkpoint, tokens: list[list[int]]) -> None:
    """Every new token is the recompute's top logit given the tokens before it, or within a near tie of it
    (rows after a near-tie region choice left out); and most choices are clear (else the check would say
    little)."""
    clear = 0
    for prompt, new in zip(PROMPTS, tokens, strict=True):
        logits, near = _recompute_logits(checkpoint, prompt + new[:-1])
        logits, compared = logits[len(prompt) - 1 :], ~near[len(prompt) - 1 :]  # none left out here
        top = logits.topk(2, dim=-1).values
        tie = NEAR_TIE * logits.abs().amax(-1)
        chosen = logits.gather(1, torch.tensor(new)[:, None])[:, 0]
        assert (top[:, 0] - chosen <= tie)[compared].all(), (top[:, 0] - chosen).tolist()
        clear += int((top[:, 0] - top[:, 1] > tie)[compared].sum())
    # 40 of 48 here; another tie broken the other way changes the rest of that sequence, and its count
    assert clear >= 2 / 3 * NEW_TOKENS * len(PROMPTS), clear


def test_greedy_generation_follows_the_recompute(checkpoint):
    runner = _runner(checkpoint)
    tokens = runner.generate(PROMPTS, NEW_TOKENS)
    assert [len(t) for t in tokens] == [NEW_TOKENS] * 2
    _check_greedy(checkpoint, tokens)
    # 31 prompt tokens, 16 per step: two prefill steps (the second also decodes the first prompt's second
    # token), then one step per token
    assert runner.steps == NEW_TOKENS + 1


def test_generation_stops_at_the_configs_end_of_sequence_ids_by_default(checkpoint):
    """As the reference's ``generate_greedy``: without stop ids, a request ends with the first of the config's
    ``eos_token_id`` it emits (``CONFIG`` has none); ``stop_tokens=()`` runs to ``max_new_tokens``."""
    full = _runner(checkpoint).generate(PROMPTS, NEW_TOKENS)
    eos = (full[0][5], full[1][20])
    runner = _runner(checkpoint, config=dataclasses.replace(CONFIG, eos_token_ids=eos))
    want = [tokens[: min(tokens.index(t) for t in eos if t in tokens) + 1] for tokens in full]
    assert runner.generate(PROMPTS, NEW_TOKENS) == want and min(map(len, want)) < NEW_TOKENS
    assert runner.generate(PROMPTS, NEW_TOKENS, stop_tokens=()) == full


def test_compiled_and_speculative_generation_emit_the_eager_tokens(checkpoint):
    """Compiled (one graph over every step size, no break) and with drafts of 3 from the eager continuation,
    one in three corrupted, so verify steps reject drafts and the ring replays over rolled-back rows."""
    want = _runner(checkpoint).generate(PROMPTS, NEW_TOKENS)
    counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    assert _runner(checkpoint, COMPILED, backend).generate(PROMPTS, NEW_TOKENS) == want
    assert backend.frame_count == 1, f"{backend.frame_count} graphs"
    assert not counters["graph_break"], dict(counters["graph_break"])

    corrupted = []

    def draft(i: int, tokens: list[int]) -> list[int]:
        done = len(tokens) - len(PROMPTS[i])
        proposal = want[i][done : done + 3]
        if (done + i) % 3 == 1 and proposal:
            proposal[-1] = (proposal[-1] + 1) % CONFIG.vocab_size
            corrupted.append(i)
        return proposal

    runner = _runner(checkpoint)
    assert runner.generate(PROMPTS, NEW_TOKENS, draft=draft) == want
    assert len(corrupted) >= 4 and runner.steps < NEW_TOKENS // 2
