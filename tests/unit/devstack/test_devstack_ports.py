"""Free ports: distinct within a call, free when handed out, outside the ephemeral range."""

from __future__ import annotations

import socket

import pytest

from devstack.ports import LOOPBACK, fixed_port_range, free_port_runs, free_ports


def test_ports_are_distinct_and_free() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, port))


def test_ports_come_from_below_the_ephemeral_range() -> None:
    """The kernel gives ephemeral ports to other processes' sockets and connections at any
    time; a port handed out here must not be one of them."""
    choices = fixed_port_range()
    if choices is None:
        pytest.skip("no ephemeral port range to stay out of on this system")
    assert all(port in choices for port in free_ports(8))


class _Repeating:
    """Draws the same port again before another: what a random draw does now and then."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = iter(ports)

    def choice(self, _: range) -> int:
        return next(self._ports)


def test_a_port_drawn_twice_is_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux lets two sockets with SO_REUSEADDR that do not listen bind one port, so the
    second bind of a repeated draw succeeds: the repeat must be refused by the call itself."""
    choices = fixed_port_range()
    if choices is None:
        pytest.skip("ports come from binding port 0 on this system")
    first, other = free_ports(2)
    monkeypatch.setattr("devstack.ports._random", _Repeating([first, first, other]))
    assert free_ports(2) == [first, other]


def test_runs_of_ports_do_not_overlap_when_a_draw_repeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    choices = fixed_port_range()
    if choices is None:
        pytest.skip("ports come from binding port 0 on this system")
    [a, b] = free_port_runs(2, 2)
    monkeypatch.setattr("devstack.ports._random", _Repeating([a, a + 1, a, b]))
    firsts = free_port_runs(2, 2)
    ports = [p for first in firsts for p in (first, first + 1)]
    assert len(set(ports)) == 4
