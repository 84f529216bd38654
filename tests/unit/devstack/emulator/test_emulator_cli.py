"""``python -m devstack.emulator``'s arguments: a bad value is a usage error, not a traceback."""

from __future__ import annotations

import pytest

from devstack.emulator.__main__ import main


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
