"""Free loopback TCP ports for tests and dev stacks.

Who calls it: fixtures and :mod:`devstack.stack` before starting servers. A port is checked by
binding it and closing the socket, so it is free when handed out, and the caller binds it later
(a vLLM instance binds its connector's side channel half a minute after start). Ports are taken
below the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) when it leaves
room: the kernel hands ports of that range to every bind of port 0 and to every outgoing
connection of every process, so a port from it (what binding port 0 here would give) can be
taken by a vLLM instance's own sockets or connections before the caller binds it. Below the
range only an explicit bind can take it. :func:`free_ports` hands out distinct ports within one
call, which is what a stack needs; where the range cannot be read, ports come from binding port 0.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000
_MIN_CHOICES = 1000
_TRIES = 200
_random = random.SystemRandom()  # independent of any seed a test sets on ``random``


def fixed_port_range() -> range | None:
    """The ports below the ephemeral range, from 10000 (``None``: unknown, or too few)."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(_LOWEST, low) if low - _LOWEST >= _MIN_CHOICES else None


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that was free on ``host`` a moment ago."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct ports, all bound at once so they cannot repeat within the call."""
    choices = fixed_port_range()
    sockets: list[socket.socket] = []
    taken: set[int] = set()
    try:
        for _ in range(count):
            sock = _bind_one(host, choices, taken)
            sockets.append(sock)
            taken.add(int(sock.getsockname()[1]))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _bind_one(host: str, choices: range | None, taken: set[int]) -> socket.socket:
    """A socket bound to a random free port of ``choices`` not in ``taken`` (port 0 when none
    is free). ``taken`` is checked here, not left to the bind: with ``SO_REUSEADDR`` Linux lets
    two sockets that do not listen bind the same port, so a port drawn twice would bind twice."""
    if choices is not None:
        for _ in range(_TRIES):
            port = _random.choice(choices)
            sock = None if port in taken else _bound(host, port)
            if sock is not None:
                return sock
    sock = _socket()
    sock.bind((host, 0))
    return sock


def _bound(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``port``; None when the bind fails (the port is taken)."""
    sock = _socket()
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def free_port_runs(count: int, length: int, host: str = LOOPBACK) -> list[int]:
    """Return the first ports of ``count`` runs of ``length`` consecutive free ports, all
    distinct (a tensor-parallel instance's side channels listen on ``first + rank``)."""
    if length <= 1:
        return free_ports(count, host)
    choices = fixed_port_range()
    held: list[socket.socket] = []
    taken: set[int] = set()  # held here (see _bind_one: a second bind would not fail)
    firsts: list[int] = []
    try:
        for _ in range(_TRIES):
            if len(firsts) == count:
                break
            first = _bind_one(host, choices, taken)
            run = [first]
            start = int(first.getsockname()[1])
            for port in range(start + 1, start + length):
                sock = None if port in taken else _bound(host, port)
                if sock is None:
                    break
                run.append(sock)
            held += run
            taken.update(range(start, start + len(run)))
            if len(run) == length:
                firsts.append(start)
        if len(firsts) < count:
            raise OSError(f"no {count} runs of {length} free ports on {host}")
        return firsts
    finally:
        for sock in held:
            sock.close()
