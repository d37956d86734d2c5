"""The argument checks remember the signatures they accepted (``stepops._meta.accepted``), so that a repeated
eager call skips their Python. A remembered signature must never let a bad call through, must not reach a
Dynamo trace, and without Dynamo's C++ guards (a torch that drops them) every call runs the checks.
"""

import gc
import weakref

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from stepops._library import registered_ops
from stepops._meta import accepted
from stepops._meta.accepted import AcceptedSignatures
from stepops.testing import op_error_inputs

_ENTRIES = registered_ops()
_SHAPE_ERRORS = [case for case in op_error_inputs() if not case.error.data]


def _signature():
    return (torch.zeros(3, 4), torch.zeros(5, dtype=torch.int32)), 7


def test_a_remembered_signature_matches_equal_metadata_only():
    memo = AcceptedSignatures()
    (x, ids), scalar = _signature()
    assert memo.match((x, ids), scalar) is None
    memo.remember((x, ids), scalar, result="sizes")
    assert memo.match((x, ids), scalar).result == "sizes"
    assert memo.match((torch.ones(4, 3).t(), ids.clone()), scalar) is not None, "other tensors, other strides"
    for other in (
        ((x.double(), ids), scalar),
        ((torch.zeros(3, 5), ids), scalar),
        ((x.to("meta"), ids), scalar),
        ((x.clone().requires_grad_(), ids), scalar),
        ((x, ids), scalar + 1),
        ((x, ids), None),
        ((x, x), scalar),  # one tensor twice: the guards need distinct tensors
    ):
        assert memo.match(*other) is None, other
    with torch.inference_mode():  # another dispatch key set
        assert memo.match((x, ids), scalar) is None


def test_a_bool_never_passes_for_an_int():
    memo = AcceptedSignatures()
    tensors, _ = _signature()
    memo.remember(tensors, 1)
    assert memo.match(tensors, 1) is not None
    assert memo.match(tensors, True) is None
    memo.remember(tensors, True)
    assert memo.match(tensors, True) is None


def test_the_most_recent_match_comes_first_and_the_oldest_goes():
    memo = AcceptedSignatures()
    signatures = [((torch.zeros(n),), None) for n in range(1, AcceptedSignatures.SIZE + 2)]
    for tensors, scalar in signatures:
        memo.remember(tensors, scalar, result=tensors[0].numel())
    assert memo.match(*signatures[0]) is None, "the oldest one went"
    assert [memo.match(*s).result for s in signatures[1:]] == list(range(2, AcceptedSignatures.SIZE + 2))


def test_a_call_that_passes_a_tensor_twice_is_not_remembered():
    memo = AcceptedSignatures()
    tensors, scalar = _signature()
    memo.remember(tensors, scalar)
    memo.remember((tensors[0], tensors[0]), scalar)
    assert memo.match(tensors, scalar) is not None, "the earlier signature stays in front"
    assert memo.match((tensors[0], tensors[0]), scalar) is None


def test_fake_tensors_are_not_remembered_and_tensors_not_kept_alive():
    memo = AcceptedSignatures()
    with torch._subclasses.FakeTensorMode():
        fake = (torch.zeros(3),)
    memo.remember(fake)
    assert memo.match(fake) is None
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
    assert memo.match(tensors, scalar) is None


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
    found = []
    match = AcceptedSignatures.match
    monkeypatch.setattr(AcceptedSignatures, "match", lambda self, *args: found.append(match(self, *args)) or found[-1])
    sample = next(iter(entry.samples(torch.device("cpu"))))
    for _ in range(2):
        entry.fake(*sample.args, **sample.kwargs)
    assert len(found) == 2 and found[-1] is not None


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
