#!/usr/bin/env bash
# The `latest` suite of tests/run.sh: the router with the NEWEST dependency versions its
# pyproject.toml allows (no constraints.txt), so a release inside the bounds that breaks it shows
# up here first. A side venv with the router (extras dev) and the devtools (no vLLM); then the
# router's unit tests and the integration tests that pin the libraries' behaviour the router
# relies on (uvicorn's protocol, httpx's client, tracing off loading no OpenTelemetry).
#   bash tests/run_latest.sh          # venv in $LATEST_VENV (default .cache/latest-venv)
#   bash tests/run_latest.sh --prepare  # only install (tests/run.sh does it early)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV=${LATEST_VENV:-$ROOT/.cache/latest-venv}
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade --upgrade-strategy eager \
    -e "$ROOT[dev]" -e "$ROOT/devtools"
[[ "${1:-}" == "--prepare" ]] && exit 0
"$VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(fastapi|starlette|uvicorn|httpx|httpx-aiohttp|aiohttp|pydantic|msgspec)=='
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not vllm and not nixl and not docker" \
    -n 2 --dist loadfile \
    tests/unit/router tests/integration/router/test_router_edge.py \
    tests/integration/router/test_router_tracing.py tests/integration/router/test_router_workers.py
