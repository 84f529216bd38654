"""The import direction of the router's packages, read from the syntax trees (lazy imports and
``TYPE_CHECKING`` imports count):

- nothing imports ``router.http`` except the router's top-level modules (``router/*.py``), nor
  do the dev tools;
- ``router.upstream`` and ``router.observability`` import nothing of the request path
  (``router.http``, ``dispatch``, ``routing``, ``health``, ``discovery``);
- ``connector`` never imports ``router``;
- ``router`` never imports the dev tools (``devstack``, ``bench``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.imports import imported_modules

REPO = Path(__file__).resolve().parents[3]
REQUEST_PATH = ("http", "dispatch", "routing", "health", "discovery")


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(
    sources: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    """``(importer, imported)`` for each module under ``sources`` (not under ``allowed``) that
    imports a module under one of ``forbidden``."""
    return sorted(
        (name, imported)
        for name, path in _modules(sources).items()
        if not any(_within(name, a) for a in allowed)
        for imported in imported_modules(name, path)
        if any(_within(imported, f) for f in forbidden)
    )


def _top_level(name: str) -> bool:
    """``router`` itself or one of ``router/*.py``."""
    parts = name.split(".")
    return parts == ["router"] or (
        len(parts) == 2 and (REPO / "router" / f"{parts[1]}.py").is_file()
    )


def test_the_rules_seeimported_modules() -> None:
    """The reader finds what it must (else every rule below would pass vacuously)."""
    imports = imported_modules("router.http.generate", REPO / "router" / "http" / "generate.py")
    assert {"router.dispatch.orchestrator", "router.runtime"} <= imports
    assert "router.http.app" in imported_modules("router.server", REPO / "router" / "server.py")


def test_only_the_top_level_imports_router_http() -> None:
    importers = [
        (name, imported)
        for name, imported in _violations("router", ("router.http",), allowed=("router.http",))
        if not _top_level(name)
    ]
    assert importers == []
    assert _violations("devtools", ("router.http",)) == []  # they start the router by its top level


@pytest.mark.parametrize("lower", ["router.upstream", "router.observability"])
def test_lower_layers_import_no_request_path_package(lower: str) -> None:
    forbidden = tuple(f"router.{p}" for p in REQUEST_PATH)
    found = [
        (name, imported)
        for name, imported in _violations("router", forbidden)
        if _within(name, lower)
    ]
    assert found == []


def test_the_connector_never_imports_the_router() -> None:
    assert _violations("connector", ("router",)) == []


def test_the_router_never_imports_the_dev_tools() -> None:
    assert _violations("router", ("devstack", "bench")) == []
