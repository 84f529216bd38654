"""Renamed config keys: identity probing's keys once said "discovery" (a word that now names pool
membership only). The old names load as the new ones for one release with a warning naming
old -> new; giving an old name and its new one together is an error naming both."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import disagg_router.router.observability.reqlog
import disagg_router.router.server
from disagg_router.router.cli import main
from disagg_router.router.config import load_config, settings_from_mapping
from disagg_router.router.errors import ConfigError

OLD = {
    "timeouts": {"discovery": 7},
    "health": {"discovery_interval": 9, "discovery_prompt": "who"},
}
NEW = {
    "timeouts": {"identity_probe": 7},
    "health": {"identity_interval": 9, "identity_prompt": "who"},
}
RENAMES = [
    "timeouts.discovery -> timeouts.identity_probe",
    "health.discovery_interval -> health.identity_interval",
    "health.discovery_prompt -> health.identity_prompt",
]


def _mapping(sections: dict[str, Any]) -> dict[str, Any]:
    return {
        "models": ["m"],
        "prefill": {"instances": [{"url": "http://127.0.0.1:1"}]},
        "decode": {"instances": [{"url": "http://127.0.0.1:2"}]},
        **sections,
    }


def _write(tmp_path: Path, sections: dict[str, Any]) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_mapping(sections)))
    return path


def _named(message: str) -> str:
    """``a.b -> a.c`` from one message ``config key a.b is deprecated: use a.c (...)``."""
    match = re.fullmatch(r"config key (\S+) is deprecated: use (\S+) \(.*\)", message)
    assert match, message
    return f"{match[1]} -> {match[2]}"


@pytest.mark.parametrize("sections", [OLD, NEW], ids=["old", "new"])
def test_old_and_new_keys_load_to_the_same_settings(
    tmp_path: Path, sections: dict[str, Any]
) -> None:
    warnings: list[str] = []
    settings = load_config(_write(tmp_path, sections), on_deprecated=warnings.append)
    assert settings.timeouts.identity_probe == 7
    assert (settings.health.identity_interval, settings.health.identity_prompt) == (9, "who")
    assert [_named(w) for w in warnings] == (RENAMES if sections is OLD else [])


def test_an_old_key_set_to_null_keeps_its_meaning() -> None:
    assert settings_from_mapping(_mapping({})).health.identity_interval == 300
    old = settings_from_mapping(_mapping({"health": {"discovery_interval": None}}))
    assert old.health.identity_interval is None


@pytest.mark.parametrize(
    ("section", "old", "new"),
    [
        ("timeouts", "discovery", "identity_probe"),
        ("health", "discovery_interval", "identity_interval"),
        ("health", "discovery_prompt", "identity_prompt"),
    ],
)
def test_old_and_new_name_together_is_an_error_naming_both(
    tmp_path: Path, section: str, old: str, new: str
) -> None:
    value = "p" if new == "identity_prompt" else 5
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, {section: {old: value, new: value}}))
    assert err.value.field == section
    assert f"{section}.{old}" in err.value.message and f"{section}.{new}" in err.value.message


def test_check_config_warns_old_to_new(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, OLD)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ok: ")
    warned = [line for line in out.err.splitlines() if line.startswith("warning: ")]
    assert [_named(w.removeprefix("warning: ")) for w in warned] == RENAMES
    assert main(["check-config", str(_write(tmp_path, NEW))]) == 0
    assert "warning" not in capsys.readouterr().err


def test_serve_logs_the_deprecation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    served: list[float] = []

    def fake_serve(settings: Any, *args: Any, **kwargs: Any) -> None:
        served.append(settings.timeouts.identity_probe)

    monkeypatch.setattr(
        disagg_router.router.server, "serve", fake_serve
    )  # no server: only the start's log
    monkeypatch.setattr(
        disagg_router.router.observability.reqlog, "configure_logging", lambda *a: None
    )
    with caplog.at_level(logging.WARNING, logger="disagg_router.router.config"):
        assert main(["serve", "--config", str(_write(tmp_path, OLD))]) == 0
    assert served == [7]
    logged = [r.getMessage() for r in caplog.records if r.name == "disagg_router.router.config"]
    assert [_named(m) for m in logged] == RENAMES


def test_load_config_logs_by_default_as_a_reload_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="disagg_router.router.config"):
        load_config(_write(tmp_path, {"timeouts": {"discovery": 7}}))
    assert [_named(r.getMessage()) for r in caplog.records] == RENAMES[:1]
