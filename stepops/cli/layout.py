"""``python -m stepops layout [step5|inkling] ...``: print a cache page layout; size ``--block-size``.

Without a model, prints both layouts with their defaults: the released Step5's main attention layer
(:data:`~stepops.models.step5_config.STEP5_REFERENCE`, the model :mod:`stepops.models.step5` runs) and an
illustrative, Llama-8B-shaped Inkling layer (pass your model's numbers). A flag below its minimum is one
line on stderr, exit 1. When the layout does not fit, prints the layout's error text to stderr (the seed's, exactly, as the first line; with
``--page-bytes`` its advice names that flag instead of the block size), then, for the CSA ring with a known
per-token size (from the head numbers, or ``--page-bytes`` over a ``--block-size`` given with it), the
smallest block size that fits, and exits 1.
"""

from __future__ import annotations

import argparse
import sys

import torch

from stepops.layouts import (
    BLOCK_SIZE_CANDIDATES,
    INKLING_EXAMPLE_LAYOUT,
    ROW_BYTES,
    CSATailRingLayout,
    InklingConvStateLayout,
    InklingStream,
    smallest_block_size,
)
from stepops.cli.table import print_table
from stepops.models.step5_config import STEP5_REFERENCE
from stepops.specs import AttentionSpec, check_int

_ILLUSTRATIVE = "Inkling's defaults are illustrative numbers, not a published model configuration."
_MAIN_DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
# The layout's errors advise on the block size (the seed's wording). With --page-bytes the page no longer
# follows from --block-size, so the advice names --page-bytes instead.
_PAGE_BYTES_ADVICE = {
    "increase --block-size.": "increase --page-bytes.",
    "(choose the block size accordingly)": "(choose --page-bytes accordingly)",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "layout",
        help="print the Step5 / Inkling cache page layouts and the block size that fits",
        description="Print a cache page layout for given model numbers. Without a model, prints both "
        "with their defaults: the released Step5's main attention layer and an Inkling layer. " + _ILLUSTRATIVE,
    )
    parser.set_defaults(run=_run_both)
    models = parser.add_subparsers(dest="model", metavar="MODEL")

    step5 = models.add_parser(
        "step5",
        help="the Step5 CSA tail ring inside the main attention layer's KV page",
        description="The Step5 CSA tail ring: 7 + k rows of 1024 bytes in one KV page of the main "
        "attention layer. Give the main layer's numbers (per rank) or its --page-bytes. "
        f"Defaults: the released Step5's main layer ({STEP5_REFERENCE.num_kv_heads} KV heads of "
        f"{STEP5_REFERENCE.head_dim} + {STEP5_REFERENCE.head_dim}, bf16, one rank) at the block size its model "
        "uses. An MLA-style layer: --num-kv-heads 1 --head-size 576 --head-size-v 0.",
    )
    step5.add_argument("--block-size", type=int, default=None,
                       help=f"main layer's block size (default {STEP5_REFERENCE.block_size})")
    step5.add_argument("--num-kv-heads", type=int, default=STEP5_REFERENCE.num_kv_heads,
                       help="main layer's KV heads per rank (default %(default)s)")
    step5.add_argument("--head-size", type=int, default=STEP5_REFERENCE.head_dim,
                       help="main layer's key head size (default %(default)s)")
    step5.add_argument("--head-size-v", type=int, default=None,
                       help="main layer's value head size; 0 for one latent (default: --head-size)")
    step5.add_argument(
        "--dtype", choices=_MAIN_DTYPES, default="bfloat16", help="main layer's KV cache dtype (default bfloat16)"
    )
    step5.add_argument(
        "--page-bytes", type=int, default=None, help="main layer's page size in bytes; overrides the head numbers and --dtype"
    )
    step5.add_argument(
        "--num-speculative-tokens", type=int, default=STEP5_REFERENCE.num_speculative_tokens,
        help="speculative tokens k per step (default %(default)s)"
    )
    step5.set_defaults(run=_run_step5)

    inkling = models.add_parser(
        "inkling",
        help="the Inkling short-conv state: four conv streams packed per KV head",
        description="The Inkling short-conv state cache [num_blocks, H, N, D]. Defaults: a "
        "Llama-8B-shaped layer (8 KV heads of 128, hidden 4096), kernel 4. " + _ILLUSTRATIVE,
    )
    example = INKLING_EXAMPLE_LAYOUT
    inkling.add_argument("--num-kv-heads", type=int, default=example.num_kv_heads, help="KV heads, all ranks (default %(default)s)")
    inkling.add_argument("--head-dim", type=int, default=example.head_dim, help="KV head dim (default %(default)s)")
    inkling.add_argument("--hidden-size", type=int, default=example.hidden_size, help="model hidden size (default %(default)s)")
    inkling.add_argument("--kernel-size", type=int, default=example.kernel_size, help="conv kernel size W (default %(default)s)")
    inkling.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (default 1)")
    inkling.add_argument(
        "--block-size", type=int, default=None, help="tokens per block N, >= kernel size (default: kernel size)"
    )
    inkling.set_defaults(run=_run_inkling)

    parser.set_defaults(_defaults={"step5": step5.parse_args([]), "inkling": inkling.parse_args([])})


