"""``disagg-bench fleet-failover`` over a real emulated 2P3D fleet (the fast profile) behind our
router: one D is killed while streams run, and every stream still ends whole; each stream that
lost its D after its first token was resumed by a migration, and P computed only a block or so
of its prompt again."""

from __future__ import annotations

from pathlib import Path

from bench.fleet_failover import FleetFailoverSpec, run_fleet_failover


def test_every_stream_ends_whole_when_a_d_dies_under_load(tmp_path: Path) -> None:
    spec = FleetFailoverSpec(
        size=3, profile="cpu-tiny", input_len=512, output_len=64, requests=24, kills=1
    )
    data = run_fleet_failover(spec, tmp_path)
    assert (data["whole"], data["streams"]) == (24, 24), data["not_whole"]
    # all 24 arrive within about 0.1 s and stream 64 tokens each: the D killed halfway through
    # the arrivals holds some of them (each then failed over: retried or migrated)
    (kill,) = data["kills"]
    assert kill["in_flight"] >= 1
    assert sum(data["failovers"].values()) >= kill["in_flight"]
    assert data["on_killed_whole"] == data["on_killed"]
    resumed = data["migrations"].get("resumed", 0.0)
    assert resumed == data["failovers"].get("after_first_token", 0.0)
    assert set(data["migrations"]) <= {"resumed"}
    after = data["p_computed_tokens"].get("after_first_token", {"count": 0.0, "at_most": 0.0})
    assert after["count"] == resumed and after["at_most"] <= 128
