"""A module docstring's "Who calls it:" names real callers.

For every module of the router, the connector and the dev tools whose docstring says
``Who calls it: ...``, each fully qualified Sphinx reference (``:mod:``, ``:func:``, ``:class:``,
``:meth:``) in that sentence must name a module that imports this one (read from its syntax
tree, lazy imports included). References to the module's own names are not checked. In the
router that sentence must name at least one caller so (prose may explain around it); callers
outside the repository (vLLM, console scripts, people) are prose in the connector and dev tools.
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.support.imports import ROOTS, imported_modules, module_file

WHO_CALLS = re.compile(r"Who calls it:(.+?)(?:\.\s|\.$|\n\s*\n)", re.DOTALL)
REFERENCE = re.compile(r":(?:mod|func|class|meth):`~?([\w.]+)`")


def _module_of(reference: str) -> str | None:
    """The longest prefix of ``reference`` that is one of our modules (None: not ours)."""
    parts = reference.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if module_file(name) is not None:
            return name
    return None


def _modules() -> list[str]:
    names = []
    for top, root in ROOTS.items():
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _imports(name: str) -> set[str]:
    path = module_file(name)
    assert path is not None
    return imported_modules(name, path)


def _who_calls(name: str) -> str | None:
    """The sentence after ``Who calls it:`` in ``name``'s docstring (None: it has none)."""
    path = module_file(name)
    assert path is not None
    match = WHO_CALLS.search(ast.get_docstring(ast.parse(path.read_text())) or "")
    return None if match is None else match.group(1)


def _named_callers(name: str) -> list[str]:
    sentence = _who_calls(name) or ""
    modules = (_module_of(ref) for ref in REFERENCE.findall(sentence))
    return sorted({m for m in modules if m is not None and m != name})


CASES = [(name, caller) for name in _modules() for caller in _named_callers(name)]


def test_router_docstrings_name_their_callers_as_references() -> None:
    unchecked = [
        name
        for name in _modules()
        if name.startswith("disagg_router.router")
        and _who_calls(name) is not None
        and not _named_callers(name)
    ]
    assert unchecked == [], "name the calling module as :mod:`disagg_router....` in 'Who calls it:'"


@pytest.mark.parametrize(("module", "caller"), CASES, ids=[f"{m}<-{c}" for m, c in CASES])
def test_a_named_caller_imports_the_module(module: str, caller: str) -> None:
    assert module in _imports(caller), f"{module} says {caller} calls it; {caller} never imports it"
