"""Shared by both models' MoE blocks: which step sizes run only the chosen experts."""

from __future__ import annotations

import sys


def small_step_max_tokens(num_experts: int, top_k: int) -> int:
    """The largest step token count ``T`` with ``T * top_k < num_experts``; 0 when no ``T >= 1`` has it, and
    ``sys.maxsize`` when every ``T`` has it (``top_k = 0``: no token chooses an expert).

    Up to it an MoE block gathers the ``T * top_k`` chosen experts' weights (fewer than all of them) and runs
    only those; above it every expert runs on every token. ``T`` is a static shape (fixed in a CUDA graph),
    so the choice is made at trace time: :class:`stepops.models.runner.StepRunner` compiles one graph for
    the sizes up to this bound and one for those above it (a branch on a dynamic size inside one graph's
    range would be a guard that range cannot hold).
    """
    if top_k == 0:
        return sys.maxsize if num_experts > 0 else 0
    return (num_experts - 1) // top_k
