"""The repository speaks about the product, to its users and contributors.

Over every file git tracks (``git ls-files``; a symlink is checked by its target): no talk of
development sessions, owners or roles, no absolute path of a particular machine's checkout or
home directory, and no run's temporary directory as a value in committed data. Also: README.md
stays short (it is the user's entry point; reference material lives in ``docs/`` and
``disagg_router/connector/README.md``).
Skipped outside a git checkout (e.g. an unpacked sdist), where there is no file list to check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150

FORBIDDEN = {
    "development history": re.compile(r"\bsessions? [0-9]|\bsession-[0-9]", re.IGNORECASE),
    "talk of sessions or roles": re.compile(
        r"(?i:\b(?:this|previous|first|last|next) session\b|\bthe developer\b|\bengineers?\b)"
        r"|\bOwners?:"
    ),
    "machine path": re.compile(r"/(?:work|root)/"),
    "a run's temporary directory in committed data": re.compile(r'":\s*"/tmp/'),
}


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True, timeout=60
    ).stdout
    return [REPO / name for name in out.decode().split("\0") if name]


def _text(path: Path) -> str | None:
    """The file's text (a symlink's target), or None for a binary or missing file."""
    if path.is_symlink():
        return os.readlink(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # deleted in the working tree, not yet committed
        return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def _violations() -> list[str]:
    found = []
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        for what, pattern in FORBIDDEN.items():
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(REPO)}:{line}: {what}: {match.group(0)!r}")
    return found


def test_no_tracked_file_speaks_of_sessions_roles_or_machine_paths() -> None:
    assert _violations() == []


def test_patterns_catch_what_they_must() -> None:
    # Each sample is split so that this file does not match the patterns it tests.
    samples = {
        "development history": [
            "as in Session" + " 3",
            "the session" + "-2 value",
            "sessions" + " 1-2",
        ],
        "talk of sessions or roles": [
            "since this" + " session",
            "flows are tested). Own" + "er: e2e",
            "questions for the router engin" + "eer",
            "as the devel" + "oper saw",
        ],
        "machine path": ["see /wo" + "rk/main/.venv", "/ro" + "ot/.cache/x"],
        "a run's temporary directory in committed data": ['  "logs": "/tm' + 'p/bench-x1"'],
    }
    for what, texts in samples.items():
        for text in texts:
            assert FORBIDDEN[what].search(text), (what, text)
    for text in ("a pytest session directory; /opt/models", "flock /tmp/vllm-e2e.lock pytest"):
        assert not any(p.search(text) for p in FORBIDDEN.values()), text


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep reference in docs/"
