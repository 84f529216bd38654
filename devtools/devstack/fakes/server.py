"""Serve an ASGI app (a fake vLLM, or the router itself) with uvicorn on a free loopback port.

Who uses it: tests, the e2e support code and the bench. ``stop()`` leaves no thread behind.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import uvicorn

from devstack.fakes.state import FakeVllmState
from devstack.fakes.vllm_app import create_fake_app
from disagg_router.router.server import listening_socket


class UvicornThread:
    """Serves any ASGI app on ``host:<free port>`` with uvicorn in a daemon thread.

    ``lifespan`` is passed to uvicorn ("on" for apps with startup work, like the router).
    ``host`` must be a loopback address (127.0.0.0/8 all route to ``lo`` on Linux, so several
    servers can share one port on 127.0.0.2, 127.0.0.3, ...).
    Use as a context manager or call ``start()``/``stop()``; ``url`` is the base URL.
    """

    def __init__(
        self,
        app: Any,
        lifespan: Literal["on", "off"] = "on",
        port: int = 0,
        host: str = "127.0.0.1",
        http: Any = "auto",
    ) -> None:
        """``http``: uvicorn's HTTP protocol (a class, such as the router's own, or a name)."""
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"{host} is not a loopback address")
        self._sock = listening_socket(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            lifespan=lifespan,
            http=http,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> UvicornThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn server did not start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> UvicornThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeVllmServer(UvicornThread):
    """One fake vLLM instance on a free loopback port; ``state`` steers and records it."""

    def __init__(
        self, state: FakeVllmState | None = None, port: int = 0, host: str = "127.0.0.1"
    ) -> None:
        """``port`` 0 picks a free one; a fixed port lets a test "restart" an instance."""
        self.state = state or FakeVllmState()
        super().__init__(create_fake_app(self.state), lifespan="off", port=port, host=host)


@contextmanager
def fake_vllm(state: FakeVllmState | None = None) -> Iterator[FakeVllmServer]:
    """Context manager: a started fake, stopped on exit."""
    server = FakeVllmServer(state)
    server.start()
    try:
        yield server
    finally:
        server.stop()
