"""The argument checks remember the signatures they accepted (``stepops._meta.accepted``), so that a repeated
eager call skips their Python. A remembered signature must never let a bad call through, must not reach a
Dynamo trace, and without Dynamo's C++ guards (a torch that drops them) every call runs the checks.
"""

import gc
import sys
import weakref

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.compiler import is_dynamo_compiling

from stepops._library import registered_ops
from stepops._meta import accepted
from stepops._meta.accepted import AcceptedSignatures
from stepops.testing import op_error_inputs

_ENTRIES = registered_ops()
_SHAPE_ERRORS = [case for case in op_error_inputs() if not case.error.data]


def _signature():
    return (torch.zeros(3, 4), torch.zeros(5, dtype=torch.int32)), 7


def _lookup(memo: AcceptedSignatures, tensors: tuple, scalar: int | None = None):
    """The lookup each check in ``stepops._meta`` opens with, written out as ``AcceptedSignatures``'
    docstring gives it (over a tuple here): the remembered signature the call matches, or None."""
    if type(scalar) in (int, type(None)) and not is_dynamo_compiling():
        for accepted in memo.entries:
            if accepted.scalar == scalar and accepted.guards.check(*tensors):
                if accepted is not memo.entries[0]:
                    memo.promote(accepted)
                return accepted
    return None


def test_a_remembered_signature_matches_equal_metadata_only():
    memo = AcceptedSignatures()
    (x, ids), scalar = _signature()
    assert _lookup(memo, (x, ids), scalar) is None
    memo.remember((x, ids), scalar, result="sizes")
    assert _lookup(memo, (x, ids), scalar).result == "sizes"
    assert _lookup(memo, (torch.ones(4, 3).t(), ids.clone()), scalar) is not None, "other tensors, other strides"
    for other in (
        ((x.double(), ids), scalar),
        ((torch.zeros(3, 5), ids), scalar),
        ((x.to("meta"), ids), scalar),
        ((x.clone().requires_grad_(), ids), scalar),
        ((x, ids), scalar + 1),
        ((x, ids), None),
        ((x, x), scalar),  # one tensor twice: the guards need distinct tensors
    ):
        assert _lookup(memo, *other) is None, other
    with torch.inference_mode():  # another dispatch key set
        assert _lookup(memo, (x, ids), scalar) is None


def test_a_bool_is_never_remembered_as_an_int():
    memo = AcceptedSignatures()
    tensors, _ = _signature()
    memo.remember(tensors, True)
    assert memo.entries == ()


@pytest.mark.parametrize("entry", [e for e in _ENTRIES if e.name != "paged_kv_write"], ids=lambda e: e.name)
def test_a_bool_never_passes_an_ops_check_for_its_int(entry):
    """csa_ring_update's capacity and sconv's stream_offset: after the int was accepted, the same call with
    the bool that equals it (True == 1) still fails the checks."""
    sample = next(iter(entry.samples(torch.device("cpu"))))
    position = next(i for i, a in enumerate(sample.args) if type(a) is int)
    args = list(sample.args)
    args[position] = 1
    try:
        entry.fake(*args, **sample.kwargs)
        entry.fake(*args, **sample.kwargs)  # remembered, if the checks accept 1 here
    except ValueError:
        pass  # 1 is out of range for this sample: the bool must still fail as a bool
    args[position] = True
    with pytest.raises(TypeError, match="must be an int"):
        entry.fake(*args, **sample.kwargs)


@pytest.mark.parametrize("entry", [e for e in _ENTRIES if e.name != "paged_kv_write"], ids=lambda e: e.name)
def test_a_remembered_signature_with_another_int_runs_the_checks(entry):
    """The int is part of the signature: after every sample was accepted (and remembered), the same tensors
    with an int the checks refuse (-1: a negative stream offset, a capacity below 7) still raise. The
    error inputs cannot show it (their tensors match no sample's sizes), nor ``_lookup`` above (the test's
    own copy of the lookup): a check whose lookup ignored the int passed every other test here."""
    samples = list(entry.samples(torch.device("cpu")))
    for sample in samples:
        for _ in range(2):  # the second call matches the remembered signature
            entry.fake(*sample.args, **sample.kwargs)
    for sample in samples:
        position = next(i for i, a in enumerate(sample.args) if type(a) is int)
        args = list(sample.args)
        args[position] = -1
        with pytest.raises(ValueError, match=f"^{entry.name}: "):
            entry.fake(*args, **sample.kwargs)


def test_the_most_recent_match_comes_first_and_the_oldest_goes():
    memo = AcceptedSignatures()
    signatures = [((torch.zeros(n),), None) for n in range(1, AcceptedSignatures.SIZE + 2)]
    for tensors, scalar in signatures:
        memo.remember(tensors, scalar, result=tensors[0].numel())
    assert _lookup(memo, *signatures[0]) is None, "the oldest one went"
    assert [_lookup(memo, *s).result for s in signatures[1:]] == list(range(2, AcceptedSignatures.SIZE + 2))
    assert [a.result for a in memo.entries] == list(range(AcceptedSignatures.SIZE + 1, 1, -1)), "matched to the front"


def test_a_call_that_passes_a_tensor_twice_is_not_remembered():
    memo = AcceptedSignatures()
    tensors, scalar = _signature()
    memo.remember(tensors, scalar)
    memo.remember((tensors[0], tensors[0]), scalar)
    assert len(memo.entries) == 1
    assert _lookup(memo, tensors, scalar) is not None
    assert _lookup(memo, (tensors[0], tensors[0]), scalar) is None


