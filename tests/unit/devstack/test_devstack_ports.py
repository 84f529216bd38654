"""Free ports: distinct within a call, free when handed out, outside the ephemeral range."""

from __future__ import annotations

import socket

import pytest

from devstack.ports import LOOPBACK, fixed_port_range, free_ports


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
