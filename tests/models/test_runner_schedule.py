"""StepRunner refuses a bad schedule with a ValueError before it touches its buffers or any cache: a step
larger than ``max_tokens``, a slot outside ``0..max_requests - 1`` (a negative slot indexed
another slot's block-table row from the end and wrote that request's pages), a slot scheduled twice in one
step, a negative start, a start past the positions the slot's request has fed (its attention would read
what an earlier request left in the caches), a Step5 step further back than its CSA rings keep. A good
schedule reaches the device in non-blocking copies (each blocking one is a stream sync on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepops.models import InklingConfig, InklingModel, Step5Config, Step5ForCausalLM, Step5Model
from stepops.models.runner import TOKENS, ScheduledRequest, StepRunner, Workload, run_workload
from stepops.testing.step5_checkpoint import random_step5_checkpoint
from stepops.testing.storage import StorageSnapshot


def _runner_with_slot_1_fed() -> StepRunner:
    torch.manual_seed(0)
    model = InklingModel()
    runner = StepRunner(model, max_requests=2, max_model_len=32, max_tokens=8, device="cpu")
    hidden = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
    runner.step([ScheduledRequest(1, 0, hidden)])  # slot 1 holds a request
    return runner


@pytest.fixture(scope="module")
def runner():
    """Shared by the tests that feed it nothing: "start-in-a-slot-never-fed" needs slot 0 never fed."""
    return _runner_with_slot_1_fed()


def _x(runner, n):
    return torch.randn(n, runner.model.config.hidden_size).to(torch.bfloat16)


@pytest.mark.parametrize(
    "make_batch, match",
    [
        (lambda x: [ScheduledRequest(0, 0, x(9))], "a step of 9 tokens exceeds the runner's max_tokens 8"),
        (lambda x: [ScheduledRequest(-1, 0, x(3))], "slot -1 is outside"),
        (lambda x: [ScheduledRequest(2, 0, x(3))], "slot 2 is outside"),
        (lambda x: [ScheduledRequest(0, 0, x(2)), ScheduledRequest(0, 2, x(2))], "slot 0 is scheduled twice"),
        (lambda x: [ScheduledRequest(0, -3, x(3))], "start must be >= 0"),
        (lambda x: [ScheduledRequest(1, 7, x(1))], r"slot 1: start 7 skips positions 5\.\.6, which no step"),
        (lambda x: [ScheduledRequest(0, 2, x(1))], r"slot 0: start 2 skips positions 0\.\.1, which no step"),
        (lambda x: [ScheduledRequest(0, 0, x(3)[:, :32])], r"slot 0: inputs must be \[n, 64\] hidden states"),
        (lambda x: [ScheduledRequest(True, 0, x(3))], "ScheduledRequest.slot must be an int, got bool"),
        (lambda x: [ScheduledRequest(1, 2.5, x(1))], "ScheduledRequest.start must be an int, got float"),
        # were cast into the bf16 buffer (a complex one losing its imaginary part)
        (lambda x: [ScheduledRequest(0, 0, x(3).long())], "hidden states must be floating point, got torch.int64"),
        (lambda x: [ScheduledRequest(0, 0, x(3).to(torch.complex64))], "must be floating point, got torch.complex64"),
        # a RuntimeError from torch; a meta tensor failed its copy after the buffers were overwritten
        (lambda x: [ScheduledRequest(0, 0, None)], "slot 0: inputs must be a tensor, got NoneType"),
        (lambda x: [ScheduledRequest(1, 5, x(1)), ScheduledRequest(0, 0, x(2).to("meta"))], "slot 0: inputs are a meta"),
    ],
    ids=[
        "too-many-tokens", "negative-slot", "slot-past-the-end", "duplicate-slot", "negative-start",
        "start-past-what-the-request-fed", "start-in-a-slot-never-fed", "inputs-of-another-width", "bool-slot",
        "float-start", "int-hidden", "complex-hidden", "none-inputs", "meta-inputs",
    ],  # fmt: skip
)
def test_a_bad_schedule_is_refused_before_anything_is_written(runner, make_batch, match):
    batch = make_batch(lambda n: _x(runner, n))
    snapshot = StorageSnapshot([*runner.model.cache_tensors(), *runner.buffers, runner.inputs])
    with pytest.raises((TypeError, ValueError), match=match):
        runner.step(batch)
    assert snapshot.changed_bytes() == 0


def test_a_step_that_fails_feeds_nothing(monkeypatch):
    """A step that raises after the schedule checks (here its forward) leaves the fed positions as they
    were, so the next step cannot start past what the caches hold. Before: they counted as fed."""
    torch.manual_seed(0)
    runner = StepRunner(InklingModel(), max_requests=1, max_model_len=32, max_tokens=8, device="cpu")
    runner.step([ScheduledRequest(0, 0, _x(runner, 2))])

    def fail(size):
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(runner, "_run", fail)
    with pytest.raises(RuntimeError, match="the forward failed"):
        runner.step([ScheduledRequest(0, 2, _x(runner, 3))])
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"slot 0: start 5 skips positions 2\.\.4"):
        runner.step([ScheduledRequest(0, 5, _x(runner, 1))])
    runner.step([ScheduledRequest(0, 2, _x(runner, 3))])


def test_a_stop_token_is_one_id_or_any_collection_of_ids():
    """The semantics are checked against transformers' eos_token_id in test_inkling_oracle; here, that an
    int, a list, a tensor and a generator name the same stop, and that a step stops only its own request."""
    torch.manual_seed(0)
    runner = StepRunner(InklingModel(), max_requests=2, max_model_len=16, max_tokens=8, device="cpu", inputs="tokens")
    prompts = [[1, 2], [3]]
    full = runner.generate(prompts, 6)
    stop = full[0][2]
    want = [full[0][: full[0].index(stop) + 1], full[1][: full[1].index(stop) + 1] if stop in full[1] else full[1]]
    assert len(want[0]) < 6
    for stop_tokens in (stop, [stop], torch.tensor([stop]), torch.tensor(stop), (t for t in [stop]), np.int64(stop),
                        np.array([stop])):
        assert runner.generate(prompts, 6, stop_tokens=stop_tokens) == want


def test_padded_vocabulary_rows_are_not_stop_tokens():
    """Inkling's logits cover the unpadded vocabulary: a padded row's id can never be emitted."""
    torch.manual_seed(0)
    model = InklingModel(InklingConfig(unpadded_vocab_size=120))
    runner = StepRunner(model, max_requests=1, max_model_len=16, max_tokens=8, device="cpu", inputs="tokens")
    with pytest.raises(ValueError, match=r"^stop_tokens: token ids must be in \[0, 120\) \(the ids the model can emit\), got 125$"):
        runner.generate([[1]], 2, stop_tokens=[125])
    runner.generate([[125]], 1)  # an input id, though: the embedding has the row


def test_step5_drafts_are_cut_to_what_its_rings_can_roll_back():
    """A draft callable that proposes more than the rings keep (max_rollback) would make the next step start
    too far back after a rejection; generate cuts the drafts, as it cuts them to the step budget."""
    torch.manual_seed(0)
    model = Step5ForCausalLM(Step5Config())
    runner = StepRunner(model, max_requests=1, max_model_len=40, max_tokens=16, device="cpu", inputs="tokens")
    plain = runner.generate([[5, 9, 2]], 12)
    assert model.max_rollback == 3
    wrong = lambda i, seq: [(t + 1) % 128 for t in plain[0][len(seq) - 3 :][:6]] + [0] * 6  # noqa: E731
    assert runner.generate([[5, 9, 2]], 12, draft=wrong) == plain


def test_drafts_fill_at_most_the_room_a_step_has_left():
    """generate: a draft longer than the step's budget is cut to the room its pending token leaves (a step of
    5 tokens at max_tokens 4 before); run_workload: a verify turn with fewer budget tokens left than drafts
    carries fewer drafts."""
    torch.manual_seed(0)
    model = InklingModel()
    runner = StepRunner(model, max_requests=1, max_model_len=32, max_tokens=4, device="cpu", inputs="tokens")
    plain = runner.generate([[1, 2, 3]], 8)
    assert runner.generate([[1, 2, 3]], 8, draft=lambda i, seq: [5] * 10) == plain
    workload = Workload(prompt_lens=(2, 2, 2), decode_lens=(4, 4, 4), num_speculative_tokens=3, token_budget=5)
    runner = StepRunner(model, max_requests=3, max_model_len=workload.max_len, max_tokens=5, device="cpu")
    result = run_workload(runner, workload, model.config.hidden_size)
    assert result.verify_turns > 0


def test_max_tokens_1_runs_only_1_token_steps():
    """Its steps are padded to 2 (a size of 1 would compile a second graph), but 2 real tokens were taken."""
    def make(max_tokens):
        torch.manual_seed(0)
        return StepRunner(InklingModel(), max_requests=2, max_model_len=8, max_tokens=max_tokens, device="cpu",
                          inputs="tokens")

    runner = make(1)
    assert runner.capture_sizes == (2,)
    with pytest.raises(ValueError, match="a step of 2 tokens exceeds the runner's max_tokens 1"):
        runner.step([ScheduledRequest(0, 0, torch.tensor([1, 2]))])
    assert runner.generate([[1, 2], [3]], 2) == make(4).generate([[1, 2], [3]], 2)
    assert runner.steps == runner.tokens == 5  # one token per step: 3 prompt tokens, 2 fed back


def test_a_step_past_max_model_len_or_the_slots_is_refused():
    torch.manual_seed(0)
    runner = StepRunner(InklingModel(), max_requests=2, max_model_len=4, max_tokens=8, device="cpu")
    for batch, match in (
        ([ScheduledRequest(0, 0, _x(runner, 5))], "request slot 0 would grow past max_model_len 4"),
        # Three requests with distinct slots, one of them outside: the count is named, not the slot.
        ([ScheduledRequest(slot, 0, _x(runner, 1)) for slot in range(3)], "3 requests in one step; the runner has 2 slots"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            runner.step(batch)
    assert runner.steps == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(inputs="words"), "inputs must be 'hidden', or 'tokens' for a model with forward_tokens, got 'words'"),
        (dict(model=Step5Model, inputs="tokens"), "for a model with forward_tokens, got 'tokens'"),
        (dict(mode="fast"), "mode must be 'eager', 'compiled' or 'cudagraph', got 'fast'"),
        (dict(mode="cudagraph"), "CUDA-graph mode needs a CUDA device"),
    ],
    ids=["unknown-inputs", "tokens-without-forward-tokens", "unknown-mode", "cudagraph-on-cpu"],
)
def test_a_runner_refuses_bad_modes_and_inputs(kwargs, match):
    arguments = dict(max_requests=1, max_model_len=8, max_tokens=4, device="cpu") | kwargs
    model = arguments.pop("model", InklingModel)()  # a class in the table: built per case, not at collection
    with pytest.raises(ValueError, match=match):
        StepRunner(model, **arguments)


def test_generate_needs_a_token_runner():
    runner = StepRunner(InklingModel(), max_requests=1, max_model_len=8, max_tokens=4, device="cpu")
    with pytest.raises(ValueError, match='generate needs a runner built with inputs="tokens"'):
        runner.generate([[1]], 1)


def test_an_input_that_requires_grad_leaves_no_autograd_history():
    """The input buffer took an input's autograd history and kept every later step's upstream activations."""
    torch.manual_seed(0)
    runner = StepRunner(InklingModel(), max_requests=1, max_model_len=16, max_tokens=4, device="cpu")
    upstream = torch.randn(3, runner.model.config.hidden_size, requires_grad=True)
    runner.step([ScheduledRequest(0, 0, upstream.to(torch.bfloat16))])
    assert not runner.inputs.requires_grad and runner.inputs.grad_fn is None


def test_token_steps_and_generate_check_their_arguments_before_any_step():
    """Out-of-vocabulary ids were an IndexError from the embedding; max_new_tokens as a bool or a negative
    int was taken silently; a prompt that cannot fit max_model_len failed only after steps had run."""
    torch.manual_seed(0)
    runner = StepRunner(InklingModel(), max_requests=2, max_model_len=32, max_tokens=8, device="cpu", inputs="tokens")
    for call, error, match in (
        (lambda: runner.step([ScheduledRequest(0, 0, torch.tensor([1, 500]))]), ValueError,
         r"slot 0: token ids must be in \[0, 128\) \(the vocabulary\), got 1\.\.500"),
        (lambda: runner.step([ScheduledRequest(0, 0, torch.tensor([128]))]), ValueError, r"got 128\.\.128"),  # = vocab
        (lambda: runner.step([ScheduledRequest(0, 0, torch.tensor([-1]))]), ValueError, "token ids must be in"),
        # The bad request (a list) is named past one with no token, whose min/max was a RuntimeError.
        (lambda: runner.step([ScheduledRequest(0, 0, torch.zeros(0, dtype=torch.long)),
                              ScheduledRequest(1, 0, [3, 200])]), ValueError,
         r"^request slot 1: token ids must be in \[0, 128\) \(the vocabulary\), got 3\.\.200$"),
        (lambda: runner.step([ScheduledRequest(0, 0, torch.tensor([1.5]))]), ValueError, r"must be \[n\] integer"),
        (lambda: runner.generate([[1, 2]], True), TypeError, "max_new_tokens must be an int, got bool"),
        (lambda: runner.generate([[1, 2]], -3), ValueError, "max_new_tokens must be >= 0, got -3"),
        (lambda: runner.generate([[1, 2], [1] * 30], 5), ValueError,
         r"prompt 1 \(30 tokens\) with 5 new tokens needs 34 positions; the runner's max_model_len is 32"),
        # were truncated into token ids
        (lambda: runner.generate([[1.7, 2.2]], 2), TypeError, "prompt 0: token ids must be integers, got float"),
        (lambda: runner.generate([[1], [True]], 2), TypeError, "prompt 1: token ids must be integers, got bool"),
        (lambda: runner.generate([[1, True]], 2), TypeError, "prompt 0: token ids must be integers, got bool"),
        (lambda: runner.generate([torch.tensor([1.0])], 2), TypeError, "prompt 0: token ids must be integers, got float"),
        # each was torch's own error, naming no prompt ("too many dimensions 'str'", "Could not infer dtype")
        (lambda: runner.generate(["abc"], 2), TypeError, "prompt 0 must be a sequence of token ids, got str"),
        (lambda: runner.generate("ab", 2), TypeError, "prompts must be a sequence of prompts, got str"),
        (lambda: runner.generate([[1, None]], 2), TypeError, "prompt 0: token ids must be integers, got NoneType"),
        (lambda: runner.generate([[[1, 2]]], 2), TypeError, "prompt 0: token ids must be integers, got list"),
        (lambda: runner.generate([[1]], 2, draft=lambda i, seq: [0.5]), TypeError,
         r"draft\(0, tokens\) for prompt 0: token ids must be integers, got float"),
        (lambda: runner.generate([[1]], 2, draft=lambda i, seq: [[3, 4]]), TypeError,
         r"draft\(0, tokens\) for prompt 0: token ids must be integers, got list"),
        # was found inside the step, named as "request slot 0" after the prefill had run
        (lambda: runner.generate([[1]], 2, draft=lambda i, seq: [3, 500]), ValueError,
         r"^draft\(0, tokens\) for prompt 0: token ids must be in \[0, 128\) \(the vocabulary\), got 500$"),
        (lambda: runner.generate([[1], [2], [3]], 2), ValueError, "3 prompts; the runner has 2 request slots"),
        (lambda: runner.generate([[1], []], 2), ValueError, "every prompt needs at least one token"),
        # a stop id that can never be emitted would silently run every request to max_new_tokens
        (lambda: runner.generate([[1]], 2, stop_tokens=[3, 128]), ValueError,
         r"^stop_tokens: token ids must be in \[0, 128\) \(the ids the model can emit\), got 128$"),
        (lambda: runner.generate([[1]], 2, stop_tokens=-1), ValueError, r"\(the ids the model can emit\), got -1$"),
        (lambda: runner.generate([[1]], 2, stop_tokens=[2.0]), TypeError, "stop_tokens: token ids must be integers, got float"),
        (lambda: runner.generate([[1]], 2, stop_tokens=True), TypeError,
         "stop_tokens must be a token id or a sequence of them, got bool"),
        (lambda: runner.generate([[1]], 2, stop_tokens="2"), TypeError, "sequence of them, got str"),
        (lambda: runner.generate([[1]], 2, stop_tokens=torch.tensor([1.0])), TypeError, "integers, got float"),
        (lambda: runner.generate([[1]], 2, stop_tokens=[[5, 6]]), TypeError, "integers, got list"),
        (lambda: runner.generate([[1]], 2, stop_tokens=torch.tensor([[5]])), TypeError, "integers, got list"),
        # checked before any step: with max_new_tokens 0 no step would have seen it
        (lambda: runner.generate([[1], [999, -5]], 0), ValueError, r"^prompt 1: token ids must be in \[0, 128\) \(the vocabulary\), got 999$"),
        (lambda: runner.generate([[1]], 2, draft=lambda i, seq: None), TypeError,
         r"draft\(0, tokens\) for prompt 0 must be a sequence of token ids, got NoneType"),
    ):  # fmt: skip
        with pytest.raises(error, match=match):
            call()
    assert runner.steps == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_tokens=0), ValueError, "max_tokens must be >= 1, got 0"),
        (dict(max_requests=True), TypeError, "max_requests must be an int, got bool"),
        (dict(max_model_len=-5), ValueError, "max_model_len must be >= 1, got -5"),
        (dict(seed="a"), TypeError, "seed must be an int, got str"),
        (dict(seed=-1), ValueError, "seed must be >= 0, got -1"),
    ],
)
def test_the_runners_sizes_are_checked_by_name(kwargs, error, match):
    """Before: num_blocks errors (a name the caller never passed), torch internals, or silent acceptance."""
    args = dict(max_requests=2, max_model_len=32, max_tokens=8, device="cpu") | kwargs
    with pytest.raises(error, match=match):
        StepRunner(InklingModel(), **args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(token_budget=0), "token_budget must be >= 1, got 0"),  # run_workload looped for ever
        (dict(num_speculative_tokens=-2), "num_speculative_tokens must be >= 0"),
        (dict(prompt_lens=(1, 2)), "need one entry per request, at least one; got 2 and 5"),
        (dict(prompt_lens=(-2, 3, 1, 1, 1)), r"prompt_lens\[0\] must be >= 1, got -2"),
    ],
)
def test_a_workload_that_cannot_run_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Workload(**kwargs)


@pytest.mark.parametrize(
    "runner_kwargs, match",
    [
        # request 3 went to slot 3 after the others' steps had run
        (dict(max_requests=2), "the workload has 3 requests; the runner has 2 request slots"),
        (dict(max_model_len=7), r"needs 8 positions per request \(its longest request and 3 drafts\); the runner's max_model_len is 7"),
        (dict(inputs="tokens"), 'run_workload feeds hidden states: it needs a runner built with inputs="hidden"'),
    ],
    ids=["more-requests-than-slots", "longer-than-max_model_len", "token-runner"],
)
def test_run_workload_refuses_what_the_runner_cannot_hold_before_any_step(runner_kwargs, match):
    workload = Workload(prompt_lens=(3, 2, 4), decode_lens=(2, 2, 1), token_budget=4)
    model = InklingModel()
    runner = StepRunner(model, **(dict(max_requests=3, max_model_len=8, max_tokens=4, device="cpu") | runner_kwargs))
    with pytest.raises(ValueError, match=match):
        run_workload(runner, workload, model.config.hidden_size)
    assert runner.steps == 0


def test_run_workload_refuses_more_drafts_than_step5_rolls_back_before_any_step():
    """A verify step may reject all its drafts; a Step5 model's rings roll back max_rollback positions (3 at
    k = 3). The runner's own rollback check refused the step after four steps had written the caches."""
    model = Step5Model()
    runner = StepRunner(model, max_requests=2, max_model_len=64, max_tokens=8, device="cpu")
    workload = Workload(prompt_lens=(9, 5), decode_lens=(20, 20), token_budget=8, num_speculative_tokens=6)
    with pytest.raises(ValueError, match=r"rejects up to 6 drafts per verify step; the model's CSA rings roll back 3"):
        run_workload(runner, workload, model.config.hidden_size)
    assert runner.steps == 0


