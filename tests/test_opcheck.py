"""``torch.library.opcheck`` with all four utils over every sample of every op."""

import pytest
import torch

from stepops.testing import OPCHECK_UTILS, op_samples

_SAMPLES = list(op_samples())


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_opcheck(sample):
    op, args, kwargs = sample
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)
