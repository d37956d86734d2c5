"""Attention over the paged KV cache: the layer function (dense oracle vs ``paged_attention``) and a whole
tiny-model decode step (both decoder families, which attend through ``stepops.models.paged_attention``).

**Layer attention** (:func:`run_attention`): one decode step of 64 requests (one token each) at 1k, 4k
and 16k-token contexts, with the tiny models' head shapes (4 query heads, 2 KV heads of 16 + 16; Inkling's block
size 16, bf16 cache, global attention: the whole context is read). Per provider and context:

- ``peak_eager_mib`` / ``peak_compiled_mib``: peak transient memory of one call, beyond the caches,
  weights and inputs that exist before it: the running sum of the CPU allocator's allocations minus frees
  during the call (``torch.profiler`` memory events, which every ATen and Inductor allocation reports),
  at its maximum.
- ``compiled_us``: median time of the ``torch.compile(fullgraph=True)`` call; ``kv_read_mib``: the KV bytes
  the step must read (every request's context once); ``us_per_kv_mib``: time per MiB read, flat when time
  grows no faster than bytes read.

The dense path gathers ``[T, max_blocks * N, H, D + Dv]`` and upcasts it: its memory grows with the
context. The new path walks the table in chunks of ``keys_per_chunk`` keys: its memory is one chunk.

**Model step** (:func:`run_model_step`): one decode step of 64 requests (one token each, every request at
the same context) through the default tiny Step5 (sliding + CSA) and Inkling (sliding + global) models, run
by ``StepRunner`` eager, compiled (``fullgraph=True``, dynamic ``T``) and, on CUDA, replayed from a CUDA
graph. ``peak_*_mib``: as above, beyond the caches, weights and step buffers (on CUDA the allocator's peak
minus what was allocated before). ``kv_read_mib``: what the step must read: each global layer the whole
context, each sliding layer its window, each CSA layer its ``index_top_k + 1`` regions and every earlier
region's 256-byte e4m3 summary (the indexer scores them all). ``first_run_s``: the first run of the step
(in compiled mode, Inductor's compile, with its caches off). ``--attention-keys-per-chunk`` and
``--indexer-regions-per-chunk`` set the models' chunk sizes (the compiled step unrolls ``context / size``
chunks per layer: fewer, larger chunks compile faster and hold more transient memory); ``--also-chunks``
runs the largest context again at other sizes.

    python -m benchmarks.bench_attention [--model-step-only] [--modes eager compiled cudagraph] [--json PATH]
        [--contexts N ...] [--attention-keys-per-chunk N] [--indexer-regions-per-chunk N]
        [--also-chunks KEYS REGIONS]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.cli_args import add_device_arguments, check_device_argument, check_json_argument, positive_int
from benchmarks.harness import Settings, median_us, right_aligned
from stepops.layouts import REGION_SIZE
from stepops.testing.memory import peak_transient_bytes

NUM_REQUESTS = 64
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 16  # the tiny configs' heads; Inkling's block size
CONTEXTS = (1024, 4096, 16384)


def _decode_step(context: int, device: torch.device):
    """A decode step at ``context`` tokens per request: query, cache, block table, token metadata."""
    from stepops.ops.step_metadata import build_token_metadata

    gen = torch.Generator().manual_seed(context)
    blocks_per_request = context // BLOCK_SIZE
    num_blocks = NUM_REQUESTS * blocks_per_request
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM, generator=gen).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=gen).view(NUM_REQUESTS, blocks_per_request).int()
    query = torch.randn(NUM_REQUESTS, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    query_start_loc = torch.arange(NUM_REQUESTS + 1, dtype=torch.int32)
    seq_lens = torch.full((NUM_REQUESTS,), context, dtype=torch.int32)
    token = build_token_metadata(query_start_loc, seq_lens, NUM_REQUESTS)
    to = lambda t: t.to(device)  # noqa: E731
    return to(query), to(kv_cache), to(table), type(token)(*map(to, token))


def _providers() -> dict[str, Callable[..., torch.Tensor]]:
    from stepops.testing.dense_attention import gather_paged_keys, masked_attention
    from stepops.models.paged_attention import paged_attention

    def dense(query, kv_cache, table, token):
        keys = gather_paged_keys(kv_cache, HEAD_DIM, table, token)
        return masked_attention(query, keys.key, keys.value, keys.causal, HEAD_DIM**-0.5)

    def paged(query, kv_cache, table, token):
        # One token per request: a tile of one (a verify step would pass k + 1).
        return paged_attention(query, kv_cache, table, token, scale=HEAD_DIM**-0.5, query_tile=1)

    return {"dense": dense, "paged": paged}


def run_attention(
    settings: Settings, log: Callable[[str], None], contexts: tuple[int, ...] = CONTEXTS
) -> dict[str, Any]:
    rows = []
    for context in contexts:
        args = _decode_step(context, settings.device)
        kv_read = NUM_REQUESTS * context * KV_HEADS * 2 * HEAD_DIM * torch.bfloat16.itemsize
        outputs = {}
        for name, fn in _providers().items():
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend=settings.compile_backend)
            outputs[name] = compiled(*args)  # compiles
            row = {
                "provider": name,
                "context": context,
                "kv_read_mib": kv_read / 2**20,
                "peak_eager_mib": _peak_bytes(lambda: fn(*args), settings.device) / 2**20,
                "peak_compiled_mib": _peak_bytes(lambda: compiled(*args), settings.device) / 2**20,
                "compiled_us": median_us(lambda: compiled(*args), settings),
            }
            row["us_per_kv_mib"] = row["compiled_us"] / row["kv_read_mib"]
            rows.append(row)
            log(f"  attention/{name}/ctx{context}: {row['compiled_us']:.0f} us, "
                f"peak {row['peak_compiled_mib']:.1f} MiB")
        rows[-1]["max_abs_diff_vs_dense"] = (outputs["paged"].float() - outputs["dense"].float()).abs().max().item()
        del args, outputs
    growth = {}
    for name in _providers():
        mine = [r for r in rows if r["provider"] == name]
        first, last = mine[0], mine[-1]
        growth[name] = {
            "peak_eager": last["peak_eager_mib"] / first["peak_eager_mib"],
            "peak_compiled": last["peak_compiled_mib"] / first["peak_compiled_mib"],
            "time_per_byte": last["us_per_kv_mib"] / first["us_per_kv_mib"],
        }
    return {"requests": NUM_REQUESTS, "heads": [HEADS, KV_HEADS, HEAD_DIM], "block_size": BLOCK_SIZE,
            "rows": rows, f"growth_{contexts[0]}_to_{contexts[-1]}": growth}


def format_attention(results: dict[str, Any]) -> str:
    lines = [f"layer attention, decode of {results['requests']} requests (peak = transient MiB beyond inputs)"]
    header = ["provider", "context", "KV MiB", "peak eager", "peak compiled", "compiled us", "us/MiB"]
    table = [header] + [
        [r["provider"], str(r["context"]), f"{r['kv_read_mib']:.0f}", f"{r['peak_eager_mib']:.1f}",
         f"{r['peak_compiled_mib']:.1f}", f"{r['compiled_us']:.0f}", f"{r['us_per_kv_mib']:.1f}"]
        for r in results["rows"]
    ]
    lines += right_aligned(table)
    key = next(k for k in results if k.startswith("growth_"))
    for name, g in results[key].items():
        lines.append(f"  {name} {key.removeprefix('growth_')}: peak eager x{g['peak_eager']:.2f}, "
                     f"peak compiled x{g['peak_compiled']:.2f}, time per byte x{g['time_per_byte']:.2f}")
    return "\n".join(lines)


def _peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak memory of ``fn()`` beyond what was allocated before it (CPU: allocator events; CUDA: the
    caching allocator's peak)."""
    if device.type != "cuda":
        return peak_transient_bytes(fn)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _kv_read_bytes(model, context: int) -> int:
    """Bytes a decode step of ``NUM_REQUESTS`` requests at ``context`` tokens must read from the caches."""
    total = 0
    for layer in model.layers:
        cache = layer.attn.kv_cache
        per_token = cache.shape[2] * cache.shape[3] * cache.element_size()  # K and V of every KV head
        kind = layer.kind
        if kind == "csa":
            regions = context // REGION_SIZE
            keys = min(context, (model.config.index_top_k + 1) * REGION_SIZE)
            total += NUM_REQUESTS * regions * layer.summary_cache.shape[1]  # e4m3 summaries, 1 byte each
        elif kind == "sliding":
            keys = min(context, model.config.sliding_window)
        else:
            keys = context
        total += NUM_REQUESTS * keys * per_token
    return total


