"""Config loading: valid files load; every error names the offending field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_router.router.cli import main
from disagg_router.router.config import load_config, settings_from_mapping
from disagg_router.router.errors import ConfigError

VALID = """
models: [tiny]
mode: push
prefill:
  policy: least_in_flight
  instances:
    - url: http://127.0.0.1:8100
      identity: {engine_id: e0, host: 127.0.0.1, port: 5600, tp_size: 2}
    - url: http://127.0.0.1:8101/
decode:
  instances:
    - {url: "http://127.0.0.1:8200", name: d0, api_key: secret}
timeouts: {connect: 1, prefill: 30, first_token: 60, total: 120}
api_keys: [k1]
retry_on_fresh_pair: true
"""


def _base() -> dict[str, Any]:
    return {
        "models": ["m"],
        "prefill": {"instances": [{"url": "http://127.0.0.1:1"}]},
        "decode": {"instances": [{"url": "http://127.0.0.1:2"}]},
    }


def test_valid_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(VALID)
    s = load_config(path)
    assert s.mode == "push"
    assert s.prefill.policy == "least_in_flight"
    assert s.decode.policy == "round_robin"
    p0, p1 = s.prefill.instances
    assert p0.identity is not None and p0.identity.tp_size == 2 and p0.identity.pp_size == 1
    assert p1.url == "http://127.0.0.1:8101"
    assert p1.identity is None
    assert s.decode.instances[0].label == "d0"
    assert s.timeouts.total == 120
    assert s.retry_on_fresh_pair is True


def test_defaults_are_finite() -> None:
    s = settings_from_mapping(_base())
    t = s.timeouts
    assert all(0 < v < 3600 for v in (t.connect, t.prefill, t.first_token, t.total, t.health))
    assert s.retry_on_fresh_pair is True
    assert s.api_keys == []


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"mode": "sideways"}, "mode"),
        ({"models": []}, "models"),
        ({"prefill": {"instances": []}}, "prefill.instances"),
        ({"prefill": {"instances": [{"url": "ftp://x"}]}}, "prefill.instances.0.url"),
        ({"decode": {"instances": [{"url": "http://h:1/v1"}]}}, "decode.instances.0.url"),
        ({"decode": {"instances": [{"url": "http://h:1"}], "policy": "random"}}, "decode.policy"),
        (
            {"prefill": {"instances": [{"url": "http://h:1", "identity": {"engine_id": "e"}}]}},
            "prefill.instances.0.identity.host",
        ),
        (
            {
                "prefill": {
                    "instances": [
                        {
                            "url": "http://h:1",
                            "identity": {"engine_id": "e", "host": "h", "port": 70000},
                        }
                    ]
                }
            },
            "prefill.instances.0.identity.port",
        ),
        ({"timeouts": {"total": 0}}, "timeouts.total"),
        ({"timeouts": {"prefill": None}}, "timeouts.prefill"),
        ({"timeouts": {"first_token": 100, "total": 10}}, "timeouts"),
        ({"api_keys": [""]}, "api_keys"),
        ({"surprise": 1}, "surprise"),
        (
            {"decode": {"instances": [{"url": "http://h:1"}, {"url": "http://h:1/"}]}},
            "decode",
        ),
    ],
)
def test_errors_name_the_field(patch: dict[str, Any], field: str) -> None:
    data = {**_base(), **patch}
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(data)
    assert info.value.field == field


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_check_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(VALID)
    bad = tmp_path / "bad.yaml"
    bad.write_text(VALID.replace("mode: push", "mode: sideways"))
    assert main(["check-config", str(good)]) == 0
    assert "mode=push" in capsys.readouterr().out
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "mode" in err and "sideways" not in err.split(":")[0]


MULTI = """
mode: push
disaggregation: {min_prompt_tokens: 256}
models:
  big:
    prefill:
      policy: prefix_affinity
      instances: [{url: "http://127.0.0.1:8100"}, {url: "http://127.0.0.1:8101"}]
    decode:
      policy: power_of_two
      instances: [{url: "http://127.0.0.1:8200"}]
  small:
    prefill:
      instances: [{url: "http://127.0.0.1:8110"}]
    decode:
      instances: [{url: "http://127.0.0.1:8210"}]
    disaggregation: {min_prompt_tokens: 0, when_no_prefill: fail}
