"""The router wheel (``pip install .``, no extras) holds the router and the connector, nothing else.

The development stack, the fake vLLM and the benchmarks live in the separate ``devtools``
distribution; the router image installs this wheel, so what is not in it is not in the image.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _copy_sources(names: list[str], dest: Path) -> Path:
    """A clean copy of what a build reads (no stale ``build/`` or egg-info of the checkout)."""
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    for name in names:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / Path(name).name, ignore=ignore)
        else:
            shutil.copy2(src, dest / src.name)
    return dest


def _build_wheel(src: Path, out: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def _top_level_packages(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    return {
        name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")
    }


def test_router_wheel_holds_only_router_and_connector(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    src = _copy_sources(["pyproject.toml", "README.md", "disagg_router"], tmp_path / "src")
    wheel = _build_wheel(src, tmp_path / "dist")
    assert _top_level_packages(wheel) == {"disagg_router"}
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "disagg_router/router/http/app.py" in names
    assert "disagg_router/connector/facade.py" in names
    assert not [n for n in names if "fake" in n or "bench" in n or "devstack" in n]


def test_devtools_wheel_holds_the_workshop(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    src = _copy_sources(["devtools"], tmp_path / "src") / "devtools"
    wheel = _build_wheel(src, tmp_path / "dist")
    assert _top_level_packages(wheel) == {"devstack", "bench"}
