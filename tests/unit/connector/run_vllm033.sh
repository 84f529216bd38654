#!/usr/bin/env bash
# Run the connector's scheduler-side and import/API unit tests against vLLM 0.33.0.
#
# vLLM 0.33.0 ships only a CUDA wheel; it imports on CPU torch 2.13 when installed --no-deps into
# a separate venv together with its requirements minus torch and the GPU-only packages.
#   bash tests/unit/connector/run_vllm033.sh            # venv in $V033 (default .cache/vllm033-venv)
#   bash tests/unit/connector/run_vllm033.sh --prepare  # only build the venv (tests/run.sh does
#                                                       # it early, on the core the fast suite
#                                                       # leaves idle)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
ROOT=$(pwd)
V033=${V033:-$ROOT/.cache/vllm033-venv}
GPU_ONLY='^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer|apache-tvm|tilelang|nvidia|nvtx|fastsafetensors|instanttensor|quack|tokenspeed|humming)'
# What the venv is built from: a venv built from other inputs (or half built) is built again.
# pytest-asyncio and pytest-timeout: pyproject's pytest config names their options.
TEST_REQS=(pytest pytest-asyncio pytest-timeout "llguidance<1.8.0,>=1.7.0" "xgrammar==0.2.8")
inputs=$(printf '%s\n' "vllm==0.33.0" "torch==2.13.0+cpu" "$GPU_ONLY" "${TEST_REQS[@]}" \
    "$(python3 --version)" | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$V033/.disagg-inputs" 2>/dev/null)" != "$inputs" ]]; then
    if [[ -e "$V033" && ! -f "$V033/pyvenv.cfg" ]]; then
        echo "$V033 is not a venv: left alone" >&2
        exit 1
    fi
    rm -rf "$V033"
    python3 -m venv "$V033"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$V033/bin/pip" download -q vllm==0.33.0 --no-deps -d "$work"
    wheel=$(ls "$work"/vllm-0.33.0-*.whl)
    "$V033/bin/python" -c 'import sys, zipfile; sys.stdout.write(zipfile.ZipFile(sys.argv[1]).read(
        "vllm-0.33.0.dist-info/METADATA").decode())' "$wheel" | sed -n 's/^Requires-Dist: //p' \
        | grep -v 'extra ==' | grep -v 'platform_machine == "s390x"$' | grep -Ev "$GPU_ONLY" \
        > "$work/reqs.txt"
    # torch 2.13 CPU (the project's), pytest, then vLLM itself without its (GPU) pins.
    # (PIP_FIND_LINKS on these machines holds the CPU build of torch 2.13.)
    "$V033/bin/pip" install -q "torch==2.13.0+cpu" || "$V033/bin/pip" install -q "torch==2.13.0"
    "$V033/bin/pip" install -q -r "$work/reqs.txt" "${TEST_REQS[@]}"
    "$V033/bin/pip" install -q --no-deps "$wheel"
    echo "$inputs" > "$V033/.disagg-inputs"
fi
"$V033/bin/python" -c 'import vllm; assert vllm.__version__.startswith("0.33"), vllm.__version__'
[[ "${1:-}" == "--prepare" ]] && exit 0
PYTHONPATH="$ROOT" "$V033/bin/python" -m pytest -q -p no:cacheprovider \
    tests/unit/connector/test_scheduler.py tests/unit/connector/test_facade_api.py \
    tests/unit/connector/test_protocol.py tests/unit/connector/test_producer.py \
    tests/unit/connector/test_consumer.py
