"""The import direction of the router's packages, read from the syntax trees (lazy imports and
``TYPE_CHECKING`` imports count); ``router`` below is ``disagg_router.router``:

- nothing imports ``router.http`` except the router's top-level modules (``router/*.py``), nor
  do the dev tools;
- ``router.upstream`` and ``router.observability`` import nothing of the request path
  (``router.http``, ``dispatch``, ``routing``, ``health``, ``discovery``);
- ``router.instances`` (the bottom layer: an instance's state, registry, admission, breaker, load,
  learned identity) imports of the router only ``config``, ``errors``, ``observability`` and
  itself;
- ``router.routing`` imports neither ``health`` nor ``dispatch``; ``health`` and ``dispatch``
  never import each other;
- ``router.http`` makes no upstream call: of ``router.upstream`` it imports only the JSON codec
  and the body rewriting (the calls go through ``dispatch``);
- no two files of the router import each other, directly or through others;
- ``disagg_router.connector`` never imports the router;
- the router never imports the dev tools (``devstack``, ``bench``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.imports import imported_modules

REPO = Path(__file__).resolve().parents[3]
ROUTER = "disagg_router.router"
CONNECTOR = "disagg_router.connector"
REQUEST_PATH = ("http", "dispatch", "routing", "health", "discovery")


def _r(name: str) -> str:
    """The router's module ``name`` (``"http"`` -> ``disagg_router.router.http``)."""
    return f"{ROUTER}.{name}"


def _path(package: str) -> Path:
    """The folder of a dotted package name."""
    return REPO.joinpath(*package.split("."))


def _modules(package: str) -> dict[str, Path]:
    """Every module under ``package`` (a dotted name, or a folder such as ``devtools``)."""
    out = {}
    for path in sorted(_path(package).rglob("*.py")):
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
    """The router package itself or one of its top-level modules (``router/*.py``)."""
    if name == ROUTER:
        return True
    rest = name.removeprefix(ROUTER + ".")
    return rest != name and "." not in rest and (_path(ROUTER) / f"{rest}.py").is_file()


def test_the_rules_see_imported_modules() -> None:
    """The reader finds what it must (else every rule below would pass vacuously)."""
    generate = _path(_r("http")) / "generate.py"
    imports = imported_modules(_r("http.generate"), generate)
    assert {_r("dispatch.orchestrator"), _r("runtime")} <= imports
    assert _r("http.app") in imported_modules(_r("server"), _path(ROUTER) / "server.py")
    assert _top_level(_r("server")) and not _top_level(_r("http.app"))


def test_only_the_top_level_imports_router_http() -> None:
    http = _r("http")
    importers = [
        (name, imported)
        for name, imported in _violations(ROUTER, (http,), allowed=(http,))
        if not _top_level(name)
    ]
    assert importers == []
    assert _violations("devtools", (http,)) == []  # they start the router by its top level


@pytest.mark.parametrize("lower", [_r("upstream"), _r("observability")])
def test_lower_layers_import_no_request_path_package(lower: str) -> None:
    forbidden = tuple(_r(p) for p in REQUEST_PATH)
    found = [
        (name, imported)
        for name, imported in _violations(ROUTER, forbidden)
        if _within(name, lower)
    ]
    assert found == []


def test_instances_are_the_bottom_layer() -> None:
    allowed = tuple(_r(p) for p in ("instances", "config", "errors", "observability"))
    found = [
        (name, imported)
        for name, path in _modules(_r("instances")).items()
        for imported in imported_modules(name, path)
        if _within(imported, ROUTER) and not any(_within(imported, a) for a in allowed)
    ]
    assert found == []


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        (_r("routing"), (_r("health"), _r("dispatch"))),
        (_r("health"), (_r("dispatch"),)),
        (_r("dispatch"), (_r("health"),)),
    ],
)
def test_package_never_imports(importer: str, forbidden: tuple[str, ...]) -> None:
    found = [(n, i) for n, i in _violations(ROUTER, forbidden) if _within(n, importer)]
    assert found == []


def test_http_makes_no_upstream_call() -> None:
    # ``from disagg_router.router.upstream import codec`` reads as the package and its module
    allowed = (_r("upstream"), _r("upstream.codec"), _r("upstream.rewrite"))
    found = [
        (name, imported)
        for name, imported in _violations(ROUTER, (_r("upstream"),))
        if _within(name, _r("http")) and imported not in allowed
    ]
    assert found == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_circle() -> None:
    """The circle finder sees one through three modules, and none in a chain."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_between_files_of_the_router() -> None:
    modules = _modules(ROUTER)
    graph = {
        name: {i for i in imported_modules(name, path) if i in modules and i != name}
        for name, path in modules.items()
    }
    assert _cycles(graph) == []


def test_the_connector_never_imports_the_router() -> None:
    assert _violations(CONNECTOR, (ROUTER,)) == []
    assert _modules(CONNECTOR)  # the rule reads the connector's files


def test_the_router_never_imports_the_dev_tools() -> None:
    assert _violations(ROUTER, ("devstack", "bench")) == []
