"""Steady client traffic through a router, from worker threads, for membership-change tests.

``Traffic(url)`` runs ``workers`` threads that each send non-streamed completions one after the
other until ``stop()`` (or ``limit`` requests in all); every request is recorded with the
monotonic time it was sent, its HTTP status and the router's ``X-Request-Id``.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Sent:
    sent_at: float
    status: int
    request_id: str
    prompt: str


class Traffic:
    def __init__(self, url: str, model: str, workers: int = 2, limit: int = 3000) -> None:
        self.url = url
        self.model = model
        self.results: list[Sent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._numbers = itertools.count()
        self._limit = limit
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]

    def start(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def _work(self) -> None:
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(30.0)) as client:
            while not self._stop.is_set():
                n = next(self._numbers)
                if n >= self._limit:
                    return
                prompt = f"request {n}: tell me about membership changes"
                body = {"model": self.model, "prompt": prompt, "max_tokens": 4}
                sent_at = time.monotonic()
                response = client.post("/v1/completions", json=body)
                sent = Sent(
                    sent_at, response.status_code, response.headers.get("x-request-id", ""), prompt
                )
                with self._lock:
                    self.results.append(sent)

    def done(self) -> list[Sent]:
        with self._lock:
            return list(self.results)

    def completed_after(self, moment: float) -> int:
        return sum(1 for s in self.done() if s.sent_at > moment)

    def stop(self) -> list[Sent]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        return self.done()
