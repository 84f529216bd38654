"""Which P and D may serve a request together: the connector's pairing rule over learned shapes.

Who calls it: :mod:`disagg_router.router.dispatch.orchestrator` (:func:`choose_pair`, once per
disaggregated attempt; :func:`choose_decode_for` when D is bound late),
:mod:`disagg_router.router.health.readiness` and :mod:`disagg_router.router.health.shapes`
(:func:`refused_pairs`, for ``/ready`` and the
``disagg_router_refused_pairs`` gauge). The rule itself is the connector's
(:func:`disagg_router.connector.contract.pairing_refusal`); here it is applied to the shapes the
identity probes learned (:attr:`BackendState.shape`). A backend whose shape is unknown (its
connector answers none, or it was not probed) pairs with every other one, as before shapes existed.
Nothing here does I/O or awaits.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from disagg_router.connector.contract import pairing_refusal
from disagg_router.router.errors import NoBackendAvailable
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.policies.base import NO_INPUT, RoutingInput
from disagg_router.router.routing.pools import Pool


@dataclass(frozen=True)
class RefusedPair:
    """A P and a D the connector cannot serve together, and why."""

    prefill: str
    decode: str
    reason: str


def refusal(prefill: BackendState, decode: BackendState) -> str | None:
    """Why ``prefill`` and ``decode`` cannot be paired; ``None`` when they can (or a shape is
    unknown)."""
    if prefill.shape is None or decode.shape is None:
        return None
    return pairing_refusal(prefill.shape, decode.shape)


def refused_pairs(
    prefill: Iterable[BackendState], decode: Sequence[BackendState]
) -> list[RefusedPair]:
    """Every refused (P, D) combination of the given backends, P-major."""
    return [
        RefusedPair(p.label, d.label, why)
        for p in prefill
        for d in decode
        if (why := refusal(p, d)) is not None
    ]


def _refused_as(prefill: BackendState, decode: BackendState) -> str | None:
    """The refusal of the pair, naming both instances."""
    why = refusal(prefill, decode)
    return None if why is None else f"prefill {prefill.label} / decode {decode.label}: {why}"


def _first_refusal(prefill: BackendState, decode: Sequence[BackendState]) -> str | None:
    """``None`` when ``prefill`` pairs with one of ``decode`` (or there is none), else the
    reason it does not pair with the first. Stops at the first D that pairs: it runs for every
    candidate P of every request, so a scan of all D each time would cost P x D per request."""
    first = None
    for d in decode:
        why = _refused_as(prefill, d)
        if why is None:
            return None
        first = first or why
    return first


def choose_pair(
    prefill: Pool,
    decode: Pool,
    avoid: Collection[str] = (),
    request: RoutingInput = NO_INPUT,
    strict: bool = False,
    keep: BackendState | None = None,
) -> tuple[BackendState, BackendState]:
    """A served (P, D) pair, each counted in flight by its pool (see :meth:`Pool.choose`).

    P is chosen as :func:`choose_prefill` does, then D among those that pair with it;
    :class:`NoBackendAvailable` naming the refusal when no pair is served. When D cannot be
    chosen, P's count is given back before the error propagates."""
    p = _prefill(prefill, decode, avoid, request, strict, keep)
    try:
        d = choose_decode_for(p, decode, avoid, request, strict)
    except NoBackendAvailable:
        p.in_flight -= 1
        raise
    return p, d


def choose_prefill(
    prefill: Pool,
    decode: Pool,
    avoid: Collection[str] = (),
    request: RoutingInput = NO_INPUT,
    strict: bool = False,
    keep: BackendState | None = None,
) -> tuple[BackendState, BackendState]:
    """A P counted in flight, chosen among those that pair with at least one usable D
    (``keep`` itself when it is one of them and not avoided, whatever the policy), and the
    first usable D it pairs with, not counted and not chosen by D's policy (a stand-in until D
    is chosen: :func:`choose_decode_for`). :class:`NoBackendAvailable` names the refusal when
    no P pairs with a D."""
    p = _prefill(prefill, decode, avoid, request, strict, keep)
    usable = decode.usable()
    stand_in = next((d for d in usable if d.label not in avoid and refusal(p, d) is None), None)
    stand_in = stand_in or next((d for d in usable if refusal(p, d) is None), None)
    if stand_in is None or (strict and stand_in.label in avoid):
        p.in_flight -= 1
        raise NoBackendAvailable(f"no decode instance pairs with prefill {p.label}")
    return p, stand_in


def _prefill(
    prefill: Pool,
    decode: Pool,
    avoid: Collection[str],
    request: RoutingInput,
    strict: bool,
    keep: BackendState | None,
) -> BackendState:
    """P as :func:`choose_prefill` chooses it, counted in flight."""
    decodes = [d for d in decode.usable() if d.label not in avoid] if strict else decode.usable()

    def refuse(b: BackendState) -> str | None:
        return _first_refusal(b, decodes)

    p = None if keep is None or keep.label in avoid else prefill.claim(keep, refuse)
    return p or prefill.choose(avoid, request, strict, refuse=refuse)


def choose_decode_for(
    prefill: BackendState,
    decode: Pool,
    avoid: Collection[str] = (),
    request: RoutingInput = NO_INPUT,
    strict: bool = False,
) -> BackendState:
    """A D that pairs with ``prefill``, counted in flight by its pool; :class:`NoBackendAvailable`
    naming the refusal when none does. Also called alone when D is bound after P
    (:mod:`disagg_router.router.dispatch.binding`)."""
    return decode.choose(avoid, request, strict, refuse=lambda b: _refused_as(prefill, b))
