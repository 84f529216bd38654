"""Record one real vLLM CPU instance's KV events for the router's KV index unit tests.

Who calls it: a developer, by hand, when vLLM's event format changes (``python -m
devstack.record_kv_events OUT.json``, under the shared vLLM lock). It starts one aggregated
instance of the tiny model with ``--kv-events-config`` (ZMQ publisher and replay socket on
loopback), sends a short scripted conversation (a completion, the same completion again, a chat
and its follow-up turn), and writes every published frame (topic, sequence number, msgpack payload
as hex) with the requests, their prompt token ids (vLLM's ``/tokenize``), the cached tokens vLLM
reported and how many frames had arrived before each was sent. Then it asks the replay socket for
everything from sequence 0 and records each answer's sequence number and payload digest. It
waits for the event stream to go quiet between requests (a dev tool, not a test). It never
touches the network beyond loopback.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import zmq

from devstack.ports import LOOPBACK, free_ports
from devstack.tiny_model import make_tiny_model
from devstack.vllm_server import VllmServer, VllmServerSpec

SYSTEM = "You are a terse assistant that answers questions about the tiny model. " * 24
FOX = "The quick brown fox jumps over the lazy dog. " * 50
TURN_1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a block?"}]
TURN_2 = [
    *TURN_1,
    {"role": "assistant", "content": "A run of tokens. " * 20},
    {"role": "user", "content": "And a prefix?"},
]
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": FOX}),
    ("/v1/completions", {"prompt": FOX + "Again."}),
    ("/v1/chat/completions", {"messages": TURN_1}),
    ("/v1/chat/completions", {"messages": TURN_2}),
    *[
        ("/v1/completions", {"prompt": f"Filler {n}: " + "lorem ipsum dolor " * 150})
        for n in range(3)
    ],
    ("/v1/completions", {"prompt": FOX}),
]
"""A repeated prompt, a chat and its follow-up, then fillers that evict (the cache holds 32 blocks
of 128 tokens, twice ``max_model_len``; the prompts are 1000 to 1500 tokens), then the first
prompt again; ``/reset_prefix_cache`` at the end clears everything."""
AFTER_RESET: tuple[str, dict[str, Any]] = ("/v1/completions", {"prompt": "After the reset."})
QUIET_S = 1.0


def _collect(sub: zmq.Socket[bytes], frames: list[list[str]], stop: threading.Event) -> None:
    while not stop.is_set():
        if sub.poll(100):
            frames.append([part.hex() for part in sub.recv_multipart()])


def _replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> list[list[str]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    out: list[list[str]] = []
    while sock.poll(5000):
        parts = sock.recv_multipart()
        # (sequence, sha256 of the payload): enough to compare with the live frames
        out.append([parts[2].hex(), hashlib.sha256(parts[3]).hexdigest()])
        if parts[2] == (-1).to_bytes(8, "big", signed=True):
            break
    sock.close(linger=0)
    return out


def _settle(frames: list[list[str]]) -> int:
    """The frame count once no new frame came for ``QUIET_S`` (events follow the answer)."""
    seen = -1
    while seen != len(frames):
        seen = len(frames)
        time.sleep(QUIET_S)
    return seen


def _send(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    full = {"model": "tiny", "max_tokens": 4, "temperature": 0.0, **body}
    answer = client.post(url + path, json=full).json()
    tok = {"model": "tiny", **body}
    tokens = client.post(url + "/tokenize", json=tok).json()["tokens"]
    return {"path": path, "body": body, "prompt_token_ids": tokens, "usage": answer["usage"]}


def _script(client: httpx.Client, url: str, frames: list[list[str]]) -> list[dict[str, Any]]:
    sent = []
    for path, body in REQUESTS:
        before = _settle(frames)
        sent.append({"frames_before": before, **_send(client, url, path, body)})
    client.post(url + "/reset_prefix_cache").raise_for_status()
    # The clear is published with the engine's next step: one more (sub-block) request.
    sent.append({"frames_before": _settle(frames), **_send(client, url, *AFTER_RESET)})
    _settle(frames)
    return sent


def _one_item_a_line(record: dict[str, Any]) -> str:
    """JSON with each list item (a frame, a request) compact on its own line: small, diffable."""
    lines = []
    for key, value in record.items():
        if isinstance(value, list):
            items = ",\n".join("  " + json.dumps(v, separators=(",", ":")) for v in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def record(out: Path, work: Path) -> None:
    http, pub, replay = free_ports(3)
    events: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://{LOOPBACK}:{replay}",
        "topic": "kv",
    }
    spec = VllmServerSpec(
        name="rec",
        model_dir=make_tiny_model(work / "tiny-model"),
        port=http,
        cpu_core=0,
        log_file=work / "rec.log",
        max_model_len=2048,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
        extra_args=(
            "--kv-events-config",
            json.dumps(events),
            "--enable-prompt-tokens-details",
            "--num-gpu-blocks-override",
            "32",
        ),
    )
    # vLLM binds a wildcard endpoint (and connects to a host one); subscribers connect.
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://{LOOPBACK}:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    frames: list[list[str]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_collect, args=(sub, frames, stop), daemon=True)
    reader.start()
    server = VllmServer(spec)
    with server, httpx.Client(timeout=httpx.Timeout(120.0)) as c:
        sent = _script(c, server.url, frames)
        stop.set()
        reader.join(timeout=5.0)
        replayed = _replay(ctx, events["replay_endpoint"])
    sub.close(linger=0)
    ctx.term()
    record = {"kv_events_config": events, "requests": sent, "frames": frames, "replay": replayed}
    out.write_text(_one_item_a_line(record))


if __name__ == "__main__":
    if len(sys.argv) > 2:  # a work directory that keeps vLLM's log
        record(Path(sys.argv[1]), Path(sys.argv[2]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            record(Path(sys.argv[1]), Path(tmp))
