"""Free loopback TCP ports for tests and dev stacks.

Who calls it: fixtures and :mod:`devstack.stack` before starting servers. The port is found
by binding port 0 and closing the socket, so another process may grab it before the caller binds;
:func:`free_ports` hands out distinct ports within one call, which is what a stack needs.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that was free on ``host`` a moment ago."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct ports, all bound at once so they cannot repeat within the call."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sockets.append(sock)
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
