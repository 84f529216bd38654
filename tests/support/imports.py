"""A module's imports, read from its syntax tree: the one reader of the layout and docstring tests.

Lazy imports inside functions and ``TYPE_CHECKING`` imports count: the tree is walked whole.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {
    "disagg_router": REPO,
    "devstack": REPO / "devtools",
    "bench": REPO / "devtools",
}
"""Where each of our top-level packages lives."""


def module_file(name: str) -> Path | None:
    """The source file of our module ``name`` (a package's ``__init__.py``); None if not ours."""
    parts = name.split(".")
    root = ROOTS.get(parts[0])
    if root is None:
        return None
    base = root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(name: str, path: Path) -> set[str]:
    """Every module that module ``name`` (source at ``path``) imports: ``import a`` gives ``a``;
    ``from a import b`` gives ``a``, and ``a.b`` when that is one of our modules. Relative
    imports are resolved against ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(
                f"{base}.{alias.name}"
                for alias in node.names
                if module_file(f"{base}.{alias.name}") is not None
            )
    return found
