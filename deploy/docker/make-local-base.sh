#!/usr/bin/env bash
# Make a local Debian bookworm base image (python3 + venv + CA bundle) with debootstrap and
# `docker import`, for machines that reach the Debian mirror and PyPI but no container registry.
# It stands in for `python:3.11-slim` (router) and as the root of the vLLM CPU base image.
#
# Usage: deploy/docker/make-local-base.sh [TAG]   (default TAG: disagg-deploy/debian-base:bookworm)
# Idempotent: does nothing when TAG exists; the rootfs tarball is cached in $DISAGG_DEPLOY_CACHE.
# Needs root, debootstrap and a running docker engine.
set -euo pipefail

TAG="${1:-disagg-deploy/debian-base:bookworm}"
CACHE="${DISAGG_DEPLOY_CACHE:-/var/tmp/disagg-deploy}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
PACKAGES="python3,python3-venv,ca-certificates"  # kept minimal: the router image builds on it

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG exists"
    exit 0
fi

mkdir -p "$CACHE"
tarball="$CACHE/bookworm-rootfs.tar"
if [[ ! -s "$tarball" ]]; then
    rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$rootfs" "$MIRROR"
    # The host's CA bundle, so pip and apt inside builds trust whatever the host trusts.
    cp "$CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc "$rootfs"/usr/share/man
    tar -C "$rootfs" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
fi

docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$tarball" "$TAG"
echo "imported $TAG"
