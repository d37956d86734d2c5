"""The tensors an op writes must own their elements and be distinct (``stepops._meta.written``): the rule
against brute force, and every op's check against a written tensor that an earlier call's signature
matches in all but its strides."""

import itertools
import re
import sys

import pytest
import torch

from stepops._library import registered_ops, written_arguments
from stepops._meta.accepted import AcceptedSignatures
from stepops._meta.written import check_own_elements

_ENTRIES = registered_ops()


def _shares_an_element(shape, strides) -> bool:
    offsets = [sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, shape))]
    return len(set(offsets)) < len(offsets)


def test_the_rule_never_accepts_a_layout_whose_positions_share_an_element():
    """Every 2-D and 3-D layout with sizes 1-3 and strides 0-6, against a count of its element offsets: an
    accepted layout never shares an element, and the refused ones that do not are interleavings only."""
    refused_without_sharing = []
    for dims in (2, 3):
        for shape in itertools.product(range(1, 4), repeat=dims):
            for strides in itertools.product(range(7), repeat=dims):
                shares = _shares_an_element(shape, strides)
                try:
                    check_own_elements("op", "cache", torch.empty(64).as_strided(shape, strides))
                except ValueError:
                    if not shares:
                        refused_without_sharing.append((shape, strides))
                else:
                    assert not shares, (shape, strides)
    # Refused without sharing: two dimensions interleave (e.g. sizes (2, 3), strides (3, 2): offsets 0 2 4 3 5
    # 7), a layout no view op makes. None of them is nested: a stride ordering where each steps past the rest.
    for shape, strides in refused_without_sharing:
        big = sorted((s, n) for n, s in zip(shape, strides) if n > 1)
        assert any(s <= sum((n - 1) * t for t, n in big[:i]) for i, (s, _) in enumerate(big)), (shape, strides)
    assert refused_without_sharing, "the brute force must reach interleavings"


@pytest.mark.parametrize(
    "view",
    [
        lambda kv: kv[:, 0],  # K of a [num_blocks, 2, N, H, D] cache
        lambda kv: kv[:, 1, :, :, 2:6],  # V, a column range of each head
        lambda kv: kv.transpose(2, 3)[:, 0],
        lambda kv: kv[::2, 1],
        lambda kv: kv[:1, 0].expand(1, 4, 2, 8),  # stride 0 on a size-1 dimension shares nothing
    ],
)
def test_views_that_slicing_and_permuting_make_own_their_elements(view):
    check_own_elements("op", "cache", view(torch.zeros(3, 2, 4, 2, 8)))


@pytest.mark.parametrize(
    "view, strides",
    [
        (lambda buf: buf[:1].expand(3, 8), "(0, 1)"),
        (lambda buf: buf.flatten().unfold(0, 8, 4), "(4, 1)"),  # rows that overlap by half
        (lambda buf: buf.as_strided((3, 4), (1, 1)), "(1, 1)"),  # a sliding window of rows
    ],
)
def test_views_whose_positions_share_an_element_are_refused(view, strides):
    with pytest.raises(ValueError, match=rf"op: cache \(shape .*, strides {re.escape(strides)}\) lets several of its positions"):
        check_own_elements("op", "cache", view(torch.zeros(4, 8)))


@pytest.mark.parametrize("entry", _ENTRIES, ids=[e.name for e in _ENTRIES])
def test_a_remembered_signature_with_a_written_tensor_expanded_runs_the_checks(entry, monkeypatch):
    """Each sample is accepted (and remembered); then the same call with one written tensor expand()ed over
    a dimension to its own sizes, so that only its strides differ, must raise: a memo that ignored the
    written tensors' strides would let it through unchecked."""
    monkeypatch.setattr(sys.modules[entry.fake.__module__], "_ACCEPTED", AcceptedSignatures())
    checked = 0
    for sample in entry.samples(torch.device("cpu")):
        for _ in range(2):  # the second call matches the remembered signature
            entry.fake(*sample.args, **sample.kwargs)
        for position in written_arguments(entry.overload):
            written = sample.args[position] if position < len(sample.args) else None
            if written is None or written.numel() == 0 or max(written.shape) < 2:
                continue  # errors: one element, nothing to share
            dim = next(d for d, n in enumerate(written.shape) if n > 1)
            args = list(sample.args)
            args[position] = written.narrow(dim, 0, 1).expand_as(written)
            with pytest.raises(ValueError, match=f"^{entry.name}: .* lets several of its positions share"):
                entry.fake(*args, **sample.kwargs)
            checked += 1
    assert checked, "no sample had a written tensor to expand"
