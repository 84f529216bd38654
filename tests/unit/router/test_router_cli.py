"""The ``disagg-router`` console script: bad configs are reported, not raised."""

from __future__ import annotations

import hashlib
import io

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


def test_hash_key_prints_the_digest_of_the_key_on_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-acme\n"))
    assert cli.main(["hash-key"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == hashlib.sha256(b"sk-acme").hexdigest()
    assert "sk-acme" not in out


def test_hash_key_without_a_key_fails_and_says_how(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli.main(["hash-key"]) == 2
    assert "stdin" in capsys.readouterr().err
