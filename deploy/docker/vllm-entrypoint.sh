#!/bin/sh
# Entrypoint of the vLLM images (P and D): advertise this container's own address to peers, then
# exec the command. vLLM's NIXL side channel and our connector's peers must reach this instance by
# an address that is routable from other containers/pods, never 127.0.0.1. Values set by the
# caller (compose, k8s downward API) win.
set -eu
if [ -z "${VLLM_HOST_IP:-}" ]; then
    VLLM_HOST_IP="$(hostname -i | cut -d' ' -f1)"
    export VLLM_HOST_IP
fi
if [ -z "${VLLM_NIXL_SIDE_CHANNEL_HOST:-}" ]; then
    VLLM_NIXL_SIDE_CHANNEL_HOST="$VLLM_HOST_IP"
    export VLLM_NIXL_SIDE_CHANNEL_HOST
fi
exec "$@"
