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

from disagg_router.connector.nixl_backend import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="no NIXL")]

ROOT = Path(__file__).resolve().parents[3]


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m bench.device_check --memory dram *args`` with this checkout imported."""
    paths = [str(ROOT), str(ROOT / "devtools"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return subprocess.run(
        [sys.executable, "-m", "bench.device_check", "--memory", "dram", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )


def test_dram_device_check_moves_every_case_byte_exact() -> None:
    proc = _check("--iterations", "3")
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
    assert result["tp"] == 1 and result["tp_throughput"] == [] and result["tp_ratio"] is None


def test_dram_device_check_with_p_tp_2_moves_every_share() -> None:
    """``--tp 2``: two P ranks write their halves of every block into one D, byte exact."""
    proc = _check("--tp", "2", "--big-mib", "1", "--sizes-mib", "1", "--iterations", "2")
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"check"')]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[0])
    assert result["byte_exact"] is True and result["tp"] == 2
    [row] = result["tp_throughput"]
    assert row["bytes"] == 1024 * 1024 and row["p_tp"] == 2 and row["byte_exact"] is True
    assert row["ours_gbps"] > 0 and row["bare_gbps"] > 0
    assert result["tp_ratio"] == row["ratio"] > 0
