"""Steps with no tokens (T = 0) or no requests (R = 0) run through both models and the runner and write
nothing: every byte of every cache is unchanged (issue 15: T = 0 and R = 0 work everywhere)."""

from __future__ import annotations

import pytest
import torch

from stepops.models import InklingModel, Step5Model
from stepops.models.metadata import StepBuffers
from stepops.models.runner import StepRunner
from stepops.testing.storage import StorageSnapshot


def _runner(model_cls):
    torch.manual_seed(0)
    model = model_cls()
    runner = StepRunner(model, max_requests=2, max_model_len=32, max_tokens=8, device="cpu")
    for cache in model.cache_tensors():  # random bytes, so that a write of anything shows
        cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8))
    return model, runner


def _without_requests(buffers: StepBuffers) -> StepBuffers:
    """The runner's buffers with R = 0: no request rows, the tables keep their widths."""
    return StepBuffers(torch.zeros(1, dtype=torch.int32), *(b[:0] for b in buffers[1:]))


@pytest.mark.parametrize("model_cls", [Step5Model, InklingModel], ids=["step5", "inkling"])
def test_empty_steps_write_nothing(model_cls):
    model, runner = _runner(model_cls)
    snapshot = StorageSnapshot(model.cache_tensors())
    assert runner.step([]) == []
    hidden = model.config.hidden_size
    with torch.inference_mode():
        assert model(runner.inputs[:0], runner.buffers).shape == (0, hidden)
        no_requests = _without_requests(runner.buffers)
        for num_tokens in (0, 3):
            assert model(runner.inputs[:num_tokens], no_requests).shape == (num_tokens, hidden)
    assert snapshot.changed_bytes() == 0