def test_fake_tensors_are_not_remembered_and_tensors_not_kept_alive():
    memo = AcceptedSignatures()
    with torch._subclasses.FakeTensorMode():
        fake = (torch.zeros(3),)
    memo.remember(fake)
    assert memo.entries == ()
    tensor = torch.zeros(3)
    alive = weakref.ref(tensor)
    memo.remember((tensor,))
    del tensor
    gc.collect()
    assert alive() is None


def test_without_the_guards_every_call_runs_the_checks(monkeypatch):
    monkeypatch.setattr(accepted, "TensorGuards", None)
    memo = AcceptedSignatures()
    tensors, scalar = _signature()
    memo.remember(tensors, scalar)
    assert memo.entries == () and _lookup(memo, tensors, scalar) is None


@pytest.mark.parametrize("case", _SHAPE_ERRORS, ids=[c.name for c in _SHAPE_ERRORS])
def test_a_bad_call_after_accepted_ones_raises_its_error(case):
    for sample in case.entry.samples(torch.device("cpu")):
        for _ in range(2):  # the second call matches the remembered signature
            case.entry.fake(*sample.args, **sample.kwargs)
    sample = case.error.sample
    with pytest.raises(case.error.error_type, match=case.error.error_regex):
        case.entry.fake(*sample.args, **sample.kwargs)


@pytest.mark.parametrize("entry", _ENTRIES, ids=[e.name for e in _ENTRIES])
def test_every_op_checks_a_repeated_call_against_its_remembered_signatures(entry, monkeypatch):
    """A call runs the checks and remembers its signature (unless an earlier sample's matches it); the
    repeated call matches and runs neither. With every sample, so that a lookup that never matches, or one
    that lets calls through without checking them, fails."""
    # A new memo: earlier tests remembered these samples' signatures in the op's own.
    monkeypatch.setattr(sys.modules[entry.fake.__module__], "_ACCEPTED", AcceptedSignatures())
    remembered = []
    remember = AcceptedSignatures.remember
    monkeypatch.setattr(
        AcceptedSignatures, "remember", lambda self, *args, **kwargs: remembered.append(1) or remember(self, *args, **kwargs)
    )
    for sample in entry.samples(torch.device("cpu")):
        entry.fake(*sample.args, **sample.kwargs)
        after_first = len(remembered)
        entry.fake(*sample.args, **sample.kwargs)
        assert len(remembered) == after_first, sample.name
    assert remembered, "no signature was remembered"


@pytest.mark.parametrize("entry", _ENTRIES, ids=[e.name for e in _ENTRIES])
@pytest.mark.parametrize("errors", [torch.empty(0), torch.empty(0, dtype=torch.int32)], ids=["float32_0", "int32_0"])
def test_a_bad_counter_never_matches_a_call_accepted_without_one(entry, errors):
    """A call without ``errors`` is remembered with a stand-in tensor in the counter's place; a call whose
    counter looks like the stand-in (an empty tensor) must still run the checks. Before: an empty float32
    counter matched it, skipped the checks, and the Triton kernel counted bad ids into an empty tensor's
    address (a crash under the interpreter, an illegal access on a GPU)."""
    for sample in entry.samples(torch.device("cpu")):
        if "errors" in sample.kwargs or len(sample.args) == len(entry.overload._schema.arguments):
            continue  # the sample passes a counter
        for _ in range(2):  # the second call matches the remembered signature
            entry.fake(*sample.args, **sample.kwargs)
        with pytest.raises((TypeError, ValueError), match=f"^{entry.name}: errors must be an int32"):
            entry.fake(*sample.args, **sample.kwargs, errors=errors)


@pytest.mark.parametrize("entry", _ENTRIES, ids=[e.name for e in _ENTRIES])
def test_a_remembered_signature_gives_the_checks_result(entry):
    for sample in entry.samples(torch.device("cpu")):
        fresh = entry.fake(*sample.args, **sample.kwargs)
        remembered = entry.fake(*sample.args, **sample.kwargs)
        assert (fresh is None and remembered is None) or (
            fresh.shape == remembered.shape and fresh.dtype == remembered.dtype
        )


@pytest.mark.parametrize("entry", _ENTRIES, ids=[e.name for e in _ENTRIES])
def test_dynamo_traces_the_checks_whole_and_ignores_the_memo(entry):
    """Dynamo traces through the checks when it compiles a kernel: no graph break, and no recompilation when
    the remembered signatures change between calls."""
    first, *others = entry.samples(torch.device("cpu"))
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a, **k: (entry.fake(*a, **k), a[0] + 1), backend=counter, fullgraph=True)
    compiled(*first.args, **first.kwargs)
    entry.fake(*first.args, **first.kwargs)  # remembered, eagerly
    for sample in others[:2]:
        entry.fake(*sample.args, **sample.kwargs)  # the memo changes
    compiled(*first.args, **first.kwargs)
    assert counter.frame_count == 1


def test_promoting_a_signature_another_thread_let_go_is_a_no_op():
    """A call matches a signature; before it promotes it, another thread's ``remember`` lets it go (the
    memo holds SIZE). ``tuple.index`` raised a ValueError into that op call."""
    memo = AcceptedSignatures()
    tensors, _ = _signature()
    memo.remember(tensors, 0)
    matched = memo.entries[0]
    for scalar in range(1, AcceptedSignatures.SIZE + 1):
        memo.remember(tensors, scalar)
    assert all(entry is not matched for entry in memo.entries)
    before = memo.entries
    memo.promote(matched)
    assert memo.entries == before
    memo.promote(before[-1])
    assert memo.entries[0] is before[-1] and len(memo.entries) == AcceptedSignatures.SIZE
