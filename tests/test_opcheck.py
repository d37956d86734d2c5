"""``torch.library.opcheck`` with all four utils over every sample of every op (float8 ones included)."""

import pytest

from stepops.testing import op_samples, run_opcheck

_SAMPLES = list(op_samples())


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_opcheck(sample):
    run_opcheck(sample)