def test_unsigned_token_ids_are_checked_as_the_others():
    """uint16/32/64 ids failed in torch.aminmax ("not implemented for 'UInt64'"); now range-checked, and in
    range they give the int64 ids' logits."""
    torch.manual_seed(0)
    model = InklingModel()
    runners = [StepRunner(model, max_requests=1, max_model_len=16, max_tokens=4, device="cpu", inputs="tokens")]
    want = runners[0].step([ScheduledRequest(0, 0, torch.tensor([5, 9, 127]))])[0]
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        runner = StepRunner(model, max_requests=1, max_model_len=16, max_tokens=4, device="cpu", inputs="tokens")
        assert torch.equal(runner.step([ScheduledRequest(0, 0, torch.tensor([5, 9, 127], dtype=dtype))])[0], want)
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 128\) \(the vocabulary\), got 5\.\.128"):
            runner.step([ScheduledRequest(0, 0, torch.tensor([5, 128], dtype=dtype))])


def test_generate_with_no_new_tokens_feeds_nothing_whatever_the_prompts_length():
    """A 17-token prompt passed a max_model_len of 16 and a 100-token one was refused as needing 99 positions;
    with max_new_tokens 0 no step runs, so neither needs a position."""
    runner = StepRunner(InklingModel(), max_requests=2, max_model_len=16, max_tokens=4, device="cpu", inputs="tokens")
    assert runner.generate([[1] * 17, [2] * 100], 0) == [[], []]
    assert runner.steps == 0


