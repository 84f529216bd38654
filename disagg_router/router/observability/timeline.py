"""Where a dispatch's time to first token goes, from the timestamps the router itself sees.

Who uses it: a dispatch attempt (:class:`disagg_router.router.dispatch.state.Attempt`) marks the
moments below (seconds since it started) and, once the first event is handed to the client, its
relay records :func:`ttft_stages` into the ``disagg_router_ttft_stage_seconds`` histogram. What
happens inside P and D (queueing, the KV WRITE, D's first step) is not visible here; vLLM's and the
connector's own metrics split it further (docs/router.md, "Where TTFT goes").
"""

from __future__ import annotations

from collections.abc import Mapping

STAGES = (
    "accept_to_legs_sent",
    "prefill",
    "prefill_done_to_first_token",
    "decode_to_first_token",
    "relay_to_client",
)
"""The stage labels, in request order (``decode_to_first_token``: D alone, no P leg)."""


def ttft_stages(timings: Mapping[str, float]) -> dict[str, float]:
    """Seconds per stage of :data:`STAGES` that applies to a dispatch, from its marks
    (``prefill_sent``, ``prefill_done``, ``decode_sent``, ``first_token``, ``client_first``:
    seconds since it was accepted); they add up to the router's TTFT (accepted until the first
    event was handed to the client). Empty until both ``first_token`` and ``client_first``.

    ``accept_to_legs_sent``: until the last leg sent before P answered (push: both, pull: P, D
    alone: D). ``prefill``: from then until P answered or D's first token, whichever came first
    (P's queue and prefill, as the router sees them). ``prefill_done_to_first_token``: P
    answered until D's first token (the KV reaching D, D's first step; in pull mode also sending
    the D leg); 0 when D's token came first. ``decode_to_first_token``: D alone, sent until its
    first token. ``relay_to_client``: D's first token until the first event was handed to the
    client's connection.
    """
    first, client = timings.get("first_token"), timings.get("client_first")
    if first is None or client is None:
        return {}
    out: dict[str, float] = {}
    p_sent, p_done = timings.get("prefill_sent"), timings.get("prefill_done")
    d_sent = timings.get("decode_sent")
    if p_sent is None:
        if d_sent is not None:
            out["accept_to_legs_sent"] = d_sent
            out["decode_to_first_token"] = first - d_sent
    else:
        sent = [p_sent]
        if d_sent is not None and (p_done is None or d_sent <= p_done):
            sent.append(d_sent)
        legs_sent = max(sent)
        out["accept_to_legs_sent"] = legs_sent
        p_end = first if p_done is None else min(p_done, first)
        out["prefill"] = max(p_end - legs_sent, 0.0)
        out["prefill_done_to_first_token"] = first - p_end
    out["relay_to_client"] = client - first
    return out
