"""``python -m devstack.emulator``'s arguments: a bad value (a core list, a profile file) is a usage
error naming it, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devstack.emulator.__main__ import main
from devstack.emulator.profile import load_profile


@pytest.mark.parametrize("value", ["0,x", "-1", "1.5"])
def test_a_bad_cpu_core_list_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--cpu-cores", value])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m devstack.emulator" in err and "--cpu-cores" in err
    assert "Traceback" not in err


def test_a_profile_file_an_engine_cannot_run_on_is_a_usage_error_naming_its_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(load_profile("cpu-tiny").to_json())
    data["work_rate"] = 0
    path = tmp_path / "hand-edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as stopped:
        main(["--profile", str(path)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--profile: invalid profile_option value" not in err
    assert "hand-edited.json': work_rate: input should be greater than 0" in err
    assert "Traceback" not in err
