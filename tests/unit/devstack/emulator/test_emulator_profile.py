"""Engine profiles (``devstack.emulator.profile``): the shipped ``cpu-tiny`` profile loads and
round-trips through its file text, the step and transfer time formulas, and a profile file an
engine could not run on (a field missing, unknown, of another type or out of range) is refused
with a ValueError naming the file and the field."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from devstack.emulator.profile import (
    PROFILES_DIR,
    StepModel,
    Transfer,
    load_profile,
    parse_profile,
)


def test_cpu_tiny_loads_and_round_trips() -> None:
    profile = load_profile("cpu-tiny")
    assert profile.name == "cpu-tiny" and profile.model == "tiny"
    assert profile.block_size > 0 and profile.num_blocks > 0
    assert profile.max_num_batched_tokens > 0 and profile.max_num_seqs > 0
    assert profile.step.base_s > 0 and profile.transfer.bandwidth_bytes_per_s > 0
    assert parse_profile(profile.to_json()) == profile
    # by path as well as by name, and the file is the profile's own text
    path = PROFILES_DIR / "cpu-tiny.json"
    assert load_profile(str(path)) == profile
    assert json.loads(path.read_text()) == json.loads(profile.to_json())


def test_an_unknown_profile_is_refused_naming_the_shipped_ones() -> None:
    with pytest.raises(ValueError, match=r"profile 'gpu\.v2': no such file, nor one of cpu-tiny"):
        load_profile("gpu.v2")


def test_a_changed_profile_round_trips(tmp_path: Path) -> None:
    profile = replace(load_profile("cpu-tiny"), name="other", num_blocks=7, kv_lease_s=0.5)
    path = tmp_path / "other.json"
    path.write_text(profile.to_json())
    assert load_profile(str(path)) == profile


def test_step_seconds_are_linear_in_what_the_step_computes() -> None:
    model = StepModel(
        base_s=1.0,
        per_token_s=0.1,
        per_seq_s=0.01,
        per_context_token_s=0.001,
        per_attention_pair_s=0.0001,
    )
    assert model.seconds(0, 0, 0, 0) == 1.0
    assert model.seconds(10, 2, 300, 4000) == pytest.approx(1.0 + 1.0 + 0.02 + 0.3 + 0.4)
    assert StepModel(base_s=0.5, per_token_s=0.25).seconds(4, 3, 100, 100) == 1.5


def test_transfer_seconds_pay_the_handshake_only_on_first_meeting() -> None:
    transfer = Transfer(
        bytes_per_token=100, bandwidth_bytes_per_s=1000.0, latency_s=0.5, handshake_s=2.0
    )
    assert transfer.seconds(10, first_meeting=False) == pytest.approx(0.5 + 1.0)
    assert transfer.seconds(10, first_meeting=True) == pytest.approx(2.0 + 0.5 + 1.0)
    assert transfer.seconds(0, first_meeting=False) == 0.5
    no_handshake = Transfer(bytes_per_token=100, bandwidth_bytes_per_s=1000.0, latency_s=0.5)
    assert no_handshake.seconds(10, first_meeting=True) == pytest.approx(1.5)


def _bad_file(tmp_path: Path, change: dict[str, object], where: str = "") -> Path:
    data = json.loads(load_profile("cpu-tiny").to_json())
    (data[where] if where else data).update(change)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("where", ["", "step", "transfer"])
def test_a_profile_with_an_unknown_field_is_refused(tmp_path: Path, where: str) -> None:
    path = _bad_file(tmp_path, {"surprise": 1}, where)
    field = f"{where}.surprise" if where else "surprise"
    with pytest.raises(ValueError, match=rf"profile file '.*bad\.json': {field}: unexpected"):
        load_profile(str(path))


def test_a_profile_missing_a_field_is_refused() -> None:
    data = json.loads(load_profile("cpu-tiny").to_json())
    del data["num_blocks"], data["step"]["base_s"]
    with pytest.raises(ValueError, match=r"^num_blocks: field required; step\.base_s: field"):
        parse_profile(json.dumps(data))


@pytest.mark.parametrize(
    ("where", "change", "problem"),
    [
        ("", {"work_rate": 0}, "work_rate: input should be greater than 0"),
        ("", {"work_rate": -5.0}, "work_rate: input should be greater than 0"),
        ("", {"num_blocks": 0}, "num_blocks: input should be greater than or equal to 1"),
        ("", {"num_blocks": "7"}, "num_blocks: input should be a valid integer"),
        ("", {"num_blocks": 7.0}, "num_blocks: input should be a valid integer"),
        ("", {"block_size": True}, "block_size: input should be a valid integer"),
        ("", {"kv_lease_s": 0}, "kv_lease_s: input should be greater than 0"),
        ("", {"model": ""}, "model: string should have at least 1 character"),
        ("", {"request_overhead_s": -0.001}, "request_overhead_s: input should be greater"),
        ("step", {"base_s": -1}, "step.base_s: input should be greater than or equal to 0"),
        ("step", {"per_token_s": "fast"}, "step.per_token_s: input should be a valid number"),
        ("transfer", {"bandwidth_bytes_per_s": 0}, "transfer.bandwidth_bytes_per_s: input"),
        ("transfer", {"latency_s": 1e400}, "transfer.latency_s: input should be a finite"),
    ],
)
def test_a_profile_field_out_of_range_or_of_another_type_is_refused(
    tmp_path: Path, where: str, change: dict[str, object], problem: str
) -> None:
    path = _bad_file(tmp_path, change, where)
    with pytest.raises(ValueError, match=f"^profile file '.*bad.json': {problem}"):
        load_profile(str(path))


def test_a_profile_file_that_is_not_json_is_refused_as_such() -> None:
    with pytest.raises(ValueError, match=r"^the file: invalid json"):
        parse_profile("{not json")
    with pytest.raises(ValueError, match=r"^the file: input should be an object"):
        parse_profile("[1, 2]")


def test_a_profile_whose_work_rate_is_a_whole_number_loads(tmp_path: Path) -> None:
    profile = load_profile(str(_bad_file(tmp_path, {"work_rate": 150000})))
    assert profile.work_rate == 150000.0


@pytest.mark.parametrize("name", ["cpu-tiny", "h200-qwen3-32b-tp1"])
def test_every_committed_profile_loads_and_says_where_it_comes_from(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    assert profile.source.startswith("Fitted by")
    assert profile.step.seconds(tokens=1, seqs=1, context=0, pairs=1) > 0


CHUNKED = replace(
    load_profile("cpu-tiny"),
    max_num_batched_tokens=1000,
    step=StepModel(
        base_s=0.01, per_token_s=0.001, per_context_token_s=1e-5, per_attention_pair_s=1e-6
    ),
    request_overhead_s=0.002,
    answer_overhead_s=0.003,
)


def test_a_prefill_is_its_chunks_steps_and_the_api_servers_overheads() -> None:
    # 2500 tokens in chunks of 1000, 1000, 500: pairs 1000*0 + 500500, 1000*1000 + 500500,
    # 500*2000 + 125250
    pairs = 500_500 + 1_500_500 + 1_125_250
    expected = 0.005 + 3 * 0.01 + 2.5 + 1e-6 * pairs
    assert CHUNKED.prefill_seconds(2500) == pytest.approx(expected)


def test_a_decode_step_computes_a_token_per_sequence_and_reads_every_context() -> None:
    # 8 sequences of 100 cached tokens: 8 tokens computed, 800 context tokens read
    assert CHUNKED.decode_step_seconds(8, 100) == pytest.approx(0.01 + 0.008 + 800e-5)