@pytest.mark.parametrize("make_model", [InklingModel, Step5Model], ids=["inkling", "step5"])
def test_a_models_own_forward_names_bad_hidden_states(make_model):
    """Calling the model itself (as docs/models.md's compile example does): a wrong width or rank was a
    RuntimeError from inside a norm or matmul, and Step5 ran fp32 states without their bf16 rounding."""
    torch.manual_seed(0)
    model = make_model()
    runner = StepRunner(model, max_requests=1, max_model_len=16, max_tokens=8, device="cpu")
    runner.step([ScheduledRequest(0, 0, _x(runner, 3))])
    for hidden, error, match in (
        (torch.zeros(4, 64), TypeError, "hidden must be bfloat16 .*, got torch.float32"),
        (torch.zeros(4, 65, dtype=torch.bfloat16), ValueError, r"hidden must be \[T, hidden_size = 64\], got shape \(4, 65\)"),
        (torch.zeros(4, dtype=torch.bfloat16), ValueError, r"got shape \(4,\)"),
    ):
        with pytest.raises(error, match=match), torch.inference_mode():
            model(hidden, runner.buffers)


@pytest.mark.parametrize("make_model", [InklingModel, Step5Model], ids=["inkling", "step5"])
def test_a_runner_whose_caches_were_allocated_again_refuses_to_step(make_model):
    """A second StepRunner on one model binds new caches: the first runner's next step read them (zeros, or
    the second runner's rows; past them when the second is smaller) with no error. It refuses now, before
    writing anything; the newest runner steps as a fresh one."""
    torch.manual_seed(0)
    model = make_model()
    first = StepRunner(model, max_requests=2, max_model_len=32, max_tokens=16, device="cpu")
    x = _x(first, 12)
    first.step([ScheduledRequest(0, 0, x[:11])])
    second = StepRunner(model, max_requests=1, max_model_len=8, max_tokens=8, device="cpu")
    snapshot = StorageSnapshot([*model.cache_tensors(), *first.buffers, first.inputs])
    for call in (lambda: first.step([ScheduledRequest(0, 11, x[11:])]), first.warm_up):
        with pytest.raises(RuntimeError, match="the model's caches were allocated again after this StepRunner was built"):
            call()
    assert snapshot.changed_bytes() == 0
    fresh = StepRunner(make_model(), max_requests=1, max_model_len=8, max_tokens=8, device="cpu")
    fresh.model.load_state_dict(model.state_dict())
    assert torch.equal(second.step([ScheduledRequest(0, 0, x[:3])])[0], fresh.step([ScheduledRequest(0, 0, x[:3])])[0])


