"""The dtypes a model was built with: the models record them, and :class:`~stepops.models.runner.StepRunner`
checks them before it runs a model.

Each model keeps some parameters in fp32 whatever its ``dtype`` (norm weights, Inkling's conv weights and
router bias, the Step5 indexer's weights), so ``model.to(torch.bfloat16)`` or ``model.float()`` after
construction silently changes what it computes, or fails deep inside a kernel.
"""

from __future__ import annotations

import torch


def tensor_dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    """The dtype of each parameter and buffer of ``module``, by name."""
    return {name: t.dtype for name, t in (*module.named_parameters(), *module.named_buffers())}


def check_built_dtypes(model: torch.nn.Module) -> None:
    """``ValueError`` unless ``model`` was built with ``dtype=torch.bfloat16`` (the caches and the ops' inputs
    are bf16; other dtypes serve the no-cache recompute) and every parameter and buffer still has the dtype it
    was built with."""
    if model.dtype != torch.bfloat16:
        raise ValueError(
            f"the model was built with dtype={model.dtype}; a cached step runs a model built with "
            "dtype=torch.bfloat16 (its caches are bf16), other dtypes serve the no-cache recompute"
        )
    for name, dtype in tensor_dtypes(model).items():
        built = model.built_dtypes.get(name, dtype)  # a tensor added after construction: nothing to compare
        if dtype != built:
            raise ValueError(
                f"the model's {name} is {dtype}, built as {built}: a model.to(dtype), .float() or .bfloat16() "
                "after construction changes the tensors the model keeps in another dtype (and its outputs); "
                "build it with the dtype instead"
            )
