"""Peak transient memory of a call on the CPU allocator (tests and benchmarks of paged attention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_transient_bytes(fn: Callable[[], Any]) -> int:
    """Peak of (bytes allocated - bytes freed) while ``fn()`` runs: memory beyond what existed before it.

    Reads ``torch.profiler``'s memory events, which every CPU allocation through c10's allocator reports
    (ATen ops and Inductor's generated code alike), in time order.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
