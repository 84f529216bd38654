"""The vLLM 0.33 side venv (``run_vllm033.sh``) has the plugin of every option that pyproject's
pytest config sets: without it pytest only warns about the unknown option and runs the suite
without it (no timeout, async tests not run by pytest-asyncio)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tests" / "unit" / "connector" / "run_vllm033.sh"

# Options pytest itself knows (the ones this project could plausibly set).
CORE_OPTIONS = {"testpaths", "markers", "addopts", "filterwarnings", "minversion", "norecursedirs"}
# Option prefix -> the distribution that defines it.
PLUGIN_OF_PREFIX = {"asyncio_": "pytest-asyncio", "timeout": "pytest-timeout"}


def _plugin(option: str) -> str | None:
    """The distribution defining ``option``, ``None`` for pytest's own; unknown options fail."""
    if option in CORE_OPTIONS:
        return None
    for prefix, plugin in PLUGIN_OF_PREFIX.items():
        if option.startswith(prefix):
            return plugin
    raise AssertionError(f"pytest option {option!r}: add its plugin to PLUGIN_OF_PREFIX")


def _installed_test_requirements(script: str) -> set[str]:
    match = re.search(r"^TEST_REQS=\(([^)]*)\)", script, re.MULTILINE)
    assert match, "run_vllm033.sh has no TEST_REQS=(...) line"
    names = (re.split(r"[<>=!~\[]", word.strip('"')) for word in match.group(1).split())
    return {parts[0].lower() for parts in names}


def test_the_side_venv_installs_every_plugin_the_pytest_config_names() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    options = config["tool"]["pytest"]["ini_options"]
    needed = {plugin for option in options if (plugin := _plugin(option)) is not None}
    assert needed  # the config does name plugin options; a parsing slip must not pass silently
    missing = needed - _installed_test_requirements(SCRIPT.read_text())
    assert not missing, f"run_vllm033.sh does not install {sorted(missing)}"