def run_model_step(
    settings: Settings,
    log: Callable[[str], None],
    contexts: tuple[int, ...] = CONTEXTS,
    modes: tuple[str, ...] | None = None,
    attention_keys_per_chunk: int | None = None,
    indexer_regions_per_chunk: int | None = None,
) -> dict[str, Any]:
    """Peak transient memory and time of one whole-model decode step per model, context and mode; the chunk
    sizes the models' defaults unless given (the indexer's is Step5's only)."""
    from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
    from stepops.models.runner import COMPILED, CUDA_GRAPH, EAGER, ScheduledRequest, StepRunner

    device = settings.device
    if modes is None:
        modes = (EAGER, COMPILED) + ((CUDA_GRAPH,) if device.type == "cuda" else ())
    keys = {} if attention_keys_per_chunk is None else dict(attention_keys_per_chunk=attention_keys_per_chunk)
    regions = {} if indexer_regions_per_chunk is None else dict(indexer_regions_per_chunk=indexer_regions_per_chunk)
    rows = []
    for name, model_cls, config in (
        ("step5", Step5Model, Step5Config(**keys, **regions)),
        ("inkling", InklingModel, InklingConfig(**keys)),
    ):
        for context in contexts:
            gen = torch.Generator().manual_seed(context)
            batch = [
                ScheduledRequest(i, context - 1, torch.randn(1, config.hidden_size, generator=gen).to(torch.bfloat16))
                for i in range(NUM_REQUESTS)
            ]
            for mode in modes:
                torch._dynamo.reset()
                torch.manual_seed(0)
                with torch.device(device):
                    model = model_cls(config)
                runner = StepRunner(model, max_requests=NUM_REQUESTS, max_model_len=context, max_tokens=NUM_REQUESTS,
                                    device=device, mode=mode, compile_backend=settings.compile_backend)
                for i in range(NUM_REQUESTS):
                    runner.assume_fed(i, context - 1)  # a decode step at the context's end, without its prefill
                size = runner.padded_size(runner._fill_buffers(batch))
                start = time.perf_counter()
                # No cache hits: compiled mode's first run is a whole Inductor compile.
                with torch._inductor.config.patch(force_disable_caches=True):
                    if mode == CUDA_GRAPH:
                        runner._capture(size)  # only the decode step's size
                    else:
                        runner._run(size)  # compiles in compiled mode
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                row = {"model": name, "mode": mode, "context": context, "first_run_s": time.perf_counter() - start,
                       "attention_keys_per_chunk": config.attention_keys_per_chunk,
                       "indexer_regions_per_chunk": getattr(config, "indexer_regions_per_chunk", None),
                       "kv_read_mib": _kv_read_bytes(model, context) / 2**20,
                       "cache_mib": sum(t.numel() * t.element_size() for t in model.cache_tensors()) / 2**20,
                       "step_us": median_us(lambda: runner._run(size), settings)}
                if mode != CUDA_GRAPH:
                    row["peak_mib"] = _peak_bytes(lambda: runner._run(size), device) / 2**20
                row["us_per_kv_mib"] = row["step_us"] / row["kv_read_mib"]
                rows.append(row)
                log(f"  model_step/{name}/{mode}/ctx{context}: first run {row['first_run_s']:.1f} s, {row['step_us']:.0f} us"
                    + (f", peak {row['peak_mib']:.1f} MiB" if "peak_mib" in row else ""))
                del runner, model
    growth = {}
    for name in ("step5", "inkling"):
        for mode in modes:
            mine = [r for r in rows if r["model"] == name and r["mode"] == mode]
            first, last = mine[0], mine[-1]
            g = {"time_per_byte": last["us_per_kv_mib"] / first["us_per_kv_mib"]}
            if "peak_mib" in first:
                g["peak"] = last["peak_mib"] / first["peak_mib"]
            growth[f"{name}/{mode}"] = g
    return {"requests": NUM_REQUESTS, "rows": rows, f"growth_{contexts[0]}_to_{contexts[-1]}": growth}


