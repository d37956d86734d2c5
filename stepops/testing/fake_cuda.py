"""Fake CUDA tensors on a CPU-only wheel: what tests need to run the models' CUDA path under FakeTensorMode."""

from __future__ import annotations

import torch


def getitem_through_the_dispatcher(self, index):
    """``Tensor.__getitem__`` as aten ops (select, slice, unsqueeze, index), for fake CUDA tensors.

    On a CPU-only wheel, Python indexing of a CUDA tensor (even a fake one) fails before dispatch: the
    binding takes a CUDA device guard, which the wheel lacks ("PyTorch is not linked with support for cuda
    devices"). The same indexing lowered to aten ops goes through the dispatcher, where FakeTensorMode
    handles it. Basic and advanced integer indexing only, which is all the traced code uses.

    Install it on ``FakeTensor``, not on ``torch.Tensor``: once a class has had a Python ``__getitem__``,
    CPython leaves it a sequence type even after the attribute is deleted, so an undone patch of
    ``torch.Tensor`` made every later ``torch.as_tensor([tensor(0-d), ...])`` of the process fail.
    """
    index = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    out, dim, tensors = self, 0, {}
    for item in index:
        if item is Ellipsis:
            dim += self.dim() - consumed
        elif item is None:
            out = out.unsqueeze(dim)
            dim += 1
        elif isinstance(item, (int, torch.SymInt)):
            out = out.select(dim, item)
        elif isinstance(item, slice):
            out = torch.ops.aten.slice.Tensor(out, dim, item.start, item.stop, item.step or 1)
            dim += 1
        elif isinstance(item, torch.Tensor) and item.dtype != torch.bool:
            tensors[dim] = item
            dim += 1
        else:
            raise TypeError(f"unsupported index {item!r}")
    if tensors:
        out = torch.ops.aten.index.Tensor(out, [tensors.get(d) for d in range(max(tensors) + 1)])
    return out
