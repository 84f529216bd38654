"""The facade against the installed vLLM's connector API (run on 0.32 and 0.33)."""

from __future__ import annotations

import importlib
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorTransferResults,
    supports_hma,
)

import connector
from connector.facade import DisaggPushConnector
from connector.worker import WorkerStep


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
    """Stands in for PushWorker.collect(): one finished send, one ok and one failed receive."""

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
