"""Fixtures for the real-vLLM end-to-end suite (every test here is marked ``vllm``).

Each module starts its stack once (module scope) through ``e2e_support.module_stack``; logs and
the tiny model live under one session directory; a failed startup shows the instance's log tail.
Run real-vLLM tests under ``flock /tmp/vllm-e2e.lock`` so they never overlap with other
real-vLLM runs on the same machine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# The shared case classes assert too: show their values on failure like a test module's.
pytest.register_assert_rewrite("tests.e2e.pd_cases", "tests.e2e.e2e_support")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/e2e starts real vLLM: mark it ``vllm`` (and ``slow``)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session work dir: the tiny model and all instance logs."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install -e '.[cpu]')")
    return tmp_path_factory.mktemp("e2e")
