#!/usr/bin/env bash
# One prepared GPU check: every GPU test, op timings, the demo; one GPU, no network, under 7.5 minutes.
#   benchmarks/gpu_check.sh [OUT_DIR]      (OUT_DIR defaults to benchmarks/results/gpu_check, git-ignored)
# Prints a summary table at the end; exits non-zero when any part failed. The parts' limits add up to
# 445 s (under 7.5 minutes); a new part must fit in the same total.
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

if ! "$py" - <<'PY' >"$out/env.txt" 2>&1
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU")
PY
then
    cat "$out/env.txt" >&2
    echo "gpu_check.sh: $py cannot import torch and triton; set PYTHON, or run scripts/run.sh once" >&2
    exit 2
fi
cat "$out/env.txt"
# Without a GPU every part would run its limit out on CPU fallbacks: stop here instead.
if grep -q "^device NO GPU" "$out/env.txt"; then
    echo "gpu_check.sh: no CUDA device visible (see $out/env.txt); run it on a GPU machine, or scripts/run.sh test here" >&2
    exit 2
fi

# Every test runs on the GPU: op tests compare the real Triton kernels with the PyTorch kernels, model tests
# run the CUDA-graph captures and reduce-overhead replays, which skip on CPU. The Inkling oracle tests run
# transformers on CPU (CI does that); GPU machines may not have transformers installed, and both modules import it.
part gpu_tests 150 "$py" -m pytest -q -p no:cacheprovider tests/ops tests/models tests/test_opcheck.py \
    --ignore=tests/models/test_inkling_oracle.py --ignore=tests/models/test_inkling_multimodal.py \
    --junitxml="$out/gpu_tests.xml"

part demo 110 "$py" -m stepops demo --json "$out/demo.json"

# Op timings: every op against its byte floor, naive and compiled baselines, with and without CUDA-graph
# replay (python -m benchmarks; docs/performance.md). Layer steps are timed by the demo above.
part benchmarks 95 "$py" -m benchmarks --quick --json "$out/benchmarks.json"

# Attention that scales with the context (docs/models.md): one decode step of 64 requests at 1k, 4k and 16k
# tokens through both tiny models, eager (peak memory beyond the caches) and replayed from a CUDA graph
# (step time against the KV bytes read). No Inductor compile: six graph captures, one per model and context.
part model_step_attention 90 "$py" -m benchmarks.bench_attention --model-step-only --modes eager cudagraph \
    --json "$out/model_step_attention.json"

echo
echo "=== summary ($out)"
printf "%-22s %-12s %8s\n" part status seconds
for i in "${!names[@]}"; do printf "%-22s %-12s %8s\n" "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"; done
grep -h -E "passed|failed|error" "$out/gpu_tests.log" | tail -n 1
for s in "${statuses[@]}"; do [ "$s" = ok ] || exit 1; done
