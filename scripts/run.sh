#!/usr/bin/env bash
# Set up (or reuse) .venv in the checkout, then run one job:
#   scripts/run.sh demo [args]   the main job: python -m stepops demo
#   scripts/run.sh test [args]   the test suite
#   scripts/run.sh <any stepops CLI args>, e.g. scripts/run.sh layout step5
# Idempotent. Installs the CPU wheel torch==2.13.0 only when no torch is importable in the venv, because
# an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="$venv/bin/python"

[ -x "$py" ] || python3 -m venv "$venv"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    # The CPU wheel: this project's machines keep it on disk as 2.13.0+cpu; elsewhere PyPI's Linux wheel
    # is the CUDA build, so take it from PyTorch's CPU index; on macOS PyPI's wheel is the CPU build.
    "$py" -m pip install --quiet "torch==2.13.0+cpu" 2>/dev/null \
        || "$py" -m pip install --quiet "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
        || "$py" -m pip install --quiet "torch==2.13.0"
fi
stamp="$venv/.stepops-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$py" -m pip install --quiet -e ".[test]"
    touch "$stamp"
fi

job="${1:-demo}"
[ $# -gt 0 ] && shift
case "$job" in
    test)
        # CPU machines run the Triton kernels under the interpreter; tests/conftest.py sets
        # TRITON_INTERPRET=1 itself when no GPU is visible.
        exec "$py" -m pytest -q "$@"
        ;;
    *)
        exec "$py" -m stepops "$job" "$@"
        ;;
esac
