"""The package's public API: what ``import router`` offers is enough to configure and serve."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI

from disagg_router import router


def test_public_api_builds_an_app_from_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "models: [tiny]\n"
        "prefill: {instances: [{url: 'http://127.0.0.1:8100'}]}\n"
        "decode: {instances: [{url: 'http://127.0.0.1:8200'}]}\n"
    )
    settings = router.load_config(config)
    assert isinstance(settings, router.RouterSettings)
    assert isinstance(router.create_app(settings), FastAPI)


def test_public_api_names_the_bad_field(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("models: [tiny]\nprefill: {instances: [{url: 'ftp://x'}]}\n")
    with pytest.raises(router.ConfigError) as exc:
        router.load_config(config)
    assert "prefill" in str(exc.value)


def test_public_api_is_exactly_the_documented_names() -> None:
    assert sorted(router.__all__) == [
        "ConfigError",
        "RouterSettings",
        "create_app",
        "load_config",
        "main",
    ]
