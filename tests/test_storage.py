"""``stepops.testing.copy_as_views``: the copy that the kernel tests run the Triton kernel on, on a GPU too.

``Tensor.to(device)`` had been used there: on a GPU it made exactly sized tensors, so the guard bytes the
tests check and the page-strided layouts the samples build were not on the GPU at all.
"""

import pytest
import torch

from stepops._library import guarded
from stepops.testing import copy_as_views


# Another device than the views': the path a GPU test takes (meta everywhere, the GPU where there is one).
_OTHER_DEVICES = ["meta", *(["cuda"] if torch.cuda.is_available() else [])]


def test_a_guarded_view_has_pad_elements_on_both_sides():
    """The guard bytes the write checks compare: ``pad`` elements before the view's first element and after
    its last (a view at offset 0 would let a write just before it go unseen)."""
    source = torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2]
    for pad in (1, 64):
        view = guarded(source, pad=pad)
        extent = 1 + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
        assert torch.equal(view, source) and view.stride() == source.stride()
        assert (view.storage_offset(), view.untyped_storage().nbytes()) == (pad, (extent + 2 * pad) * 4)


@pytest.mark.parametrize("device", _OTHER_DEVICES)
def test_a_guarded_view_keeps_its_layout_and_the_bytes_around_it(device):
    view = guarded(torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2])
    (copy,) = copy_as_views([view], device)
    assert copy.device.type == device
    assert (copy.shape, copy.stride(), copy.storage_offset()) == (view.shape, view.stride(), view.storage_offset())
    assert copy.untyped_storage().nbytes() == view.untyped_storage().nbytes()
    if device != "meta":
        assert bytes(copy.untyped_storage().cpu()) == bytes(view.untyped_storage())


def test_the_copy_has_every_byte_of_the_storage_in_memory_of_its_own():
    view = guarded(torch.randn(3, 5).to(torch.bfloat16)[1:, 1:4])
    (copy,) = copy_as_views([view])
    assert copy.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    assert bytes(copy.untyped_storage()) == bytes(view.untyped_storage())
    copy.zero_()
    assert torch.count_nonzero(view) > 0


def test_views_of_one_buffer_stay_views_of_one_copy_and_one_tensor_stays_one_tensor():
    kv = torch.randn(4, 2, 3, 8)
    key_cache, value_cache, other = kv[:, 0], kv[:, 1], torch.randn(2)
    copied = copy_as_views([key_cache, value_cache, key_cache, other, 7])
    assert copied[0].untyped_storage().data_ptr() == copied[1].untyped_storage().data_ptr()
    assert copied[0] is copied[2]
    assert copied[3].untyped_storage().data_ptr() != copied[0].untyped_storage().data_ptr()
    assert copied[4] == 7
    assert torch.equal(copied[1], value_cache) and copied[1].stride() == value_cache.stride()
