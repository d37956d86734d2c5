"""``torch.library.opcheck`` with all four utils over every sample of every op (float8 ones included),
without and with the optional ``errors`` counter, a written argument of its own."""

import pytest

from stepops.testing import op_samples, run_opcheck

_SAMPLES = list(op_samples(with_error_counters=True))


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_opcheck(sample):
    run_opcheck(sample)