def test_a_step5_step_further_back_than_the_csa_rings_keep_is_refused():
    """A step of 8 tokens at 11 (7 drafts against k = 3) stored position 18 in ring row 8 (capacity 10 =
    7 + k); with 3 accepted, the next step at 15 closes region 1 and would replay position 8 from that row.
    Before: accepted, and later outputs differed from the step5_reference oracle. Stepping back
    ``max_rollback`` (3) and restarting at 0 are accepted; a shorter step in between leaves the bound at 19."""
    torch.manual_seed(0)
    model = Step5Model(Step5Config(layer_types=("csa",), moe_layers=()))
    runner = StepRunner(model, max_requests=1, max_model_len=32, max_tokens=16, device="cpu")
    assert model.max_rollback == 3
    runner.step([ScheduledRequest(0, 0, _x(runner, 11))])
    runner.step([ScheduledRequest(0, 11, _x(runner, 8))])
    snapshot = StorageSnapshot([*model.cache_tensors(), *runner.buffers, runner.inputs])
    with pytest.raises(ValueError, match=r"slot 0: start 15 steps back 4 positions from 19, .* CSA rings keep 3"):
        runner.step([ScheduledRequest(0, 15, _x(runner, 1))])
    assert snapshot.changed_bytes() == 0
    runner.step([ScheduledRequest(0, 16, _x(runner, 1))])
    # A shorter step does not undo what the long one stored: position 18 still sits in position 8's row.
    with pytest.raises(ValueError, match=r"slot 0: start 15 steps back 4 positions from 19, .* CSA rings keep 3"):
        runner.step([ScheduledRequest(0, 15, _x(runner, 1))])
    runner.step([ScheduledRequest(0, 0, _x(runner, 3))])
    runner.step([ScheduledRequest(0, 3, _x(runner, 2))])  # the restarted request goes on from what it fed


