"""Why ``paged_attention`` does not use FlexAttention (issue 14): its CPU memory at decode, eager and compiled.

    python benchmarks/eval_flex_attention.py

One decode query per request (64 requests, 4 query heads, 16-dim heads) over 1k and 16k keys, with a
causal block mask and a relative-position ``score_mod`` (Inkling's bias), GQA (2 KV heads) and without.
Prints the peak transient memory (:func:`stepops.testing.memory.peak_transient_bytes`) of eager ``flex_attention`` and
of ``torch.compile(flex_attention, fullgraph=True)``, and whether the compile broke the graph. This is the
contiguous (non-paged) case, the best case for FlexAttention: its paged form
(``torch.nn.attention.experimental._paged_attention``) adds ``[B, H, rows, n_pages]`` block indices over
the whole physical cache.
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from stepops.testing.memory import peak_transient_bytes

REQUESTS, HEADS, HEAD_DIM = 64, 4, 16


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    compiled = torch.compile(flex_attention, fullgraph=True)
    for kv_heads in (2, 4):
        for keys in (1024, 16384):
            q = torch.randn(REQUESTS, HEADS, 1, HEAD_DIM)
            k, v = (torch.randn(REQUESTS, kv_heads, keys, HEAD_DIM) for _ in range(2))
            position = torch.full((REQUESTS,), keys - 1)

            def causal(b, h, q_idx, kv_idx):
                return kv_idx <= position[b]

            def bias(score, b, h, q_idx, kv_idx):
                return score + torch.where(position[b] - kv_idx < 4, 0.5, 0.0)

            mask = create_block_mask(causal, REQUESTS, None, 1, keys, device="cpu")
            kwargs = dict(score_mod=bias, block_mask=mask, enable_gqa=kv_heads != HEADS)
            eager = peak_transient_bytes(lambda: flex_attention(q, k, v, **kwargs))
            counters.clear()
            compiled(q, k, v, **kwargs)
            breaks = sum(counters["graph_break"].values())
            peak = peak_transient_bytes(lambda: compiled(q, k, v, **kwargs))
            scores = REQUESTS * HEADS * keys * 4
            print(f"Hkv={kv_heads} keys={keys}: eager {eager / 2**20:.1f} MiB, compiled {peak / 2**20:.1f} MiB, "
                  f"graph breaks {breaks}; fp32 [B, Hq, 1, keys] scores are {scores / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
