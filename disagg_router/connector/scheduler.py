"""Scheduler side of the connector (runs in vLLM's scheduler; no NIXL, no sockets).

Who calls it: the facade, from vLLM's scheduler hooks. It only decides and records; all I/O
happens on the worker side, which receives the decisions through
:class:`~disagg_router.connector.metadata.PushConnectorMetadata`.

D (``do_remote_prefill``): reports the prompt tokens beyond D's own prefix-cache hit as loaded
asynchronously, registers the newly allocated blocks once, and on abort while waiting asks the
worker to cancel (vLLM itself holds the blocks until the worker reports the request).
P (``do_remote_decode``): on a successful finish keeps the blocks (returns ``True``) and hands
them to the worker's writer; on abort/error tells the worker so D learns at once.
Identity probes (the router's): P's answer carries the engine's :class:`EngineShape` besides
its identity; a bare probe (``identity_probe`` without a leg, sent to D) is answered with the
shape alone, so the router pairs only what the connector serves.

It reads the legs' ``kv_transfer_params`` and builds P's answer only through
:mod:`disagg_router.connector.contract` (``read_decode_leg``, ``read_prefill_leg``,
``prefill_answer_params``, ``engine_shape_params``), the functions the router and the fake
vLLM use too.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.request import Request, RequestStatus

from disagg_router.connector.contract import (
    DecodeLeg,
    EngineShape,
    PrefillLeg,
    engine_shape_params,
    is_decode_leg,
    is_identity_probe,
    prefill_answer_params,
    read_decode_leg,
    read_prefill_leg,
)
from disagg_router.connector.errors import ContractError
from disagg_router.connector.metadata import PushConnectorMetadata
from disagg_router.connector.specs import (
    KeyCancel,
    RecvSpec,
    SendAbort,
    SendSpec,
    transfer_key,
)

logger = logging.getLogger(__name__)


def engine_shape(vllm_config: Any) -> EngineShape:
    """This engine's shape as vLLM configured it (called once, by the facade)."""
    parallel = vllm_config.parallel_config
    return EngineShape(
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        block_size=int(vllm_config.cache_config.block_size),
        num_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
    )


