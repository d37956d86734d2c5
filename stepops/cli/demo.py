"""``python -m stepops demo [--json PATH] [--tp N]``: the main job (see :mod:`stepops.demo`)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run 2-layer Step5 and Inkling stacks through a multi-request workload, eager and compiled",
        description="Run a 2-layer Step5 stack and a 2-layer Inkling stack through a scripted multi-request "
        "workload (chunked prefill, decode, speculative verify with rejections), eagerly, compiled with "
        "torch.compile(fullgraph=True) and, with a GPU, from CUDA graphs; check each run against a full "
        "recompute without caches and print a table. Exits 1 when a check fails.",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the per-model results as JSON")
    parser.add_argument("--device", default="auto", help="auto (a GPU when present), cpu or cuda")
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend for the compiled runs (default: inductor)"
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="run the Inkling stack tensor-parallel on N spawned ranks (gloo on CPU, NCCL with N GPUs); "
        "Step5 stays in one process (default: 1)",
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import sys

    from stepops.demo import check_demo_args, run_demo  # imports torch.compile machinery only when it runs

    try:  # before any work: a bad argument is one line on stderr, not a traceback minutes later
        check_demo_args(device=args.device, backend=args.backend, tp=args.tp, json_path=args.json)
    except ValueError as error:
        print(f"stepops demo: {error}", file=sys.stderr)
        return 2
    return run_demo(json_path=args.json, device=args.device, backend=args.backend, tp=args.tp)