"""


def test_multi_model_file_gives_each_model_its_pools_and_rule(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(MULTI)
    s = load_config(path)
    routes = s.routes()
    assert s.model_names == ["big", "small"]
    assert routes["big"].prefill.policy == "prefix_affinity"
    assert routes["big"].decode.policy == "power_of_two"
    assert routes["big"].disaggregation.min_prompt_tokens == 256  # the top-level rule
    assert routes["small"].disaggregation.when_no_prefill == "fail"
    assert routes["small"].prefill.instances[0].url == "http://127.0.0.1:8110"


def test_short_form_serves_every_listed_model_from_the_same_pools() -> None:
    s = settings_from_mapping({**_base(), "models": ["a", "b"]})
    routes = s.routes()
    assert routes["a"].prefill is routes["b"].prefill
    assert routes["a"].disaggregation.min_prompt_tokens == 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prefill": None}, "prefill"),
        ({"models": {"m": {"decode": {"instances": [{"url": "http://h:1"}]}}}}, "models.m.prefill"),
        (
            {"models": {"m": {"prefill": {"instances": []}, "decode": {"instances": []}}}},
            "models.m.prefill.instances",
        ),
        ({"prefill": {"instances": [{"url": "http://h:1"}], "policy": "magic"}}, "prefill.policy"),
        (
            {"prefill": {"instances": [{"url": "http://h:1"}], "load_factor": 0.5}},
            "prefill.load_factor",
        ),
        ({"disaggregation": {"when_no_prefill": "maybe"}}, "disaggregation.when_no_prefill"),
        ({"load_signals": {"interval": 5, "stale_after": 1}}, "load_signals"),
        ({"models": []}, "models"),
    ],
)
def test_routing_sections_name_the_bad_field(change: dict[str, Any], field: str) -> None:
    data = {**_base(), **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        settings_from_mapping(data)
    assert err.value.field == field


def test_map_form_rejects_top_level_pools() -> None:
    pools = {k: v for k, v in _base().items() if k != "models"}
    with pytest.raises(ConfigError) as err:
        settings_from_mapping({**pools, "models": {"m": pools}})
    assert err.value.field == "prefill"
    assert "per model" in err.value.message


def test_check_config_prints_the_effective_per_model_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "multi.yaml"
    path.write_text(MULTI)
    assert main(["check-config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["model", "prefill", "decode", "disaggregation"]
    assert lines[2].split()[:7] == ["big", "2", "x", "prefix_affinity", "1", "x", "power_of_two"]
    assert "D alone below 256 tokens" in lines[2]
    assert lines[3].startswith("small") and "no usable P: fail" in lines[3]


def test_check_config_and_reload_share_the_field_named_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MULTI.replace("policy: power_of_two", "policy: fastest"))
    assert main(["check-config", str(path)]) == 1
    assert "models.big.decode.policy" in capsys.readouterr().err


def test_the_documented_multi_model_file_is_valid() -> None:
    doc = (Path(__file__).parents[4] / "docs" / "router.md").read_text()
    block = doc.split("A complete two-model file:", 1)[1].split("```yaml\n", 1)[1].split("```")[0]
    s = settings_from_mapping(yaml.safe_load(block))
    routes = s.routes()
    assert len(routes) == 2
    assert {r.prefill.policy for r in routes.values()} == {"prefix_affinity", "round_robin"}


def _with_shapes(p: dict[str, Any] | None, d: dict[str, Any] | None) -> str:
    data = _base()
    if p is not None:
        data["prefill"]["shape"] = p
    if d is not None:
        data["decode"]["shape"] = d
    return yaml.safe_dump(data)


def test_check_config_reports_a_refused_declared_pair_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "shapes.yaml"
    path.write_text(_with_shapes({"tp_size": 2}, {"tp_size": 3}))
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "shapes of m" in err and "P tp_size=2 and D tp_size=3: neither divides" in err
    path.write_text(_with_shapes({"tp_size": 2, "block_size": 16}, {"block_size": 16}))
    assert main(["check-config", str(path)]) == 0
    assert "shapes of m: declared, served" in capsys.readouterr().out


def test_check_config_says_shapes_are_learned_when_not_declared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "shapes.yaml"
    path.write_text(_with_shapes({"tp_size": 2}, None))
    assert main(["check-config", str(path)]) == 0
    assert "shapes of m: learned at run time" in capsys.readouterr().out
    assert settings_from_mapping(_base()).routes()["m"].prefill.shape is None


def test_a_bad_declared_shape_names_its_field() -> None:
    data = _base()
    data["decode"]["shape"] = {"tp_size": 0}
    with pytest.raises(ConfigError) as err:
        settings_from_mapping(data)
    assert err.value.field == "decode.shape.tp_size"
