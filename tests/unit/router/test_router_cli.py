"""The ``disagg-router`` console script: bad configs are reported, not raised."""

from __future__ import annotations

import pytest

from disagg_router.router import cli


def test_serve_rejects_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--config", "/nonexistent/router.yaml"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_server_cli_has_no_development_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo"])
    assert exc.value.code == 2
    assert "invalid choice: 'demo'" in capsys.readouterr().err
