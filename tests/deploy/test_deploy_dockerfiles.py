"""The Dockerfiles: base images are build arguments, and whatever they COPY from the repository
root survives /.dockerignore (which sends an allow-list, not the multi-GB working tree)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from tests.deploy.deploy_support import DEPLOY, REPO

ROOT_CONTEXT_DOCKERFILES = [REPO / "Dockerfile", DEPLOY / "docker" / "vllm.Dockerfile"]
ALL_DOCKERFILES = [*ROOT_CONTEXT_DOCKERFILES, DEPLOY / "docker" / "vllm-cpu-base.Dockerfile"]


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    pairs: list[tuple[str, str]] = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def _ignored(relpath: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pat = pattern.removeprefix("!").rstrip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            ignored = not negated
    return ignored


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_build_arguments_with_defaults(dockerfile: Path) -> None:
    declared: dict[str, str] = {}
    froms: list[str] = []
    for word, rest in _instructions(dockerfile):
        if word == "ARG" and "=" in rest and not froms:
            name, _, default = rest.partition("=")
            declared[name] = default
        elif word == "FROM":
            froms.append(rest.split()[0])
    assert froms
    for image in froms:
        match = re.fullmatch(r"\$\{(\w+)\}", image)
        if match is None:  # a later stage may start from an earlier one, never from a fixed image
            assert image.lower() in {f.lower() for f in froms}, image
            continue
        assert declared.get(match.group(1)), f"{image} needs an ARG default before FROM"


@pytest.mark.parametrize("dockerfile", ROOT_CONTEXT_DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_survive_dockerignore(dockerfile: Path) -> None:
    patterns = _dockerignore()
    sources: list[str] = []
    for word, rest in _instructions(dockerfile):
        if word == "COPY" and "--from=" not in rest:
            sources += rest.split()[:-1]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert not _ignored(source, patterns), f"{source} is excluded by .dockerignore"
        files = (
            [source]
            if (REPO / source).is_file()
            else [str(p.relative_to(REPO)) for p in (REPO / source).rglob("*.py")]
        )
        assert all(not _ignored(f, patterns) for f in files), source


def test_dockerignore_keeps_the_venv_and_git_out() -> None:
    patterns = _dockerignore()
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/deploy/test_x.py",
        "disagg_router/router/x.pyc",
    ):
        assert _ignored(path, patterns), path
    assert not _ignored("disagg_router/router/http/app.py", patterns)