def format_model_step(results: dict[str, Any]) -> str:
    lines = [f"whole tiny-model decode step, {results['requests']} requests (peak = transient MiB beyond caches, "
             "weights and buffers)"]
    header = ["model", "mode", "context", "keys/chunk", "cache MiB", "KV read MiB", "peak MiB", "first run s",
              "step us", "us/MiB"]
    table = [header] + [
        [r["model"], r["mode"], str(r["context"]), str(r["attention_keys_per_chunk"]), f"{r['cache_mib']:.0f}",
         f"{r['kv_read_mib']:.1f}", f"{r['peak_mib']:.1f}" if "peak_mib" in r else "-", f"{r['first_run_s']:.1f}",
         f"{r['step_us']:.0f}", f"{r['us_per_kv_mib']:.1f}"]
        for r in results["rows"]
    ]
    lines += right_aligned(table)
    key = next(k for k in results if k.startswith("growth_"))
    for name, g in results[key].items():
        peak = f"peak x{g['peak']:.2f}, " if "peak" in g else ""
        lines.append(f"  {name} {key.removeprefix('growth_')}: {peak}time per byte x{g['time_per_byte']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The layer-attention and model-step cases on their own (``benchmarks/gpu_check.sh`` runs this)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-step-only", action="store_true", help="skip the layer-attention case")
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled", "cudagraph"), default=None,
                        help="model-step modes (default: eager, compiled, and cudagraph on CUDA)")
    parser.add_argument("--contexts", nargs="+", type=positive_int, default=CONTEXTS, metavar="N",
                        help=f"model-step contexts in tokens (default: {' '.join(map(str, CONTEXTS))})")
    parser.add_argument("--attention-keys-per-chunk", type=positive_int, default=None, metavar="N",
                        help="the models' attention_keys_per_chunk (default: theirs)")
    parser.add_argument("--indexer-regions-per-chunk", type=positive_int, default=None, metavar="N",
                        help="Step5's indexer_regions_per_chunk (default: its own)")
    parser.add_argument("--also-chunks", nargs=2, type=positive_int, default=None, metavar=("KEYS", "REGIONS"),
                        help="then run the model step at the largest context with these chunk sizes too")
    add_device_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results to PATH")
    args = parser.parse_args(argv)
    check_device_argument(parser, args.device)
    check_json_argument(parser, args.json)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if "cudagraph" in (args.modes or ()) and device.type != "cuda":
        parser.error("--modes cudagraph needs a CUDA device")
    torch.set_num_threads(args.threads)
    settings = Settings(device=device, quick=False)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    report: dict[str, Any] = {}
    if not args.model_step_only:
        report["attention"] = run_attention(settings, log)
        print(format_attention(report["attention"]), flush=True)
    report["model_step"] = run_model_step(
        settings,
        log,
        contexts=tuple(args.contexts),
        modes=tuple(args.modes) if args.modes else None,
        attention_keys_per_chunk=args.attention_keys_per_chunk,
        indexer_regions_per_chunk=args.indexer_regions_per_chunk,
    )
    print(format_model_step(report["model_step"]), flush=True)
    if args.also_chunks:
        keys, regions = args.also_chunks
        report["model_step_also_chunks"] = run_model_step(
            settings,
            log,
            contexts=(max(args.contexts),),
            modes=tuple(args.modes) if args.modes else None,
            attention_keys_per_chunk=keys,
            indexer_regions_per_chunk=regions,
        )
        print(format_model_step(report["model_step_also_chunks"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
