"""The facade against the installed vLLM's connector API (run on 0.32 and 0.33)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorTransferResults,
    supports_hma,
)

from disagg_router import connector
from disagg_router.connector.facade import DisaggPushConnector
from disagg_router.connector.metadata import PushConnectorMetadata
from disagg_router.connector.specs import SendSpec
from disagg_router.connector.worker import WorkerStep


def test_class_name_resolves_like_vllms_factory_and_is_not_a_builtin_name() -> None:
    cls = getattr(
        importlib.import_module(connector.CONNECTOR_MODULE_PATH), connector.CONNECTOR_CLASS_NAME
    )
    assert cls is DisaggPushConnector
    assert issubclass(cls, KVConnectorBase_V1)
    assert connector.CONNECTOR_CLASS_NAME not in KVConnectorFactory._registry
    assert "Nixl" not in connector.CONNECTOR_CLASS_NAME  # vLLM special-cases Nixl* names
    assert not DisaggPushConnector.__abstractmethods__
    assert not supports_hma(DisaggPushConnector)


class _StubWorker:
    """Stands in for PushWorker: records the steps handed over; collect() reports one finished
    send, one ok and one failed receive."""

    def __init__(self) -> None:
        self.steps: list[PushConnectorMetadata] = []

    def start_step(self, meta: PushConnectorMetadata) -> None:
        self.steps.append(meta)

    def collect(self) -> WorkerStep:
        return WorkerStep(
            finished_sending={"p-1"},
            finished_recving={"d-ok", "d-bad"},
            failed_recving={"d-bad"},
            failed_block_ids={7, 8},
        )


def _facade() -> Any:
    facade: Any = object.__new__(DisaggPushConnector)
    facade._worker = _StubWorker()
    facade._scheduler = None
    facade._failed_blocks = set()
    facade._stats = DisaggPushConnector.build_kv_connector_stats()
    return facade


def test_both_worker_result_apis() -> None:
    new = _facade().get_transfer_results({"x"})
    assert isinstance(new, KVConnectorTransferResults)
    assert new.finished_recving == {"d-ok", "d-bad"} and new.failed_recving == {"d-bad"}
    assert _facade().get_transfer_results().finished_sending == {"p-1"}  # 0.33 style call
    old = _facade()
    assert old.get_finished(set()) == ({"p-1"}, {"d-ok", "d-bad"})
    assert old.get_block_ids_with_load_errors() == {7, 8}
    assert old.get_block_ids_with_load_errors() == set()


def test_a_steps_decisions_reach_the_worker_before_its_forward_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's model runner calls ``start_load_kv`` after the forward pass when a step loads
    nothing synchronously; a finished prefill must reach P's writer before that forward, which
    on a busy P is the next request's prefill."""
    mixin = importlib.import_module("vllm.v1.worker.kv_connector_model_runner_mixin")
    facade = _facade()
    monkeypatch.setattr(mixin, "get_kv_transfer_group", lambda: facade)
    monkeypatch.setattr(mixin, "get_forward_context", lambda: None)
    meta = PushConnectorMetadata()
    meta.finished_prefills.append(SendSpec("p-1", "t:1", (3, 4)))
    step = SimpleNamespace(
        kv_connector_metadata=meta, has_sync_kv_loads=False, finished_req_ids=set()
    )
    with mixin.KVConnectorModelRunnerMixin._get_kv_connector_output(step):
        assert facade._worker.steps == [meta]  # the forward pass runs here
    assert facade._worker.steps == [meta]  # handed over once
