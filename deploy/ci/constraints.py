"""Print the pins of ``constraints.txt``: every distribution the router (extras dev, tracing)
and the devtools (extra bench) need, at the version installed in the running environment.

    .venv/bin/python deploy/ci/constraints.py > constraints.txt

vLLM, NIXL and what only they need are left out: their own exact pins (the ``cpu`` extras)
decide those, and the router's image has none of them.
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = {"disagg-router": {"dev", "tracing"}, "disagg-router-devtools": {"bench"}}
HEADER = """\
# What CI (tests/run.sh), the demo (deploy/local/demo.sh) and the images install: `pip install -c
# constraints.txt ...`. The router's and devtools' dependencies (extras dev, tracing, bench), at
# the versions tested together. Regenerate after changing a dependency, from a venv set up by
# tests/run.sh: .venv/bin/python deploy/ci/constraints.py > constraints.txt
# The newest versions pyproject.toml allows are checked by `SUITES=latest bash tests/run.sh`."""


def _wanted(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": extra}) for extra in extras or {""})


def closure() -> dict[str, str]:
    """Canonical name -> installed version, for everything :data:`ROOTS` need."""
    versions: dict[str, str] = {}
    todo = [(name, set(extras)) for name, extras in ROOTS.items()]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, frozenset(extras)) in done:
            continue
        done.add((key, frozenset(extras)))
        dist = metadata.distribution(name)
        versions[key] = dist.version
        for raw in dist.requires or []:
            req = Requirement(raw)
            if _wanted(req, extras):
                todo.append((req.name, set(req.extras)))
    return {k: v for k, v in versions.items() if k not in ROOTS}


def main() -> None:
    print(HEADER)
    for name, version in sorted(closure().items()):
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
