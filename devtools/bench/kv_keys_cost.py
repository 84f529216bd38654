"""What computing a request's block keys costs the router (``kv_aware``), printed, not asserted.

Who calls it: a developer (``python -m bench.kv_keys_cost``), to size the tokenize cache and to
choose between tokenizing in the router and asking each instance's ``/tokenize``. It times, on
the tiny model's tokenizer: rendering + tokenizing + chain-hashing a chat (cold: a prompt never
seen; warm: the same prompt again; next turn: a seen conversation with one more turn, whose old
pieces are cached), per system prompt length; and
one loopback HTTP round trip to an in-process server (the least a ``/tokenize`` call could cost,
before vLLM's own tokenizing). No vLLM, no network beyond loopback.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from devstack.fake_vllm import FakeVllmServer, FakeVllmState
from devstack.tiny_model import make_tiny_model
from disagg_router.router.routing.block_keys import PromptTokenizer, load_tokenizer, request_keys

ROUNDS = 40


def _median_ms(run: Callable[[int], object]) -> float:
    times = []
    for i in range(ROUNDS):
        started = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def _chat(words: int, salt: int, turns: int = 1) -> dict[str, object]:
    system = " ".join(f"word{(i * 7 + salt) % 500}" for i in range(words))
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t} of {salt}: go on, please."})
        messages.append({"role": "assistant", "content": f"Answer {t}: " + "more words " * 40})
    messages.append({"role": "user", "content": f"Last question of {salt}."})
    return {"messages": messages}


def _row(tokenizer: PromptTokenizer, words: int) -> str:
    def cold(i: int) -> object:  # a prompt never seen
        return request_keys(tokenizer, _chat(words, 1000 + i), True, 128)

    def warm(i: int) -> object:  # the same prompt again
        return request_keys(tokenizer, _chat(words, 0), True, 128)

    def next_turn(i: int) -> object:  # a seen conversation with one more turn
        request_keys(tokenizer, _chat(words, 2000 + i, 3), True, 128)
        started = time.perf_counter()
        request_keys(tokenizer, _chat(words, 2000 + i, 4), True, 128)
        return time.perf_counter() - started

    found = tokenizer.token_ids(_chat(words, 0), True)
    n = len(found[0]) if found else 0
    turn_ms = 1000 * statistics.median(float(next_turn(i)) for i in range(ROUNDS))  # type: ignore[arg-type]
    return f"{words:5d}  {n:6d}  {_median_ms(cold):7.2f}  {_median_ms(warm):7.2f}  {turn_ms:9.2f}"


def main(work: Path) -> None:
    tokenizer = PromptTokenizer(load_tokenizer(str(make_tiny_model(work / "tiny"))), 4096, 1 << 20)
    print("words  tokens  cold ms  warm ms  next turn ms")
    for words in (500, 2000, 8000):
        print(_row(tokenizer, words))
    with FakeVllmServer(FakeVllmState("tiny")) as fake, httpx.Client() as client:
        http = _median_ms(lambda i: client.get(fake.url + "/health"))
    print(f"loopback HTTP round trip (lower bound of a /tokenize call): {http:.2f} ms")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp))
