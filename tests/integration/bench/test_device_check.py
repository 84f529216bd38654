"""The device check in DRAM mode: the same script a GPU machine runs, so it cannot rot (``nixl``).

Two real processes move KV through the connector's transfer core and through bare NIXL; the
script's JSON line must report every byte check exact, both throughputs, and no import of
vLLM or the router's dependencies (a bare GPU machine has only torch and NIXL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from connector.nixl_backend import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="no NIXL")]

ROOT = Path(__file__).resolve().parents[3]


def test_dram_device_check_moves_every_case_byte_exact() -> None:
    paths = [str(ROOT), str(ROOT / "devtools"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.device_check", "--memory", "dram", "--iterations", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"check"')]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[0])
    assert result["memory"] == "DRAM" and result["byte_exact"] is True
    assert [c["case"] for c in result["cases"]] == ["1 block", "64 scattered blocks", "2048 blocks"]
    assert all(c["ok"] and c["exact"] and c["rest_zero"] for c in result["cases"])
    assert result["cases"][-1]["bytes"] == 64 * 1024 * 1024
    assert result["ours_gbps"] > 0 and result["bare_gbps"] > 0 and result["ratio"] > 0
    assert [row["bytes"] for row in result["throughput"]] == [4 * 1024 * 1024, 16 * 1024 * 1024]
    assert result["foreign_modules"] == []
