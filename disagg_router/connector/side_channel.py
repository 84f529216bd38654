"""P's side channel: a tiny threaded TCP server with length-prefixed frames (stdlib only).

One request frame and one reply frame per connection. The handler runs on the server's
connection thread and must answer quickly (it only takes a lock and updates dicts). An error the
handler did not expect closes that one connection (the peer sees a side-channel error and keeps
its own bounds), goes to ``on_error`` and the server goes on serving.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from disagg_router.connector.errors import ProtocolError, SideChannelError, SideChannelRefusedError
from disagg_router.connector.protocol import MAX_FRAME_BYTES

_HEADER = struct.Struct("!I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise SideChannelError("connection closed mid-frame")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes:
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return _recv_exact(sock, length)


def request(host: str, port: int, payload: bytes, timeout_s: float) -> bytes:
    """Send one frame to ``host:port`` and return the reply frame; bounded by ``timeout_s``.

    Raises :class:`SideChannelRefusedError` when nothing listens there, and
    :class:`SideChannelError` for any other failure (timeout, reset, truncated reply).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            send_frame(sock, payload)
            return recv_frame(sock)
    except ConnectionRefusedError as exc:
        raise SideChannelRefusedError(f"side channel {host}:{port}: {exc}") from exc
    except OSError as exc:
        raise SideChannelError(f"side channel {host}:{port}: {exc}") from exc


class SideChannelServer:
    """Serves ``handler(request_bytes) -> reply_bytes`` on ``host:port`` (port 0: ephemeral).

    ``on_error`` gets what a connection's handler raised beyond the side channel's own errors
    (called on that connection's thread); ``run`` runs the serving loop (e.g.
    :meth:`disagg_router.connector.supervision.CoreHealth.run`, so that a serving loop that ends is
    noticed).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[bytes], bytes],
        on_error: Callable[[BaseException], None],
        run: Callable[[str, Callable[[], None]], None],
    ) -> None:
        outer_handler = handler

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                sock.settimeout(10.0)
                try:
                    data = recv_frame(sock)
                    send_frame(sock, outer_handler(data))
                except (OSError, ProtocolError, SideChannelError):
                    return

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                """socketserver's hook for an error a connection's handler raised."""
                exc = sys.exc_info()[1]
                if exc is not None:
                    on_error(exc)

        self._server = _Server((host, port), _Handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=run,
            args=("dpc-side-channel", self._serve),
            daemon=True,
            name="dpc-side-channel",
        )
        self._thread.start()

    def _serve(self) -> None:
        self._server.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
