#!/usr/bin/env bash
# One prepared GPU check: every GPU test, op timings, the demo; one GPU, no network, under 6 minutes.
#   benchmarks/gpu_check.sh [OUT_DIR]      (OUT_DIR defaults to benchmarks/results/gpu_check, git-ignored)
# Prints a summary table at the end; exits non-zero when any part failed. The parts' limits add up to
# 350 s; other benchmark modules may append parts (each under its own limit; keep the sum under 6 minutes).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-$root/benchmarks/results/gpu_check}"
mkdir -p "$out"
py="${PYTHON:-python}"
[ -x "$root/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && py="$root/.venv/bin/python"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
declare -a names=() statuses=() seconds=()

part() {  # part NAME TIMEOUT_S COMMAND...
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$out/$name.log"
    names+=("$name"); statuses+=("$([ $rc -eq 0 ] && echo ok || echo "FAIL rc=$rc")"); seconds+=("$((SECONDS - start))")
}

"$py" - <<'PY' >"$out/env.txt" 2>&1
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU")
PY
cat "$out/env.txt"

# Every test runs on the GPU: op tests compare the real Triton kernels with the PyTorch kernels, model tests
# run the CUDA-graph captures and reduce-overhead replays, which skip on CPU.
part gpu_tests 180 "$py" -m pytest -q -x -p no:cacheprovider tests/ops tests/models tests/test_opcheck.py \
    --junitxml="$out/gpu_tests.xml"

# Op timings: each op's samples, CUDA-event timed, median of 50 launches after 5 warm-ups.
part op_timings 30 "$py" - "$out/op_timings.json" <<'PY'
import json, sys, torch
import stepops
from stepops.testing import op_samples
rows = []
for sample in op_samples("cuda"):
    op, args, kwargs = sample
    for _ in range(5):
        op(*args, **kwargs)
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); op(*args, **kwargs); end.record(); end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    times.sort()
    rows.append({"sample": sample.name, "median_us": round(times[len(times) // 2], 2)})
    print(f"{sample.name:60s} {rows[-1]['median_us']:8.2f} us")
json.dump(rows, open(sys.argv[1], "w"), indent=2)
PY

part demo 140 "$py" -m stepops demo --json "$out/demo.json"

# Every op against its byte floor, naive and compiled baselines, CUDA-graph replay; decoder layer steps
# eager/compiled/graph (python -m benchmarks; docs/performance.md). Adds 170 s to the limits above.
part benchmarks 170 "$py" -m benchmarks --quick --layers --json "$out/benchmarks.json"

echo
echo "=== summary ($out)"
printf "%-14s %-12s %8s\n" part status seconds
for i in "${!names[@]}"; do printf "%-14s %-12s %8s\n" "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"; done
grep -h -E "passed|failed|error" "$out/gpu_tests.log" | tail -n 1
for s in "${statuses[@]}"; do [ "$s" = ok ] || exit 1; done