def _run_both(args: argparse.Namespace) -> int:
    status = _run_step5(args._defaults["step5"])
    print()
    return status or _run_inkling(args._defaults["inkling"])


def _check_flags(args: argparse.Namespace, minimums: dict[str, int]) -> str | None:
    """The first flag below its minimum or past int64, as the one line to print; checked before any layout
    arithmetic, so no line about block sizes follows a nonsense value."""
    for name, minimum in minimums.items():
        value = getattr(args, name)
        if value is not None:
            try:
                check_int(f"--{name.replace('_', '-')}", value, minimum)
            except ValueError as error:
                return str(error)
    return None


def _run_step5(args: argparse.Namespace) -> int:
    k = args.num_speculative_tokens
    bad = _check_flags(
        args,
        {"block_size": 1, "num_kv_heads": 1, "head_size": 1, "head_size_v": 0, "page_bytes": 1,
         "num_speculative_tokens": 0},
    )  # fmt: skip
    if bad:
        print(bad, file=sys.stderr)
        return 1
    block_size = STEP5_REFERENCE.block_size if args.block_size is None else args.block_size
    try:
        if args.page_bytes is None:
            dtype = getattr(torch, args.dtype)
            spec = AttentionSpec(
                block_size=block_size,
                num_kv_heads=args.num_kv_heads,
                head_size=args.head_size,
                head_size_v=args.head_size_v,  # None: the spec's default, head_size
                dtype=dtype,
            )
            page_bytes = spec.page_size_bytes
            per_token = page_bytes // block_size
            dtype_bytes = dtype.itemsize
            main = (
                f"{args.num_kv_heads} KV head(s) x ({spec.head_size} + {spec.head_size_v}) x {dtype_bytes} B"
                f" = {per_token} B per token"
            )
        else:
            page_bytes = args.page_bytes
            per_token = None
            main = "page size given"
    except (ValueError, TypeError) as error:
        print(error, file=sys.stderr)
        return 1
    # A page's per-token size needs the block size it was given for, not the default one.
    if per_token is None and args.block_size is not None and page_bytes % block_size == 0:
        per_token = page_bytes // block_size
    try:
        layout = CSATailRingLayout(page_bytes=page_bytes, block_size=block_size, num_speculative_tokens=k)
    except (ValueError, TypeError) as error:
        message = str(error)  # the layout's (the seed's) text, exactly, as the first line...
        if args.page_bytes is not None:  # ...advising on the flag the user actually passed
            for block_size_advice, page_bytes_advice in _PAGE_BYTES_ADVICE.items():
                message = message.replace(block_size_advice, page_bytes_advice)
        print(message, file=sys.stderr)
        if isinstance(error, ValueError) and per_token is not None:
            print(f"smallest block size that fits at {per_token} B per token: {_smallest_block_size(per_token, k)}",
                  file=sys.stderr)
        return 1

    smallest = "n/a (per-token size unknown: give --block-size with --page-bytes)"
    if per_token is not None:
        smallest = _smallest_block_size(per_token, k)
    # A given page without its block size: the default block size describes no layer of the user's.
    block_size_row, head_size_row = f"{layout.block_size}", f"{layout.head_size} bf16 per token (1 KV head)"
    if args.page_bytes is not None and args.block_size is None:
        block_size_row, head_size_row = "not given", "n/a (page bytes / (2 x block size): give --block-size)"
    print_table(
        "Step5 CSA tail ring",
        [
            ("main attention layer", main),
            ("block size", block_size_row),
            ("KV page", f"{layout.page_bytes} B"),
            ("speculative tokens k", f"{k}"),
            ("required rows (7 + k)", f"{layout.required_rows} of {layout.row_bytes} B"),
            ("ring capacity", f"{layout.capacity} rows (position p -> row p % {layout.capacity})"),
            ("rows_per_block", f"{layout.capacity} unpadded; block stride / {layout.row_elements} if strided wider"),
            ("ring spec head_size", head_size_row),
            ("smallest block size", f"{smallest}; candidates: multiples of 16"),
        ],
    )
    return 0


