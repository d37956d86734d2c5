"""Tensor parallelism for the Inkling decoder layers over ``torch.distributed``.

Inkling is sharded by whole KV heads (design brief section 3): rank ``r`` of ``tp`` holds query heads
``[r Hq/tp, (r+1) Hq/tp)``, KV heads ``[r Hkv/tp, (r+1) Hkv/tp)`` and hidden channels
``[r hidden/tp, (r+1) hidden/tp)`` of the attention-output and MLP-output streams. ``hidden/tp`` equals
``(Hkv/tp) * hidden_per_head``: exactly the conv-stream width of the rank's cache heads, so the conv-state
page keeps one ``D`` at every ``tp``. The residual stream ``[T, hidden]`` is replicated on every rank.

- :class:`TensorParallel`: a process group with its size and this rank, read once (plain ints inside the
  compiled step).
- :func:`reduce_scatter_hidden` / :func:`all_gather_hidden`: the two collectives around each output-stream
  conv, as functional collectives so ``torch.compile(fullgraph=True)`` traces them without a break.
- :func:`shard_inkling_state_dict`: a full (tp = 1) Inkling state dict -> one rank's shard.
- :func:`spawn_ranks`: start ``tp`` local processes joined in one group (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from stepops.models.inkling import InklingConfig

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
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
            )
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of process_group")
        return cls(group, size, rank) if size > 1 else cls()

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (``total / size``); ``ValueError`` naming ``what`` when uneven."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) must be divisible by the tensor-parallel size ({self.size})")
        return total // self.size


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


def all_gather_hidden(shard: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate every rank's ``[T, hidden/tp]`` along channels, in rank order: ``[T, hidden]``."""
    num_tokens, width = shard.shape
    rows = _all_gather(shard, 0, tp.group)  # [tp * T, hidden/tp], rank-major (see reduce_scatter_hidden)
    return rows.view(tp.size, num_tokens, width).transpose(0, 1).reshape(num_tokens, tp.size * width)


# -- weight loading --------------------------------------------------------------------------------------

# How each Inkling layer parameter is sharded, by the name inside a layer. "rows": output channels
# (column-parallel projections and the per-channel conv weights); "columns": input channels (row-parallel
# projections, whose outputs are partial sums); "gate_up": the fused [gate; up] rows, each half split;
# "replicated": norms. The unit is what one slice is a whole multiple of; "hidden" splits the hidden size.
_SHARDING: dict[str, tuple[str, str]] = {
    "input_norm.weight": ("replicated", ""),
    "post_norm.weight": ("replicated", ""),
    "q_norm.weight": ("replicated", ""),
    "k_norm.weight": ("replicated", ""),
    "q_proj.weight": ("rows", "heads"),
    "k_proj.weight": ("rows", "kv_heads"),
    "v_proj.weight": ("rows", "kv_heads"),
    "conv_k": ("rows", "kv_heads"),
    "conv_v": ("rows", "kv_heads"),
    "conv_attn": ("rows", "hidden"),
    "conv_mlp": ("rows", "hidden"),
    "o_proj.weight": ("columns", "heads"),
    "mlp.gate_up.weight": ("gate_up", "intermediate"),
    "mlp.down.weight": ("columns", "intermediate"),
}


def check_inkling_tp(config: InklingConfig, tp_size: int) -> None:
    """Raise ``ValueError`` unless ``config`` shards over ``tp_size`` ranks by whole KV heads.

    Needs ``tp_size <= num_kv_heads`` (the conv-state layout's own error), ``num_kv_heads`` and
    ``intermediate_size`` divisible by ``tp_size`` (query heads and hidden then divide too).
    """
    from stepops.layouts import InklingConvStateLayout

    InklingConvStateLayout(
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_size=config.hidden_size,
        kernel_size=config.conv_kernel_size,
        tp_size=tp_size,
    )
    if config.intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size ({config.intermediate_size}) must be divisible by the tensor-parallel size ({tp_size})"
        )


def shard_inkling_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: InklingConfig, *, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """Slice a full (tp = 1) Inkling model or layer state dict into rank ``tp_rank``'s shard of ``tp_size``.

    Keys keep their names (``layers.0.q_proj.weight``, or ``q_proj.weight`` for one layer); values are
    contiguous copies of the rank's slice: q/k/v projections and the K/V conv weights by the rank's (KV)
    heads' rows, the attention/MLP-output conv weights by its hidden rows, ``o_proj`` and ``mlp.down`` by
    input columns, ``mlp.gate_up`` by each of its gate and up halves, norms whole. Loading the result into
    a model built with a ``tp_size`` group makes it compute the full model's function. Raises ``ValueError``
    for a config that does not shard (:func:`check_inkling_tp`), a bad rank, or a key it does not know (a
    new parameter must say how it shards, not be replicated by accident).
    """
    if not isinstance(tp_rank, int) or not isinstance(tp_size, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank!r}, tp_size={tp_size!r}")
    check_inkling_tp(config, tp_size)
    units = {
        "heads": config.num_heads * config.head_dim,
        "kv_heads": config.num_kv_heads * config.head_dim,
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
    }
    out = {}
    for key, value in state_dict.items():
        rule = next((r for name, r in _SHARDING.items() if key == name or key.endswith("." + name)), None)
        if rule is None:
            raise ValueError(f"shard_inkling_state_dict: no sharding rule for {key!r}")
        kind, unit = rule
        if kind == "replicated":
            out[key] = value.clone()
            continue
        share = units[unit] // tp_size
        dim = 1 if kind == "columns" else 0
        if value.shape[dim] != (2 if kind == "gate_up" else 1) * units[unit]:
            raise ValueError(f"{key}: shape {tuple(value.shape)} does not match the config's {unit} ({units[unit]})")
        if kind == "gate_up":
            gate, up = value.chunk(2, dim=0)
            out[key] = torch.cat([t[tp_rank * share : (tp_rank + 1) * share] for t in (gate, up)]).contiguous()
        else:
            out[key] = value.narrow(dim, tp_rank * share, share).contiguous()
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
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=tp_size, timeout=timeout)
    try:
        fn(rank, tp_size, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., Any], tp_size: int, *args: Any, backend: str = "gloo", timeout: timedelta | None = None
) -> None:
    """Run ``fn(rank, tp_size, *args)`` in ``tp_size`` new local processes joined in one default group.

    ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (one CUDA device per rank: ``fn`` picks
    ``cuda:rank``). The group rendezvouses through a ``file://`` store in a fresh temporary directory (no
    port to pick); ``timeout`` bounds each collective (``None``: torch's default). ``fn`` and ``args``
    must be picklable (a module-level function). When a rank raises, the others are ended and
    ``torch.multiprocessing.ProcessRaisedException`` (with its traceback) is raised here.
    """
    with tempfile.TemporaryDirectory(prefix="stepops-tp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_rank_main, args=(fn, tp_size, init_file, backend, timeout, args), nprocs=tp_size)