class PushScheduler:
    """Per-engine scheduler state; see the module docstring."""

    def __init__(
        self,
        engine_id: str,
        host: str,
        port: int,
        block_size: int,
        tp_size: int = 1,
        shape: EngineShape | None = None,
    ) -> None:
        """``tp_size``: P's tensor parallel size (its ranks listen on ``port`` + rank);
        ``shape``: what identity probes are answered (default: TP=``tp_size``, PP=1,
        ``block_size``)."""
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.block_size = block_size
        self.tp_size = tp_size
        """This instance's tensor-parallel size, in P's answer (D's ranks find P's at
        ``port + rank``)."""
        self._handled: set[str] = set()  # D requests already answered (never register twice)
        self._waiting: set[str] = set()  # D requests registered, not yet reported by the worker
        self._sending: set[str] = set()  # P requests whose blocks the worker still holds
        self._meta = PushConnectorMetadata()
        self.shape = shape or EngineShape(tp_size=tp_size, pp_size=1, block_size=block_size)

    # ---- D ---------------------------------------------------------------------------------
    def _remote(self, request: Request) -> DecodeLeg | None:
        """The D leg ``request`` carries, if it is one this connector can serve."""
        try:
            leg = read_decode_leg(request.kv_transfer_params)
        except ContractError as exc:
            logger.error("request %s: %s; prefilling locally", request.request_id, exc)
            return None
        if leg is not None and (leg.peer.tp_size < 1 or leg.peer.pp_size < 1):
            logger.error(
                "request %s: P has tp_size=%s pp_size=%s; prefilling locally",
                request.request_id,
                leg.peer.tp_size,
                leg.peer.pp_size,
            )
            return None
        return leg

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens P will push: the prompt beyond D's local hit (async), else ``(0, False)``."""
        if request.request_id in self._handled or self._remote(request) is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        """Register the blocks allocated for the pushed tokens (first call only)."""
        leg = self._remote(request)
        if leg is None or request.request_id in self._handled:
            return
        self._handled.add(request.request_id)
        key = transfer_key(leg.transfer_id, request.request_id)
        host, port = leg.peer.host, leg.peer.port
        if num_external_tokens <= 0:
            # Full local hit: nothing to receive; let P free its blocks now.
            self._meta.key_cancels.append(
                KeyCancel(key, host, port, leg.peer.tp_size, leg.peer.pp_size)
            )
            return
        all_ids = blocks.get_block_ids()[0]
        new_ids = blocks.get_unhashed_block_ids_all_groups()[0]
        first_block = len(all_ids) - len(new_ids)
        self._waiting.add(request.request_id)
        self._meta.registrations.append(
            RecvSpec(
                d_request_id=request.request_id,
                transfer_key=key,
                p_engine_id=leg.peer.engine_id,
                host=host,
                port=port,
                block_ids=tuple(new_ids),
                first_block=first_block,
                p_tp_size=leg.peer.tp_size,
                p_pp_size=leg.peer.pp_size,
            )
        )
        logger.debug(
            "request %s: registering %d blocks (from block %d) for %s",
            request.request_id,
            len(new_ids),
            first_block,
            key,
        )

    # ---- both --------------------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once per finished request before vLLM frees its blocks."""
        rid = request.request_id
        if rid in self._handled or is_decode_leg(request.kv_transfer_params):
            return self._d_finished(request)
        p_leg = read_prefill_leg(request.kv_transfer_params)
        if p_leg is not None:
            return self._p_finished(request, p_leg, block_ids)
        if is_identity_probe(request.kv_transfer_params):
            return False, engine_shape_params(self.shape)  # D's identity probe: its shape
        return False, None

    def _d_finished(self, request: Request) -> tuple[bool, None]:
        rid = request.request_id
        was_handled = rid in self._handled
        self._handled.discard(rid)
        if rid in self._waiting:
            # Aborted while waiting: vLLM keeps the blocks until the worker reports rid.
            self._meta.cancels.append(rid)
        elif not was_handled and (leg := self._remote(request)) is not None:
            # Finished before any block was allocated: let P free its prefill now.
            key = transfer_key(leg.transfer_id, rid)
            peer = leg.peer
            cancel = KeyCancel(key, peer.host, peer.port, peer.tp_size, peer.pp_size)
            self._meta.key_cancels.append(cancel)
        return False, None

    def _p_finished(
        self, request: Request, leg: PrefillLeg, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        key = transfer_key(leg.transfer_id, rid)
        ok = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not ok or not block_ids:
            reason = f"prefill ended with status {request.status.name}"
            self._meta.failed_prefills.append(SendAbort(key, reason))
            return False, None
        # An identity probe (the router's) is answered who we are; it keeps nothing.
        kept = () if leg.probe else tuple(block_ids)
        out = prefill_answer_params(
            engine_id=self.engine_id,
            host=self.host,
            port=self.port,
            request_id=rid,
            block_ids=kept,
            num_tokens=request.num_computed_tokens,
            tp_size=self.tp_size,
            pp_size=self.shape.pp_size,
            transfer_id=leg.transfer_id,
        )
        out.update(engine_shape_params(self.shape))
        if leg.probe:
            return False, out
        self._sending.add(rid)
        self._meta.finished_prefills.append(SendSpec(rid, key, kept))
        return True, out

    # ---- step plumbing -------------------------------------------------------------------
    def build_connector_meta(self) -> PushConnectorMetadata:
        meta, self._meta = self._meta, PushConnectorMetadata()
        return meta

    def update_connector_output(
        self, finished_sending: set[str] | None, finished_recving: set[str] | None
    ) -> None:
        self._sending.difference_update(finished_sending or ())
        self._waiting.difference_update(finished_recving or ())

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while P holds blocks for D or work has not reached the worker."""
        m = self._meta
        queued = m.registrations or m.cancels or m.key_cancels or m.finished_prefills
        return bool(self._sending or queued or m.failed_prefills)
