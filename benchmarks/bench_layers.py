"""Decoder layer steps: eager vs ``torch.compile(fullgraph=True)`` vs CUDA-graph replay (GPU only).

Each model (Step5: a sliding-window and a CSA layer; Inkling: a sliding-window and a global layer) runs
through ``stepops.models.runner.StepRunner``, one runner per mode, built from the same seed (same weights,
same block tables). Two times per case: ``step`` is the runner's public ``step`` (host-side schedule copy
into the fixed device buffers, then the forward), ``forward`` is the forward alone on filled buffers,
which is what CUDA-graph replay replaces. The first step's outputs of each mode are compared with eager
(reported, not asserted: the model tests own that check).

``moe_blocks``: one routed-expert block of each model at 64 experts top-8 (the small-step threshold is
``T <= 7``), eagerly, at decode sizes T = 1 and 4 (and 8, past the threshold, for scale): the chosen-experts
path a small step takes against the all-experts path on the same inputs and routing. On CPU both are timed
in turns (``side_by_side_us``), so the ratio comes from one run under one load.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Settings, median_us, right_aligned, side_by_side_us


def _configs(settings: Settings):
    from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model

    if settings.quick or settings.device.type == "cpu":
        return [("step5", Step5Model, Step5Config()), ("inkling", InklingModel, InklingConfig())]
    # A mid-sized shape for GPUs: big enough that the ops move real bytes, small enough to compile fast.
    shape = dict(hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128, intermediate_size=2816)
    inkling = InklingConfig(**shape, swa_num_heads=8, swa_num_kv_heads=2, swa_head_dim=128, moe_intermediate_size=704)
    return [("step5", Step5Model, Step5Config(**shape)), ("inkling", InklingModel, inkling)]


def _cases(settings: Settings) -> list[tuple[str, int, int]]:
    """``(name, requests, tokens per request)``."""
    if settings.quick:
        return [("decode_r1", 1, 1), ("decode_r16", 16, 1), ("verify_k3_r4", 4, 4)]
    return [("decode_r1", 1, 1), ("decode_r16", 16, 1), ("decode_r64", 64, 1), ("verify_k3_r16", 16, 4)]


def _rewind(runner, batch):
    """``runner``, with each request of ``batch`` fed up to its start (``StepRunner.assume_fed``), so the same
    step can run again: the first run needs no prefill of the ``prior`` positions (the timing does not
    depend on their values), and a repeat would step back over its own tokens, further than the Step5 rings
    keep for a verify step (4 tokens against k = 3). Host work of about 1 us per request, inside the timed
    step."""
    for request in batch:
        runner.assume_fed(request.slot, request.start)
    return runner


def run_layers(settings: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    from stepops.models.runner import COMPILED, CUDA_GRAPH, EAGER, ScheduledRequest, StepRunner

    device = settings.device
    modes = [EAGER, COMPILED] + ([CUDA_GRAPH] if device.type == "cuda" else [])
    cases = _cases(settings)
    max_requests = max(r for _, r, _ in cases)
    max_tokens = max(r * n for _, r, n in cases)
    prior = 100  # every request sits past a few regions and conv blocks
    results: dict[str, Any] = {"models": []}
    for model_name, model_cls, config in _configs(settings):
        gen = torch.Generator().manual_seed(0)
        batches = {
            name: [
                ScheduledRequest(i, prior + i, torch.randn(n, config.hidden_size, generator=gen).to(torch.bfloat16))
                for i in range(r)
            ]
            for name, r, n in cases
        }
        rows = {name: {"case": name, "requests": r, "tokens": r * n} for name, r, n in cases}
        first_outputs: dict[str, list[torch.Tensor]] = {}
        for mode in modes:
            log(f"  layers/{model_name}: {mode}")
            torch.manual_seed(0)
            with torch.device(device):
                model = model_cls(config)
            runner = StepRunner(model, max_requests=max_requests, max_model_len=prior + max_requests + 8,
                                max_tokens=max_tokens, device=device, mode=mode,
                                compile_backend=settings.compile_backend)
            runner.warm_up()
            for name, batch in batches.items():
                outputs = _rewind(runner, batch).step(batch)
                if name == cases[0][0]:
                    first_outputs[mode] = [o.float().cpu() for o in outputs]
                row = rows[name]
                row[f"{mode}_step_us"] = median_us(lambda: _rewind(runner, batch).step(batch), settings)
                size = runner.padded_size(row["tokens"])
                _rewind(runner, batch)._fill_buffers(batch)
                row[f"{mode}_forward_us"] = median_us(lambda: runner._run(size), settings)
            del runner, model
        for mode in modes[1:]:
            diff = max((a - b).abs().max().item() for a, b in zip(first_outputs[mode], first_outputs[EAGER]))
            results.setdefault("max_abs_diff_vs_eager", {})[f"{model_name}/{mode}"] = diff
        results["models"].append({"model": model_name, "config": repr(config), "modes": modes,
                                   "cases": list(rows.values())})
    results["moe_blocks"] = run_moe_blocks(settings, log)
    return results


MOE_EXPERTS, MOE_TOP_K = 64, 8


def run_moe_blocks(settings: Settings, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Chosen-experts vs all-experts routed work of one MoE block per model (see the module docstring)."""
    from stepops.models.inkling import InklingConfig, InklingMoE
    from stepops.models.step5 import Step5MoE
    from stepops.models.step5_config import Step5Config

    device = settings.device
    hidden, inner = (1024, 704) if device.type == "cuda" else (512, 256)
    step5_config = Step5Config(hidden_size=hidden, moe_num_experts=MOE_EXPERTS, moe_top_k=MOE_TOP_K,
                               moe_intermediate_size=inner)
    blocks = [
        ("inkling", InklingMoE(InklingConfig(hidden_size=hidden, n_routed_experts=MOE_EXPERTS,
                                             num_experts_per_tok=MOE_TOP_K), inner, torch.bfloat16)),
        ("step5", Step5MoE(step5_config, torch.bfloat16, step5_config.swiglu_limit)),
    ]
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, moe in blocks:
        moe = moe.to(device)
        log(f"  moe block/{name}: {MOE_EXPERTS} experts top-{MOE_TOP_K}, hidden {hidden}, intermediate {inner}")
        for tokens in (1, 4, 8):
            x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
            with torch.inference_mode():
                if name == "inkling":
                    weights, _, chosen = moe.gate.route(x)
                    small = lambda: moe.chosen_experts(x, weights, chosen)  # noqa: E731
                    full = lambda: moe.all_experts(x, weights)  # noqa: E731
                else:
                    _, ids = moe.route(x)
                    small = lambda: moe.chosen_experts(x, ids)  # noqa: E731
                    full = lambda: moe.all_experts(x, ids)  # noqa: E731
                equal = torch.equal(small(), full())
                if device.type == "cuda":
                    small_us, full_us = median_us(small, settings), median_us(full, settings)
                else:
                    small_us, full_us = side_by_side_us([small, full], settings)
            rows.append({"model": name, "tokens": tokens, "takes_small_path": tokens <= moe.small_step_max_tokens,
                         "chosen_experts_us": small_us, "all_experts_us": full_us,
                         "all_over_chosen": full_us / small_us, "bitwise_equal": equal})
    return rows


