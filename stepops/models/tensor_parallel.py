"""Tensor parallelism for the Inkling decoder layers, expert parallelism for Step5's routed experts, over
``torch.distributed`` (imports no model).

Inkling is sharded by whole KV heads (each head's conv-state chunk stays on one rank): rank ``r`` of ``tp`` holds query heads
``[r Hq/tp, (r+1) Hq/tp)``, KV heads ``[r Hkv/tp, (r+1) Hkv/tp)`` and hidden channels
``[r hidden/tp, (r+1) hidden/tp)`` of the attention-output and MLP-output streams. ``hidden/tp`` equals
``(Hkv/tp) * hidden_per_head``: exactly the conv-stream width of the rank's cache heads, so the conv-state
page keeps one ``D`` at every ``tp``. The residual stream ``[T, hidden]`` is replicated on every rank.

Step5 shards only its routed experts, by expert (``stepops.models.step5.Step5MoE``); everything else, the
caches included, is whole on every rank.

- :class:`TensorParallel`: a process group with its size and this rank, read once (plain ints inside the
  compiled step).
- :func:`reduce_scatter_hidden` / :func:`all_gather_hidden`: the two collectives around each output-stream
  conv, as functional collectives so ``torch.compile(fullgraph=True)`` traces them without a break;
  :func:`all_reduce_sum` the same for Step5's expert outputs.
- :class:`ShardRule` / :func:`shard_state_dict`: a full (tp = 1) state dict -> one rank's shard, by a rule
  per key (the model says how its parameters shard: :func:`stepops.models.inkling.shard_inkling_state_dict`).
- :func:`spawn_ranks`: start ``tp`` local processes joined in one group (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import faulthandler
import multiprocessing.util
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

from stepops.specs import check_int, is_int

# torch 2.13 has the dim-aware functional collectives as *_single and deprecates the *_tensor names (they
# warn in eager); a release without *_single has the *_tensor names. Same signature, same graph ops.
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel group as the layers see it: ``group`` (``None`` when not sharded), ``size``, ``rank``."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None) -> TensorParallel:
        """``None`` (or a group of one) is the unsharded layer; otherwise this process's rank in ``group``."""
        if group is None:
            return cls()
        # What dist.new_group returns on a rank outside the group (an int, not a group).
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this process is not a member of process_group")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
            )
        # dist.get_rank returns -1 ("not in the group") for NON_GROUP_MEMBER alone, refused above; for a
        # ProcessGroup that does not hold this process it raises.
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return cls(group, size, rank) if size > 1 else cls()