def test_warm_up_after_a_step_runs_padding_only_and_writes_nothing():
    """warm_up resets the step buffers before each size: it must not replay the last step's schedule (which
    needs more tokens than the smallest size, and would write its rows again)."""
    torch.manual_seed(0)
    model = InklingModel()
    runner = StepRunner(model, max_requests=2, max_model_len=32, max_tokens=8, device="cpu")
    runner.step([ScheduledRequest(0, 0, _x(runner, 5))])
    snapshot = StorageSnapshot(model.cache_tensors())
    runner.warm_up()
    assert snapshot.changed_bytes() == 0


def test_a_workloads_tokens_are_its_committed_and_rejected_positions():
    torch.manual_seed(0)
    model = InklingModel()
    workload = Workload(prompt_lens=(5, 4), decode_lens=(3, 2), num_speculative_tokens=3, token_budget=8)
    runner = StepRunner(model, max_requests=2, max_model_len=workload.max_len, max_tokens=8, device="cpu")
    result = run_workload(runner, workload, model.config.hidden_size)
    committed = sum(p + d for p, d in zip(workload.prompt_lens, workload.decode_lens))
    assert result.rejected_tokens > 0 and result.tokens == committed + result.rejected_tokens


def test_speculative_generation_fits_max_model_len_prompt_plus_new_minus_one():
    """The last new token is never fed, so ``len(prompt) + max_new_tokens - 1`` positions serve
    ``generate``: drafts near the end are cut to what still fits (one draft more had grown past
    max_model_len), and the tokens are those of plain greedy decoding."""
    torch.manual_seed(0)
    model = InklingModel()
    prompts, new = [[5, 9, 2, 7], [3, 1]], 12

    def generate(draft=None):
        runner = StepRunner(model, max_requests=2, max_model_len=4 + new - 1, max_tokens=16, device="cpu",
                            inputs=TOKENS)  # fmt: skip
        return runner.generate(prompts, new, draft=draft)

    greedy = generate()
    # The true continuation as drafts, 3 at a time: every draft is accepted up to the end.
    assert generate(lambda i, tokens: greedy[i][len(tokens) - len(prompts[i]) :][:3]) == greedy


