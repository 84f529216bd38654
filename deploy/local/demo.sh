#!/usr/bin/env bash
# The README's demo command: set up .venv (like tests/run.sh), then run `disagg-demo`:
# a tiny model, real vLLM CPU prefill (core 0) and decode (core 1) instances with a NIXL push
# connector, the router in push mode, and one timed chat request. Everything is torn down at
# the end, on error and on Ctrl-C. Extra arguments go to the demo (see `disagg-demo -h`).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$(pwd)
VENV="$ROOT/.venv"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[demo.sh] creating $VENV"
    python3 -m venv "$VENV"
fi
if [[ -z "${SKIP_SETUP:-}" ]]; then
    echo "[demo.sh] installing the router and the devtools with vLLM CPU (first time: a few minutes)"
    "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt" -e "$ROOT[cpu]" -e "$ROOT/devtools[cpu]"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# vLLM's and torch's compile caches in the checkout's one cache directory, as tests/run.sh does.
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$ROOT/.cache/vllm}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ROOT/.cache/torchinductor}

if command -v flock >/dev/null 2>&1; then
    # Never overlap with other real-vLLM runs on this machine (waits for the lock).
    exec flock /tmp/vllm-e2e.lock "$VENV/bin/disagg-demo" "$@"
fi
exec "$VENV/bin/disagg-demo" "$@"
