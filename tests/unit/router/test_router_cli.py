"""The CLI's plugin dispatch: a missing plugin module gives a clear message, not a traceback."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from router import cli


def test_missing_plugin_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli._PLUGINS, "demo", ("router.devstack.no_such_demo", "demo"))
    assert cli.main(["demo"]) == 2
    assert "router.devstack.no_such_demo is not available" in capsys.readouterr().err


def test_plugin_gets_its_arguments_and_exit_status(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = types.ModuleType("fake_bench_plugin")
    seen: list[argparse.Namespace] = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rate", type=float, required=True)

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 7

    plugin.add_arguments = add_arguments  # type: ignore[attr-defined]
    plugin.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_bench_plugin", plugin)
    monkeypatch.setitem(cli._PLUGINS, "bench", ("fake_bench_plugin", "bench"))
    assert cli.main(["bench", "--rate", "2.5"]) == 7
    assert seen[0].rate == 2.5


def test_serve_rejects_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--config", "/nonexistent/router.yaml"]) == 1
    assert "cannot read" in capsys.readouterr().err
