"""Engine shapes (TP, PP, block size, KV heads) learned by identity probes, and the refused pairs.

Who calls it: the health monitor (:mod:`disagg_router.router.health.monitor`): :func:`learn_shape`
with the ``kv_transfer_params`` of every identity probe answer (P's, and D's bare probe built by
:func:`decode_probe_body`), :func:`count_refused` after its checks. The shape is stored on the
backend's state (:attr:`BackendState.shape`), where the pair choice
(:mod:`disagg_router.router.routing.pairing`) and ``/ready`` read it. An answer without a shape (a
connector that does not speak shapes, vLLM without our connector) leaves the backend's shape
unknown: it pairs with every other one, as before shapes existed, and that is logged once per
backend. Nothing here awaits; all of it runs on the router's event loop.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import Gauge

from disagg_router.connector.contract import (
    KV_TRANSFER_PARAMS,
    identity_probe_params,
    read_engine_shape,
)
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.pairing import refused_pairs
from disagg_router.router.routing.table import RoutingTable

log = logging.getLogger(__name__)


def decode_probe_body(model: str, prompt: str) -> dict[str, Any]:
    """D's identity probe: a 1-token completion whose ``kv_transfer_params`` mark a bare identity
    probe (no leg: D prefills it locally and keeps nothing)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        KV_TRANSFER_PARAMS: identity_probe_params(),
    }


def learn_shape(backend: BackendState, kv: Mapping[str, Any] | None) -> bool:
    """Record the shape ``kv`` carries (none: unknown); True (logged) if it changed.

    Raises ``ValueError`` naming the field when the shape is malformed (the probe fails)."""
    try:
        shape = read_engine_shape(kv)
    except ValueError as exc:  # the contract's ContractError
        raise ValueError(f"bad engine shape from {backend.role} {backend.label}: {exc}") from exc
    if shape is None and not backend.shape_unknown_logged:
        backend.shape_unknown_logged = True
        log.info(
            "%s %s answers its identity probe without an engine shape; paired with every "
            "instance (its connector does not speak shapes)",
            backend.role,
            backend.label,
        )
    if shape == backend.shape:
        return False
    log.info("%s %s shape: %s (was %s)", backend.role, backend.label, shape, backend.shape)
    backend.shape = shape
    backend.shape_unknown_logged = shape is None and backend.shape_unknown_logged
    return True


def speaks_shapes(table: RoutingTable, decode: BackendState) -> bool:
    """Whether a P paired with ``decode`` (in any model's pools) reported a shape: only then is
    ``decode`` probed for its own."""
    return any(
        p.shape is not None
        for found in table.models.values()
        if any(d is decode for d in found.decode.backends)
        for p in found.prefill.backends
    )


def unprobed_decodes(table: RoutingTable, prefill: BackendState) -> list[BackendState]:
    """The D's paired with ``prefill`` (in any model's pools) never probed yet, once each."""
    found_ds = {
        id(d): d
        for found in table.models.values()
        if any(p is prefill for p in found.prefill.backends)
        for d in found.decode.backends
        if d.identity_learned_at is None
    }
    return list(found_ds.values())


def count_refused(table: RoutingTable, gauge: Gauge, shown: set[str]) -> set[str]:
    """Set ``gauge{model}`` to each model's refused pairs; drop models no longer served (in
    ``shown``, the models set last time). Returns the models set now."""
    now = set(table.models)
    for model, found in table.models.items():
        gauge.labels(model).set(len(refused_pairs(found.prefill.backends, found.decode.backends)))
    for gone in shown - now:
        with contextlib.suppress(KeyError):  # already removed
            gauge.remove(gone)
    return now
