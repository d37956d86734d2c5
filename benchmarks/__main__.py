"""``python -m benchmarks``: every stepops op (and decoder layer step) against its byte floor and baselines.

    python -m benchmarks [--quick] [--tiny] [--json PATH] [--results-dir DIR] [--ops NAME ...]
                         [--layers | --no-layers] [--attention | --no-attention]
    python -m benchmarks static [--json PATH]  # GPU-build table + estimated decode launch time vs the byte floor

Run from the repository root, or from anywhere as ``python path/to/benchmarks ...``. Results go to
``benchmarks/results/`` or ``--results-dir`` (JSON, CSV, and PNG plots when matplotlib is installed). See
docs/performance.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a directory (python path/to/benchmarks): make the repository root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import argparse  # noqa: E402
import time  # noqa: E402

from benchmarks.cli_args import (  # noqa: E402
    add_device_arguments,
    check_device_argument,
    check_json_argument,
    check_results_dir_argument,
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    from benchmarks.harness import OP_MODULES, RESULTS_DIR

    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0],
                                     epilog="static takes only --json; every other option is run's.")
    parser.add_argument("command", nargs="?", choices=("run", "static"), default="run",
                        help="run: time ops and layers (default); static: the GPU-build table and decode estimates")
    parser.add_argument("--quick", action="store_true", help="small sizes: about 2 to 4 minutes on a 2-core CPU, depending on its load")
    parser.add_argument("--tiny", action="store_true", help="one smallest case per op and no extras; layers and attention only with --layers, --attention "
                             "(smoke test)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the JSON report to PATH")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, metavar="DIR",
                        help="where the JSON, CSV and plots named by device and size go (default: benchmarks/results)")
    parser.add_argument("--ops", nargs="+", choices=OP_MODULES, default=list(OP_MODULES), help="ops to run")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--layers", action="store_true", help="time decoder layer steps also with --quick")
    layers.add_argument("--no-layers", action="store_true", help="skip the decoder layer steps")
    attention = parser.add_mutually_exclusive_group()
    attention.add_argument("--attention", action="store_true",
                           help="layer attention (dense gather vs paged) and a whole-model decode step at 1k-16k "
                                "contexts, also with --quick")
    attention.add_argument("--no-attention", action="store_true", help="skip the layer-attention case")
    add_device_arguments(parser)
    parser.add_argument("--compile-backend", default="inductor", metavar="BACKEND",
                        help="torch.compile backend of the baselines (default: inductor)")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, as argparse errors before any work, what would otherwise fail deep in torch or be ignored."""
    check_json_argument(parser, args.json)
    if args.command == "static":
        # Every option but --json is read by ``run`` only: a new one is refused here without a list to update.
        given = [
            name for name, value in vars(args).items()
            if name not in ("command", "json") and value != parser.get_default(name)
        ]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            parser.error(f"static takes only --json, not {flags} (options of run)")
        return
    import torch

    check_device_argument(parser, args.device)
    check_results_dir_argument(parser, args.results_dir)
    if args.compile_backend not in torch.compiler.list_backends(exclude_tags=()):
        parser.error(f"--compile-backend {args.compile_backend!r} is not a torch.compile backend; "
                     "e.g. inductor, aot_eager or eager")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.command == "static":
        from benchmarks.static import main as static_main

        return static_main(args.json)

    import torch

    from benchmarks import harness

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # Before anything compiles: Inductor's CPU kernels take their OpenMP thread count from here.
    torch.set_num_threads(args.threads)
    settings = harness.Settings(
        device=device, quick=args.quick or args.tiny, compile_backend=args.compile_backend,
        min_run_time=0.05 if (args.quick or args.tiny) else 0.2, tiny=args.tiny,
    )
    started = time.perf_counter()
    copy_gbps = harness.copy_bandwidth_gbps(settings)
    report = {"machine": harness.machine(settings), "copy_bandwidth_gbps": copy_gbps, "ops": []}
    _log(f"device {device}, copy bandwidth {copy_gbps:.1f} GB/s")
    for name in args.ops:
        result = harness.run_op(name, settings, copy_gbps, _log)
        report["ops"].append(result)
        print(harness.format_op_table(result), flush=True)
    print(harness.format_host_costs(report["ops"]), flush=True)
    report["metadata"] = harness.metadata_op_counts(device)
    print(harness.format_metadata_counts(report["metadata"]), flush=True)
    # Compiling two decoder models costs ~50 s on a 2-core CPU: off in --quick unless asked for.
    if args.layers or not (args.no_layers or args.quick or args.tiny):
        from benchmarks.bench_layers import format_layers, run_layers

        report["layers"] = run_layers(settings, _log)
        print(format_layers(report["layers"]), flush=True)
    # Six compiles and a 0.5 s dense step at 16k, then six whole-model compiles for the model step: a few
    # minutes on a 2-core CPU, off in --quick unless asked for.
    if args.attention or not (args.no_attention or args.quick or args.tiny):
        from benchmarks.bench_attention import format_attention, format_model_step, run_attention, run_model_step

        report["attention"] = run_attention(settings, _log)
        print(format_attention(report["attention"]), flush=True)
        report["model_step"] = run_model_step(settings, _log)
        print(format_model_step(report["model_step"]), flush=True)
    report["wall_s"] = time.perf_counter() - started
    harness.save(report, args.json, _log, args.results_dir)
    failed = harness.failed_checks(report)
    _log(f"done in {report['wall_s']:.0f} s" + (f"; baselines that failed their check: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
