"""Layer attention over the paged KV cache: the dense gather (old) vs ``paged_attention`` (new).

One decode step of 64 requests (one token each) at 1k, 4k and 16k-token contexts, with the tiny models'
head shapes (4 query heads, 2 KV heads of 16 + 16, block size 16, bf16 cache, global attention: the whole
context is read). Per provider and context:

- ``peak_eager_mib`` / ``peak_compiled_mib``: peak transient memory of one call, beyond the caches,
  weights and inputs that exist before it: the running sum of the CPU allocator's allocations minus frees
  during the call (``torch.profiler`` memory events, which every ATen and Inductor allocation reports),
  at its maximum.
- ``compiled_us``: median time of the ``torch.compile(fullgraph=True)`` call; ``kv_read_mib``: the KV bytes
  the step must read (every request's context once); ``us_per_kv_mib``: time per MiB read, flat when time
  grows no faster than bytes read.

The dense path gathers ``[T, max_blocks * N, H, D + Dv]`` and upcasts it: its memory grows with the
context. The new path walks the table in chunks of ``keys_per_chunk`` keys: its memory is one chunk.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Settings, median_us
from stepops.testing.memory import peak_transient_bytes

NUM_REQUESTS = 64
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 16  # the tiny Step5/Inkling configs
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
                "peak_eager_mib": peak_transient_bytes(lambda: fn(*args)) / 2**20,
                "peak_compiled_mib": peak_transient_bytes(lambda: compiled(*args)) / 2**20,
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
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  " + "  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table]
    key = next(k for k in results if k.startswith("growth_"))
    for name, g in results[key].items():
        lines.append(f"  {name} {key.removeprefix('growth_')}: peak eager x{g['peak_eager']:.2f}, "
                     f"peak compiled x{g['peak_compiled']:.2f}, time per byte x{g['time_per_byte']:.2f}")
    return "\n".join(lines)