def test_a_model_on_another_device_is_refused_naming_the_parameter():
    """Before: the runner allocated its buffers and caches, and the step failed inside the first GEMM."""
    model = InklingModel().to("meta")
    with pytest.raises(ValueError, match=r"the model's \S+ is on meta, the runner's device is cpu; move the model"):
        StepRunner(model, max_requests=2, max_model_len=32, max_tokens=8, device="cpu")


@pytest.mark.parametrize(
    "make_model, match",
    [
        (lambda: Step5Model(Step5Config(), dtype=torch.float32), r"built with dtype=torch.float32; a cached step runs"),
        (lambda: InklingModel().float(), r"embed_tokens.weight is torch.float32, built as torch.bfloat16"),
        (lambda: InklingModel().bfloat16(), r"layers.0.conv_kv is torch.bfloat16, built as torch.float32"),
    ],
    ids=["built-fp32", "float-after-construction", "fp32-conv-weights-cast-to-bf16"],
)
def test_a_model_in_another_dtype_is_refused(make_model, match):
    """Before: a float32 model failed inside its first GEMM or sconv's dtype check; one cast to bf16 after
    construction ran, with its fp32 conv weights rounded, and drifted from the oracle with no error."""
    with pytest.raises(ValueError, match=match):
        StepRunner(make_model(), max_requests=1, max_model_len=16, max_tokens=4, device="cpu")


