"""CUDA graphs: a decode step of both models captured with ``torch.cuda.CUDAGraph`` and compiled with
``mode="reduce-overhead"``; replays equal eager. These need a GPU and skip without one (CPU CI covers the
proxies in test_compile.py: no CUDA-graph-incompatible node, fake-CUDA trace)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters

from stepops.models import InklingConfig, InklingModel, Step5Config, Step5ForCausalLM, Step5Model
from stepops.models.runner import CUDA_GRAPH, EAGER, TOKENS, ScheduledRequest, StepRunner
from stepops.testing import TOLERANCES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

_MODELS = [pytest.param(Step5Model, Step5Config(), id="step5"), pytest.param(InklingModel, InklingConfig(), id="inkling")]


def _steps(hidden_size: int):
    """A prefill of two requests (T = 16 after padding), three decode steps (T = 2), then three tokens of
    each (T = 8): the graphs, captured largest first into one pool, replay out of capture order."""
    gen = torch.Generator().manual_seed(0)

    def rows(n):
        return torch.randn(n, hidden_size, generator=gen).to(torch.bfloat16)

    yield [ScheduledRequest(0, 0, rows(11)), ScheduledRequest(1, 0, rows(5))]
    for i in range(3):
        yield [ScheduledRequest(0, 11 + i, rows(1)), ScheduledRequest(1, 5 + i, rows(1))]
    yield [ScheduledRequest(0, 14, rows(3)), ScheduledRequest(1, 8, rows(3))]


def _make(model_cls, config, mode):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(config)
    return model, StepRunner(model, max_requests=2, max_model_len=32, max_tokens=16, device="cuda", mode=mode)


@pytest.mark.parametrize("model_cls, config", _MODELS)
def test_cuda_graph_replay_equals_eager(model_cls, config):
    eager_model, eager = _make(model_cls, config, EAGER)
    graph_model, graphed = _make(model_cls, config, CUDA_GRAPH)
    graphed.warm_up()  # captures every size from padding-only steps, which write nothing
    assert len({graph.pool() for graph, _ in graphed._graphs.values()}) == 1  # one shared memory pool
    # Compared after every step has run: a step's outputs must outlive the replays of the other graphs,
    # whose intermediates share the pool with its graph's output buffer (step() clones them at once).
    outputs = [(graphed.step(batch), eager.step(batch)) for batch in _steps(config.hidden_size)]
    for got, want in outputs:
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)  # same kernels, same order: bitwise
    for a, b in zip(graph_model.cache_tensors(), eager_model.cache_tensors()):
        assert torch.equal(a, b)


def test_a_step_before_warm_up_says_to_warm_up_and_writes_no_cache():
    model, runner = _make(InklingModel, InklingConfig(), CUDA_GRAPH)
    before = [t.clone() for t in model.cache_tensors()]
    with pytest.raises(RuntimeError, match=r"call warm_up\(\) before the first step"):
        runner.step(next(_steps(model.config.hidden_size)))
    assert all(torch.equal(a, b) for a, b in zip(model.cache_tensors(), before))


@pytest.mark.parametrize("model_cls, config", _MODELS)
def test_reduce_overhead_replay_equals_eager_without_cudagraph_skips(model_cls, config):
    eager_model, eager = _make(model_cls, config, EAGER)
    model, runner = _make(model_cls, config, EAGER)
    # Every tensor object the ops write through (Step5's ring rows view included), so none is treated as a
    # mutated non-static input; test_compile checks that this list is exactly what the graph writes.
    for tensor in model.mutated_tensors():
        torch._dynamo.mark_static_address(tensor)
    runner._compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    counters.clear()
    tol = TOLERANCES["model_vs_recompute"]
    # No near-tie exclusion is needed against eager here: every position is at most 16, so a token has at
    # most two complete earlier regions, and index_top_k = 2 chooses them all: no choice an ulp could flip.
    # Three decode steps of one shape (cudagraph trees warm up, record, then replay it), then another shape.
    for batch in _steps(config.hidden_size):
        for a, b in zip(runner.step(batch), eager.step(batch)):
            torch.testing.assert_close(a, b, atol=tol.atol, rtol=tol.rtol)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    for a, b in zip(model.cache_tensors(), eager_model.cache_tensors()):
        if a.dtype == torch.uint8:  # a Step5 summary cache: e4m3 codes, compared as their values
            codes = TOLERANCES["csa_summary_cache_vs_model"]
            a, b = (t.view(torch.float8_e4m3fn).float() for t in (a, b))
            torch.testing.assert_close(a, b, atol=codes.atol, rtol=codes.rtol)
        else:
            torch.testing.assert_close(a, b, atol=tol.atol, rtol=tol.rtol)


def _token_runner(make, mode):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = make()
    runner = StepRunner(model, max_requests=2, max_model_len=48, max_tokens=16, device="cuda", mode=mode, inputs=TOKENS)
    if mode == CUDA_GRAPH:
        runner.warm_up()
    return runner


@pytest.mark.parametrize(
    "make",
    [partial(InklingModel, InklingConfig(mlp_layer_types=("dense", "sparse"))), partial(Step5ForCausalLM, Step5Config())],
    ids=["inkling", "step5"],
)
def test_cuda_graph_generation_equals_eager(make):
    """Token steps (embedding to logits, MoE routing included) replayed from CUDA graphs: greedy generation
    of a ragged batch, plain and with partly wrong drafts, emits eager's tokens (same kernels: bitwise)."""
    config = make.args[0]
    prompts = [[5, 17, 99, 3, 42, 8, 61], [64, 7, 30]]
    want = _token_runner(make, EAGER).generate(prompts, 12)
    assert _token_runner(make, CUDA_GRAPH).generate(prompts, 12) == want

    def draft(i, tokens):
        done = len(tokens) - len(prompts[i])
        return [(t + done % 2) % config.vocab_size for t in want[i][done : done + 3]]  # wrong on odd steps

    assert _token_runner(make, CUDA_GRAPH).generate(prompts, 12, draft=draft) == want