def format_layers(results: dict[str, Any]) -> str:
    lines = ["decoder layer steps (us; step = host schedule copy + forward, forward = forward alone)"]
    for model in results["models"]:
        header = ["case", "R", "T"] + [f"{m} {what}" for m in model["modes"] for what in ("step", "fwd")]
        rows = [header]
        for c in model["cases"]:
            rows.append([c["case"], str(c["requests"]), str(c["tokens"])] + [
                f"{c[f'{m}_{what}_us']:.1f}" for m in model["modes"] for what in ("step", "forward")])
        lines.append(f"{model['model']}")
        lines += right_aligned(rows)
    diffs = ", ".join(f"{k} {v:.3g}" for k, v in results.get("max_abs_diff_vs_eager", {}).items())
    lines.append(f"  first-step max |output - eager|: {diffs}")
    if results.get("moe_blocks"):
        lines.append(f"routed experts of one MoE block, {MOE_EXPERTS} experts top-{MOE_TOP_K} (us; eager)")
        lines.append("  model     T  small path  chosen experts  all experts  all / chosen  bitwise")
        for r in results["moe_blocks"]:
            lines.append(f"  {r['model']:<8}{r['tokens']:>2}  {str(r['takes_small_path']):>10}  "
                         f"{r['chosen_experts_us']:>14.1f}  {r['all_experts_us']:>11.1f}  "
                         f"{r['all_over_chosen']:>12.2f}  {r['bitwise_equal']}")
    return "\n".join(lines)