def test_a_cpu_model_with_a_cuda_runner_is_refused():
    """Before, on a CPU build: torch's ``AssertionError: Torch not compiled with CUDA enabled`` from inside the
    allocator; with a GPU, a device mismatch inside the first GEMM."""
    with pytest.raises(ValueError, match=r"is on cpu, the runner's device is cuda; move the model first"):
        StepRunner(InklingModel(), max_requests=2, max_model_len=32, max_tokens=8, device="cuda")


def test_a_step_copies_its_schedule_in_one_non_blocking_copy_and_its_inputs_in_another(runner):
    """On a GPU a blocking host -> device copy waits for every kernel queued before it: seven of them made
    each step wait for the previous one's kernels. Recorded on CPU: the copies and their ``non_blocking``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = []
    device_storages = {runner._schedule.untyped_storage().data_ptr(), runner.inputs.untyped_storage().data_ptr()}

    class RecordCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() in device_storages:
                copies.append((tuple(args[0].shape), kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
            return func(*args, **kwargs)

    batch = [ScheduledRequest(0, 0, _x(runner, 3)), ScheduledRequest(1, 5, _x(runner, 1))]
    with RecordCopies():
        runner._fill_buffers(batch)
    assert copies == [(tuple(runner._schedule.shape), True), ((4, runner.model.config.hidden_size), True)]
    assert runner.buffers.query_start_loc[:3].tolist() == [0, 3, 4]
    assert runner.buffers.seq_lens[:2].tolist() == [3, 6]


def test_assume_fed_lets_a_step_start_deep_in_a_context_and_checks_its_slot():
    """The benchmarks time steps at long contexts without their prefill (``assume_fed``). Its own runner: the
    module's would have slot 0 fed for the tests after it (in another test order)."""
    runner = _runner_with_slot_1_fed()
    with pytest.raises(ValueError, match="assume_fed: slot 2 is outside the runner's slots 0..1"):
        runner.assume_fed(2, 10)
    with pytest.raises(ValueError, match="assume_fed: length must be >= 0"):
        runner.assume_fed(0, -1)
    runner.assume_fed(0, 20)
    (out,) = runner.step([ScheduledRequest(0, 20, _x(runner, 2))])
    assert out.shape == (2, runner.model.config.hidden_size)