def _smallest_block_size(per_token: int, k: int) -> str:
    """``"B (page P B, capacity C rows)"`` for the smallest candidate block size whose page holds the ring."""
    try:
        block = smallest_block_size(bytes_per_token=per_token, num_speculative_tokens=k)
    except ValueError:
        return f"none among multiples of 16 up to {BLOCK_SIZE_CANDIDATES[-1]}"
    return f"{block} (page {block * per_token} B, capacity {block * per_token // ROW_BYTES} rows)"


def _run_inkling(args: argparse.Namespace) -> int:
    bad = _check_flags(
        args, {"num_kv_heads": 1, "head_dim": 1, "hidden_size": 1, "kernel_size": 1, "tp_size": 1, "block_size": 1}
    )
    if bad:
        print(bad, file=sys.stderr)
        return 1
    try:
        layout = InklingConvStateLayout(
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            hidden_size=args.hidden_size,
            kernel_size=args.kernel_size,
            tp_size=args.tp_size,
        )
        shape = layout.cache_shape(1, args.block_size)
        page_bytes = layout.page_bytes(args.block_size)
    except (ValueError, TypeError) as error:
        print(error, file=sys.stderr)
        return 1

    _, heads, block_size, head_size = shape
    pad = layout.hidden_padding
    chunk = f"{layout.hidden_per_head}" + (f" (the last head's chunks padded by {pad} zero channels)" if pad else "")
    rows = [
        ("KV heads per rank (H)", f"{heads} ({layout.num_kv_heads} / tp_size {layout.tp_size})"),
        ("head_dim, hidden_per_head", f"{layout.head_dim}, {chunk}"),
        (
            "D (head_size)",
            f"{head_size} = next power of two of 2*{layout.head_dim} + 2*{layout.hidden_per_head} = "
            f"{layout.packed_width} ({head_size - layout.packed_width} padding)",
        ),
    ]
    for stream in InklingStream:
        offset, width = layout.stream_range(stream)
        rows.append((f"stream {stream.name}", f"[{offset}, {offset + width}) width {width}"))
    rows += [
        ("block size (N)", f"{block_size} (kernel size {layout.kernel_size})"),
        ("cache shape (HND)", f"[num_blocks, {heads}, {block_size}, {head_size}] bfloat16"),
        ("page bytes", f"{page_bytes} per block"),
    ]
    print_table("Inkling short-conv state", rows)
    return 0