def reduce_scatter_hidden(partial: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum the ranks' partial sublayer outputs ``[T, hidden]`` and keep this rank's channels ``[T, hidden/tp]``.

    The sum runs in ``partial``'s dtype (bf16 over the wire, as serving engines do); with ``tp`` bf16
    partials it rounds ``tp`` times where one unsharded matmul rounds once (see
    ``TOLERANCES["tensor_parallel_vs_single_rank"]``).
    """
    num_tokens, hidden = partial.shape
    # Rank-major rows [tp * T, hidden/tp], scattered along dim 0. funcol's own scatter_dim=1 path chunks a
    # symbolic size, and its guard fails Dynamo's check of the dynamic token dimension.
    rows = partial.view(num_tokens, tp.size, hidden // tp.size).transpose(0, 1).reshape(-1, hidden // tp.size)
    return _reduce_scatter(rows, "sum", 0, tp.group)


def all_reduce_sum(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The elementwise sum of every rank's ``tensor``, on every rank, in its dtype (a functional collective:
    traced by ``torch.compile(fullgraph=True)`` without a break)."""
    return funcol.all_reduce(tensor, "sum", tp.group)


def all_gather_hidden(shard: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate every rank's ``[T, hidden/tp]`` along channels, in rank order: ``[T, hidden]``."""
    num_tokens, width = shard.shape
    rows = _all_gather(shard, 0, tp.group)  # [tp * T, hidden/tp], rank-major (see reduce_scatter_hidden)
    return rows.view(tp.size, num_tokens, width).transpose(0, 1).reshape(num_tokens, tp.size * width)


# -- weight loading --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRule:
    """How one parameter shards: along ``dim``, viewed as ``parts`` equal chunks (a fused ``[gate; up]`` is
    2), each split into ``tp`` equal slices; rank ``r`` keeps slice ``r`` of every chunk, in chunk order."""

    dim: int
    parts: int = 1


def shard_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    rules: Mapping[str, ShardRule | None],
    *,
    tp_rank: int,
    tp_size: int,
) -> dict[str, torch.Tensor]:
    """Rank ``tp_rank``'s shard of ``state_dict`` under ``rules`` (key -> :class:`ShardRule`, ``None`` =
    replicated): contiguous copies, same keys. ``TypeError`` for a rank or size that is not an int
    (:func:`stepops.specs.is_int`); ``ValueError`` for a bad rank, a key without a rule or a dimension that
    does not split evenly."""
    if not (is_int(tp_rank) and is_int(tp_size)):
        raise TypeError(f"tp_rank and tp_size must be ints, got {type(tp_rank).__name__}, {type(tp_size).__name__}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank!r}, tp_size={tp_size!r}")
    out = {}
    for key, value in state_dict.items():
        if key not in rules:
            raise ValueError(f"no sharding rule for {key!r}")
        rule = rules[key]
        if rule is None:
            out[key] = value.clone()
            continue
        if value.shape[rule.dim] % (rule.parts * tp_size):
            raise ValueError(
                f"{key}: dim {rule.dim} of shape {tuple(value.shape)} does not split into {rule.parts} x {tp_size} slices"
            )
        chunks = value.unflatten(rule.dim, (rule.parts, tp_size, -1)).select(rule.dim + 1, tp_rank)
        # clone, not contiguous(): a dim-0 slice is already contiguous, and contiguous() would return a view
        # that aliases (and keeps alive) the whole full tensor.
        out[key] = chunks.flatten(rule.dim, rule.dim + 1).clone(memory_format=torch.contiguous_format)
    return out


# -- launching ranks -------------------------------------------------------------------------------------


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    tp_size: int,
    init_file: str,
    backend: str,
    timeout: timedelta | None,
    args: tuple,
) -> None:
    faulthandler.enable()  # a rank that dies in C++ (SIGABRT, SIGSEGV) still prints its Python stacks
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=tp_size, timeout=timeout)
    try:
        fn(rank, tp_size, *args)
    finally:
        dist.destroy_process_group()
    # Done and disconnected: leave without interpreter finalization. Freeing torch's distributed and compiled
    # state there aborted a finished gloo rank once in CI ("terminate called without an active exception");
    # everything a rank reports is in the files or streams it has written by now. multiprocessing's own exit
    # step still runs: it releases the rank's locks (Inductor's tqdm bar makes one), which os._exit alone
    # leaves to the parent's resource tracker to report as leaked semaphores.
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(
    fn: Callable[..., Any], tp_size: int, *args: Any, backend: str = "gloo", timeout: timedelta | None = None
) -> None:
    """Run ``fn(rank, tp_size, *args)`` in ``tp_size`` new local processes joined in one default group.

    ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (one CUDA device per rank: ``fn`` picks
    ``cuda:rank``). The group rendezvouses through a ``file://`` store in a fresh temporary directory (no
    port to pick); ``timeout`` bounds each collective (``None``: torch's default). ``fn`` and ``args``
    must be picklable (a module-level function). When a rank raises, the others are ended and
    ``torch.multiprocessing.ProcessRaisedException`` (with its traceback) is raised here. A rank that
    finishes leaves the group and exits at once (``os._exit``): whatever it reports must be written or
    printed by ``fn`` itself.
    """
    check_int("tp_size", tp_size, 1)
    with tempfile.TemporaryDirectory(prefix="stepops-tp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_rank_main, args=(fn, tp_size, init_file, backend, timeout, args), nprocs=tp_size)
