#!/usr/bin/env bash
# One prepared GPU check (one GPU, no network): the GPU tests, op timings, model-step attention, the demo.
#   benchmarks/gpu_check.sh [OUT_DIR [PART ...]]
# OUT_DIR defaults to benchmarks/results/gpu_check (git-ignored). PARTs run in the order given; the default
# is every part, most telling first: gpu_tests benchmarks attention demo. Name parts to rerun just those.
#
# Sized for a lent machine (15 minutes of device time in all, its start included; one command at most
# 10 minutes). Measured on an H200 (torch 2.11, Triton 3.6, 2026-12-04): gpu_tests ~250 s, benchmarks
# ~100 s (Triton and Inductor compiles of every case), attention 19 s (before its 16k steps at larger chunks,
# eager and replayed), demo ~65 s (two Inductor compiles of ~25 s). The limits, 565 s in all, leave a
# margin over those and fit one command: a full run fits with the machine's start (~30 s), then a rerun of a
# part that failed (gpu_check.sh OUT_DIR demo) while the machine is still warm. OUT_DIR gets at most 8 files
# (summary.txt, a log per part, the JSON of three parts), which is what comes back from such a machine. A
# part that runs out its limit is interrupted like Ctrl-C (SIGINT), so pytest still prints its failures and
# counts, and summary.txt is rewritten after every part: a run stopped from outside still leaves what it
# measured.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
all_parts=(gpu_tests benchmarks attention demo)
is_part() { [[ " ${all_parts[*]} " == *" $1 "* ]]; }
if [ $# -gt 0 ] && [[ "$1" == -* ]]; then  # --help, or an option: print the usage above
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"  # the header comment
    [[ "$1" == -h || "$1" == --help ]] && exit 0
    echo "gpu_check.sh: no options; OUT_DIR must not start with '-', got '$1'" >&2; exit 2
fi
if [ $# -gt 0 ] && is_part "$1"; then
    echo "gpu_check.sh: '$1' is a part; the first argument is OUT_DIR (gpu_check.sh OUT_DIR $*)" >&2; exit 2
fi
out="${1:-$root/benchmarks/results/gpu_check}"
[ $# -gt 0 ] && shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=("${all_parts[@]}")
for part in "${parts[@]}"; do
    is_part "$part" || { echo "gpu_check.sh: unknown part '$part' (${all_parts[*]})" >&2; exit 2; }
done
# The tests that differ on a GPU, GPU-only ones first: CUDA-graph capture and replay, the launchers' device
# guard, the model steps with the Triton kernels against the recomputes, and every op test, where the Triton
# kernels run compiled instead of under the interpreter. The rest of the suite runs the same CPU code on any
# machine (CI runs it), as does tests/ops' Inductor compile of the PyTorch kernels, which is CPU code and
# the slowest op test (~40 s). These modules import neither transformers nor expecttest, which a GPU machine may
# lack (tests/test_gpu_check_script.py checks that they collect without them).
gpu_test_paths=(tests/models/test_cudagraph.py tests/models/test_gpu_hazards.py tests/models/test_incremental.py tests/test_storage.py tests/ops --ignore=tests/ops/test_torch_kernels_compiled.py)
mkdir -p "$out"
# The GPU machines' interpreter is python3 (with their CUDA torch); a checkout's .venv holds a CPU wheel.
py="${PYTHON:-$(command -v python3 || command -v python || echo python3)}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# stepops' launches state FP fusion; Inductor's generated Triton kernels leave it to Triton's default, which
# Triton 3.9 warns that 3.10 changes: pin today's default (on) unless the caller set one.
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
summary="$out/summary.txt"
declare -a done_parts=()

if ! "$py" - <<'PY' >"$summary" 2>&1
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU")
PY
then
    cat "$summary" >&2
    echo "gpu_check.sh: $py cannot import torch and triton; set PYTHON to the interpreter that has them" >&2
    exit 2
fi
environment="$(cat "$summary")"
echo "$environment"
# Without a GPU every part would run its limit out on CPU fallbacks: stop here instead.
if grep -q "^device NO GPU" "$summary"; then
    echo "gpu_check.sh: no CUDA device visible (see $summary); run it on a GPU machine, or scripts/run.sh test here" >&2
    exit 2
fi

write_summary() {
    {
        echo "$environment"
        printf "%-12s %-12s %8s\n" part status seconds
        printf "%s\n" "${done_parts[@]}"
        # The tests' counts and failures once this run has run them (an earlier run's log may be there).
        [[ " ${done_parts[*]} " == *" gpu_tests "* ]] \
            && grep -h -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR) " "$out/gpu_tests.log" | tail -n 40
    } >"$summary"
}

run_part() {  # run_part NAME LIMIT_S COMMAND...
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout -s INT -k 20 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$out/$name.log"
    local status=ok
    [ $rc -eq 0 ] || status="FAIL rc=$rc"
    [ $rc -eq 124 ] && status="TIMEOUT"
    [ $rc -eq 137 ] && status="TIMEOUT, killed"  # SIGINT unanswered for 20 s (e.g. inside a CUDA call)
    done_parts+=("$(printf "%-12s %-12s %8s" "$name" "$status" "$((SECONDS - start))")")
    write_summary
    [ $rc -eq 0 ]
}

failed=0
for part in "${parts[@]}"; do
    case "$part" in
        gpu_tests)
            run_part gpu_tests 270 "$py" -m pytest -q -p no:cacheprovider -rfE --durations=10 \
                "${gpu_test_paths[@]}" || failed=1
            ;;
        benchmarks)
            # Every op against its byte floor, naive and compiled baselines, with and without CUDA-graph
            # replay, and the host path against the no-op twins (python -m benchmarks; docs/performance.md).
            run_part benchmarks 140 "$py" -m benchmarks --quick --json "$out/benchmarks.json" || failed=1
            ;;
        attention)
            # Attention that scales with the context (docs/models.md): one decode step of 64 requests at 1k,
            # 4k and 16k tokens through both tiny models, eager and replayed from a CUDA graph; then at 16k
            # with 8x the default chunk sizes (docs/models.md, "Chunk sizes": fewer, larger kernels).
            run_part attention 45 "$py" -m benchmarks.bench_attention --model-step-only --modes eager cudagraph \
                --also-chunks 8192 1024 --json "$out/attention.json" || failed=1
            ;;
        demo)
            # Both layer stacks through the scripted workload: eager, compiled and CUDA graphs, checked.
            run_part demo 110 "$py" -m stepops demo --json "$out/demo.json" || failed=1
            ;;
    esac
done

echo
echo "=== summary ($summary)"
cat "$summary"
exit $failed
