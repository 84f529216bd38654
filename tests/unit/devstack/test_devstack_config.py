"""Devstack pieces that need no vLLM process: connector configs, ports, specs, stack plans."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from devstack.connectors import kv_transfer_config, router_mode
from devstack.ports import free_ports
from devstack.stack import Stack, StackInstance, StackOptions, build_specs
from devstack.vllm_server import VllmServer, VllmServerSpec, read_metrics_text
from disagg_router.router.config import settings_from_mapping


def test_kv_transfer_config_for_vllm_connectors() -> None:
    assert kv_transfer_config("vllm-push", "prefill") == {
        "kv_connector": "NixlPushConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
    }
    pull = kv_transfer_config("vllm-pull", "decode", {"kv_lease_duration": 10})
    assert pull["kv_connector"] == "NixlConnector"
    assert pull["kv_role"] == "kv_consumer"
    assert pull["kv_connector_extra_config"] == {"kv_lease_duration": 10}
    assert kv_transfer_config("vllm-push", "both")["kv_role"] == "kv_both"


def test_kv_transfer_config_for_our_connector_uses_the_package_names() -> None:
    from disagg_router import connector

    config = kv_transfer_config("ours", "decode")
    assert config["kv_connector"] == connector.CONNECTOR_CLASS_NAME
    assert config["kv_connector_module_path"] == "disagg_router.connector"
    assert config["kv_role"] == "kv_consumer"


@pytest.mark.parametrize(("kind", "role"), [("nixl", "prefill"), ("vllm-push", "producer")])
def test_kv_transfer_config_rejects_unknown_kind_or_role(kind: str, role: str) -> None:
    with pytest.raises(ValueError, match=kind if kind == "nixl" else role):
        kv_transfer_config(kind, role)


def test_router_mode_follows_the_connector_kind() -> None:
    assert router_mode("vllm-push") == "push"
    assert router_mode("ours") == "push"
    assert router_mode("vllm-pull") == "pull"
    with pytest.raises(ValueError):
        router_mode("other")


def test_free_ports_are_distinct_and_bindable() -> None:
    import socket

    ports = free_ports(6)
    assert len(set(ports)) == 6
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_spec_command_and_environment(tmp_path: Path) -> None:
    spec = VllmServerSpec(
        name="p0",
        model_dir=tmp_path / "model",
        port=18123,
        cpu_core=1,
        log_file=tmp_path / "p0.log",
        kv_transfer_config={"kv_connector": "NixlPushConnector", "kv_role": "kv_producer"},
        nixl_side_channel_port=18124,
        extra_env={"VLLM_LOGGING_LEVEL": "DEBUG"},
        extra_args=("--enforce-eager",),
    )
    argv = spec.command()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "18123"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer"}
    assert argv[-1] == "--enforce-eager"
    env = spec.environment({"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "18124"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["KMP_BLOCKTIME"] == "0"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert env["PATH"] == "/bin"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # worker inside the engine core
    assert spec.url == "http://127.0.0.1:18123"
    separate = dataclasses.replace(spec, in_process_worker=False)
    assert separate.environment({})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_read_metrics_text_sums_labels_and_keeps_names() -> None:
    text = (
        "# HELP vllm:num_requests_running n\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="tiny"} 1.0\n'
        "# HELP vllm:prompt_tokens t\n# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{engine="0"} 300.0\n'
    )
    values = read_metrics_text(text)
    assert values["vllm:num_requests_running"] == 3.0
    assert values["vllm:prompt_tokens_total"] == 300.0


def _stack(tmp_path: Path, options: StackOptions) -> Stack:
    planned = build_specs(options, tmp_path / "model", tmp_path / "logs")
    instances = [
        StackInstance(role, VllmServer(spec), engine_id, spec.nixl_side_channel_port)
        for role, engine_id, spec in planned
    ]
    return Stack(options, tmp_path / "model", instances)


def test_2p1d_plan_pins_prefills_to_core0_and_decode_to_core1(tmp_path: Path) -> None:
    stack = _stack(tmp_path, StackOptions(kind="vllm-push", topology="2p1d", with_aggregated=True))
    roles = [(i.role, i.name, i.server.spec.cpu_core) for i in stack.instances]
    assert roles == [
        ("prefill", "p0", 0),
        ("prefill", "p1", 0),
        ("decode", "d0", 1),
        ("aggregated", "a0", 0),
    ]
    ports = [i.server.spec.port for i in stack.instances]
    ports += [i.side_channel_port for i in stack.instances if i.side_channel_port]
    assert len(set(ports)) == len(ports) == 7
    p0 = stack.prefill[0].server.spec
    assert p0.kv_transfer_config is not None
    assert p0.kv_transfer_config["kv_role"] == "kv_producer"
    assert p0.kv_transfer_config["engine_id"] == stack.prefill[0].engine_id
    assert stack.aggregated[0].server.spec.kv_transfer_config is None


def test_pinned_stack_runs_each_whole_instance_on_its_core(tmp_path: Path) -> None:
    free = _stack(tmp_path, StackOptions(kind="ours"))
    assert all(i.server.spec.command()[0] != "taskset" for i in free.instances)
    pinned = _stack(tmp_path, StackOptions(kind="ours", pin_processes=True))
    heads = [i.server.spec.command()[:3] for i in pinned.instances]
    assert heads == [["taskset", "-c", "0"], ["taskset", "-c", "1"]]
    assert pinned.instances[0].server.spec.command()[3:5] == [sys.executable, "-m"]


@pytest.mark.parametrize("with_identity", [False, True])
def test_router_config_is_valid_for_the_router(tmp_path: Path, with_identity: bool) -> None:
    stack = _stack(tmp_path, StackOptions(kind="vllm-pull", topology="2p1d"))
    settings = settings_from_mapping(stack.router_config(with_identity=with_identity))
    assert settings.mode == "pull"
    assert settings.models == ["tiny"]
    assert [i.url for i in settings.prefill.instances] == [i.url for i in stack.prefill]
    assert [i.url for i in settings.decode.instances] == [stack.decode[0].url]
    identity = settings.prefill.instances[1].identity
    if with_identity:
        assert identity is not None
        assert identity.engine_id == stack.prefill[1].engine_id
        assert identity.port == stack.prefill[1].side_channel_port
    else:
        assert identity is None


def test_router_config_can_limit_the_prefill_pool(tmp_path: Path) -> None:
    stack = _stack(tmp_path, StackOptions(kind="vllm-push", topology="2p1d"))
    config = stack.router_config(prefill_names=["p1"])
    assert [i["name"] for i in config["prefill"]["instances"]] == ["p1"]
    assert config["mode"] == "push"
    with pytest.raises(ValueError):
        stack.router_config(prefill_names=["nope"])


def test_3p2d_parallel_instances_get_workers_cores_and_side_channel_runs(
    tmp_path: Path,
) -> None:
    options = StackOptions(
        kind="ours",
        topology="3p2d",
        tensor_parallel={"p1": 2, "d1": 2},
        pipeline_parallel={"p2": 2},
        enforce_eager=True,
    )
    planned = build_specs(options, tmp_path / "model", tmp_path / "logs")
    specs = {spec.name: spec for _, _, spec in planned}
    # Eager everywhere but on the pipeline-parallel instance (vLLM CPU needs its compiled mode).
    eager = {name for name, spec in specs.items() if "--enforce-eager" in spec.command()}
    assert eager == {"p0", "p1", "d0", "d1"}
    shapes = [
        (s.name, s.cpu_core, s.tensor_parallel_size, s.pipeline_parallel_size)
        for s in specs.values()
    ]
    assert shapes == [
        ("p0", 0, 1, 1),
        ("p1", 0, 2, 1),
        ("p2", 0, 1, 2),
        ("d0", 1, 1, 1),
        ("d1", 1, 2, 1),
    ]
    assert [role for role, _, _ in planned] == ["prefill"] * 3 + ["decode"] * 2
    p1 = specs["p1"]
    argv = p1.command()
    at = argv.index("--tensor-parallel-size")
    assert argv[at : at + 4] == [
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "mp",
    ]
    # Every worker on its instance's core: P's and D's workers never share one.
    assert p1.environment({})["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"
    assert specs["d1"].environment({})["VLLM_CPU_OMP_THREADS_BIND"] == "1|1"
    assert specs["p0"].environment({})["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    # Each instance's ranks listen on side_channel_port + rank: the runs do not overlap.
    taken = [
        port
        for s in specs.values()
        if s.nixl_side_channel_port is not None
        for port in range(s.nixl_side_channel_port, s.nixl_side_channel_port + 2)
    ]
    assert len(set(taken)) == len(taken)


def test_a_pipeline_parallel_instance_gets_its_workers_on_its_core_and_a_port_per_rank(
    tmp_path: Path,
) -> None:
    options = StackOptions(
        kind="ours", topology="2p1d", tensor_parallel={"p1": 2}, pipeline_parallel={"p1": 2}
    )
    planned = build_specs(options, tmp_path / "model", tmp_path / "logs")
    specs = {spec.name: spec for _, _, spec in planned}
    p1 = specs["p1"]
    assert (p1.workers, p1.cpu_core) == (4, 0)
    assert p1.command()[-6:] == [
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
        "--distributed-executor-backend",
        "mp",
    ]
    assert p1.environment({})["VLLM_CPU_OMP_THREADS_BIND"] == "0|0|0|0"
    taken = [  # vLLM rank r of each instance listens on side_channel_port + r
        port
        for s in specs.values()
        if s.nixl_side_channel_port is not None
        for port in range(s.nixl_side_channel_port, s.nixl_side_channel_port + 4)
    ]
    assert len(set(taken)) == len(taken)
