"""The dtypes a model was built with: the models record them, and :class:`~stepops.models.runner.StepRunner`
checks them before it runs a model. And what a step's hidden states must be (:func:`check_step_hidden`).

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


def check_step_hidden(hidden: object, hidden_size: int) -> None:
    """``TypeError``/``ValueError`` unless ``hidden`` is a bf16 ``[T, hidden_size]`` tensor, what a cached
    step's ``forward`` takes (a wrong width or rank failed deep inside a matmul or a norm, and fp32 states
    ran Step5 unrounded). Under ``torch.compile`` it runs once per trace: the graph guards on these."""
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a tensor, got {type(hidden).__name__}")
    if hidden.dtype != torch.bfloat16:
        raise TypeError(f"hidden must be bfloat16 (a cached step's states), got {hidden.dtype}")
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden must be [T, hidden_size = {hidden_size}], got shape {tuple(hidden.shape)}")