def test_a_default_device_set_by_the_caller_leaves_the_host_side_on_the_host():
    """Under ``with torch.device(...)`` the runner's block tables and schedules, a workload's inputs and a
    random Step5 checkpoint stay host tensors (on a GPU their host generator was refused for the default
    device): the same run and the same checkpoint as without it. Here the default is ``meta``, which
    would also leave a host tensor made there without data."""
    workload = Workload(prompt_lens=(5, 3), decode_lens=(3, 4), num_speculative_tokens=2, token_budget=8)

    def run(default_device):
        torch.manual_seed(0)
        model = InklingModel(InklingConfig(num_speculative_tokens=2))
        with torch.device(default_device):
            runner = StepRunner(model, max_requests=2, max_model_len=workload.max_len, max_tokens=8, device="cpu")
            outputs = run_workload(runner, workload, model.config.hidden_size).outputs
            return outputs, random_step5_checkpoint(Step5Config(), seed=0)

    want, checkpoint = run("cpu")
    got, meta_default_checkpoint = run("meta")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert meta_default_checkpoint.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(meta_default_checkpoint[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_generate_under_a_default_device_feeds_host_ids_that_are_checked():
    """``generate`` made each step's ids on the caller's default device: under ``meta`` a step refused them
    (no data), under ``cuda`` they skipped the vocabulary check (which reads only host ids), so an
    out-of-vocabulary prompt reached the embedding. Now they are host tensors: the same tokens, the same
    check, under any default device."""
    torch.manual_seed(0)
    model = InklingModel(InklingConfig(num_speculative_tokens=2))
    runner = StepRunner(model, max_requests=2, max_model_len=16, max_tokens=8, device="cpu", inputs="tokens")
    want = runner.generate([[1, 2, 3], [4, 5]], 3, draft=lambda i, seq: [seq[-1], 7])
    runner = StepRunner(model, max_requests=2, max_model_len=16, max_tokens=8, device="cpu", inputs="tokens")
    with torch.device("meta"):
        assert runner.generate([[1, 2, 3], [4, 5]], 3, draft=lambda i, seq: [seq[-1], 7]) == want
        with pytest.raises(ValueError, match=r"^prompt 1: token ids must be in \[0, 128\) \(the vocabulary\), got 300$"):
            runner.generate([[1], [2, 300]], 1)
