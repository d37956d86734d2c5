"""``python -m stepops plan {step5,inkling} CHECKPOINT``: the cache pages a checkpoint's model is given.

Reads the checkpoint's ``config.json`` as the loaders do (:func:`~stepops.models.step5_weights.load_step5`,
:func:`~stepops.models.inkling_checkpoint.load_inkling`), builds the model on the meta device (no weight
is read, nothing is allocated) and prints what :func:`~stepops.allocator.allocate_kv_caches` gives its
cache layers (:func:`~stepops.allocator.plan_kv_pages`): the common page, each group of layers' spec after
unification, and the bytes one block id costs over every cache layer; with ``--memory-gib``, the blocks
that fit. A config the loader refuses is its error on one line, exit 1.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from pathlib import Path

import torch

from stepops.allocator import UnifiedPages, plan_kv_pages
from stepops.cli.table import print_table
from stepops.models.checkpoint_files import read_json_object
from stepops.models.inkling import InklingModel
from stepops.models.inkling_checkpoint import config_from_transformers
from stepops.models.step5 import Step5Model
from stepops.models.step5_config import CSA
from stepops.models.step5_weights import step5_config_from_reference
from stepops.specs import AttentionSpec, CircularBufferSpec, SlidingWindowSpec, check_int

_GIB = 2**30


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="print the cache pages a Step5 or Inkling checkpoint's model is given",
        description="Read a checkpoint's config.json as the model's loader does, build the model on the meta "
        "device and print the cache pages the allocator gives its layers and the bytes per block id.",
    )
    parser.add_argument("model", choices=("step5", "inkling"), help="the checkpoint's model family")
    parser.add_argument("checkpoint", type=Path, help="the checkpoint directory, or its config.json")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=3,
        help="speculative tokens k per step (Step5 sizes its CSA ring for them; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--memory-gib", type=float, default=None, help="also print how many block ids fit in this many GiB"
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    config_file = args.checkpoint / "config.json" if args.checkpoint.is_dir() else args.checkpoint
    try:
        check_int("--num-speculative-tokens", args.num_speculative_tokens, 0)
        if args.memory_gib is not None and not (math.isfinite(args.memory_gib) and args.memory_gib > 0):
            raise ValueError(f"--memory-gib must be a finite number > 0, got {args.memory_gib}")
        if not config_file.is_file():
            raise ValueError(f"{args.checkpoint}: no config.json (give a checkpoint directory or its config.json)")
        hf = read_json_object(config_file)  # its errors name the file
    except OSError as error:  # a file that cannot be read
        print(f"{config_file}: {error.strerror or error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    try:
        model, summary = _model(args.model, hf, args.num_speculative_tokens)
        pages = plan_kv_pages(model.static_forward_context)
    except (ValueError, TypeError) as error:
        print(f"{config_file}: {error}", file=sys.stderr)
        return 1
    rows = [("page (block stride)", f"{pages.page_bytes} B per block id in each cache layer")]
    rows += _group_rows(pages)
    per_block = pages.page_bytes * len(pages.specs)
    rows.append(("per block id", f"{per_block} B ({len(pages.specs)} cache layers)"))
    rows.append(("smallest block size", f"{min(spec.block_size for spec in pages.specs.values())} tokens"))
    if summary is not None:
        rows.append(summary)
    if args.memory_gib is not None:
        blocks = int(args.memory_gib * _GIB) // per_block
        rows.append((f"blocks in {args.memory_gib:g} GiB", f"{blocks}"))
    print_table(f"{args.model} caches of {config_file} ({len(model.layers)} layers, one rank)", rows)
    return 0


def _model(family: str, hf: dict, num_speculative_tokens: int) -> tuple[torch.nn.Module, tuple[str, str] | None]:
    """The decoder stack ``family``'s loader builds from ``hf``, on the meta device, and for Step5 the row of
    its CSA layers' summary caches (allocated by the model beside the pages)."""
    if family == "step5":
        config = step5_config_from_reference(hf, num_speculative_tokens=num_speculative_tokens)
        with torch.device("meta"):
            model = Step5Model(config)
        csa = config.layer_types.count(CSA)
        block = model.summary_block_size * config.index_proxy_dim  # e4m3: one byte per element
        summary = ("summary caches", f"{csa} CSA layer(s) x {block} B per summary block (e4m3, not paged)")
        return model, summary if csa else None
    config = config_from_transformers(hf, num_speculative_tokens=num_speculative_tokens)
    with torch.device("meta"):
        return InklingModel(config), None


def _group_rows(pages: UnifiedPages) -> list[tuple[str, str]]:
    """One row per kind of cache layer (its name with the layer index as ``*``) and unified spec."""
    groups = Counter((re.sub(r"\.\d+\.", ".*.", name), spec) for name, spec in pages.specs.items())
    rows = []
    for (pattern, spec), count in groups.items():
        value = f"{_kind(spec)}: block size {spec.block_size}, {_heads(spec)}"
        if spec.page_size_bytes < pages.page_bytes:
            value += f"; its {spec.page_size_bytes} B page padded to the block stride"
        rows.append((f"{pattern} x {count}", value))
    return rows


def _kind(spec: AttentionSpec) -> str:
    if isinstance(spec, CircularBufferSpec):
        return "ring"
    if isinstance(spec, SlidingWindowSpec):
        return f"window {spec.sliding_window}"
    return "full"


def _heads(spec: AttentionSpec) -> str:
    dtype = str(spec.dtype).removeprefix("torch.")
    return f"{spec.num_kv_heads} KV head(s) x ({spec.head_size} + {spec.head_size_v}) {dtype}"
