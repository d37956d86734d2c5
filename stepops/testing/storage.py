"""Byte-level checks of what an op wrote: every byte of the storages behind its arguments, before and after.

Caches in samples and error inputs are views into larger buffers (``stepops._library.guarded``, page
strides), so "nothing outside the given tensors changed" is a statement about real, allocated bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def copy_as_views(values: Iterable[object], device: torch.device | str | None = None) -> list[object]:
    """``values`` with each tensor replaced by the same view (shape, strides, offset) of a copy of its whole
    storage, on ``device`` (default: where it is); each storage is copied once, so views of one buffer stay
    views of one buffer, and a tensor passed twice stays one tensor. Non-tensors are returned as they are.

    ``Tensor.to`` and ``clone`` make new, exactly sized tensors: the bytes around a guarded or page-strided
    view and its gaps are lost, and two views of one buffer become two buffers. A test that runs a kernel
    on a copy made here checks the same layouts, and the same bytes around them, on a GPU as on CPU.
    """
    values = list(values)  # alive while copying: a freed temporary's id and address would be reused
    storages: dict[tuple[int, torch.device], torch.Tensor] = {}
    views: dict[int, torch.Tensor] = {}
    copied: list[object] = []
    for value in values:
        if isinstance(value, torch.Tensor) and id(value) not in views:
            target = value.device if device is None else torch.device(device)
            key = (value.untyped_storage().data_ptr(), value.device)
            if key not in storages:
                storages[key] = storage_bytes(value).to(target, copy=True)
            view = torch.empty(0, dtype=value.dtype, device=target)
            storage = storages[key].untyped_storage()
            views[id(value)] = view.set_(storage, value.storage_offset(), value.shape, value.stride())
        copied.append(views[id(value)] if isinstance(value, torch.Tensor) else value)
    return copied


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of every byte of ``tensor``'s storage."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _view_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Bool mask over the storage's bytes: True where ``tensor`` (a view of any strides) has an element."""
    storage = storage_bytes(tensor)
    covered = torch.zeros(storage.numel(), dtype=torch.bool, device=tensor.device)
    if tensor.numel() == 0:
        return covered
    size = tensor.element_size()
    first = torch.arange(storage.numel() // size, device=tensor.device)
    first = first.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset()).reshape(-1) * size
    for byte in range(size):
        covered[first + byte] = True
    return covered


class StorageSnapshot:
    """Copies of every byte behind ``tensors`` (one per storage), taken at construction."""

    def __init__(self, tensors: Iterable[object]) -> None:
        self._tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        self._before: dict[int, torch.Tensor] = {}
        for t in self._tensors:
            self._before.setdefault(t.untyped_storage().data_ptr(), storage_bytes(t).clone())

    def changed_bytes(self) -> int:
        """How many bytes of all the storages differ from the snapshot."""
        return sum(
            int((storage_bytes(self._first(ptr)) != before).sum()) for ptr, before in self._before.items()
        )

    def changed_outside_views(self) -> int:
        """How many changed bytes no argument tensor covers (writes outside the tensors the op was given)."""
        total = 0
        for ptr, before in self._before.items():
            inside = torch.zeros_like(before, dtype=torch.bool)
            for t in self._tensors:
                if t.untyped_storage().data_ptr() == ptr:
                    inside |= _view_bytes(t)
            total += int(((storage_bytes(self._first(ptr)) != before) & ~inside).sum())
        return total

    def _first(self, ptr: int) -> torch.Tensor:
        return next(t for t in self._tensors if t.untyped_storage().data_ptr() == ptr)
