"""A real DNS server for tests: dnsmasq on a loopback address, serving names from a hosts file.

Who uses it: the DNS discovery tests. ``DnsServer(tmp_path)`` starts dnsmasq (a child process in
its own group, stopped on exit) answering only for names it knows; ``set_hosts`` rewrites the
hosts file, sends SIGHUP, and returns once dnsmasq logged the re-read, so the next query sees the
new records. SRV records are fixed at start (dnsmasq does not re-read them). dnsmasq comes from
Debian (``dnsmasq-base``; deploy/ci/install-tools.sh installs it); without it the tests skip, or
fail when ``DISAGG_DEPLOY_REQUIRE_TOOLS=1``.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import pytest

from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessSpec
from tests.support.wait import wait_until

LISTEN = "127.0.0.1"
DOMAIN = "disagg.test"


def dnsmasq_binary() -> str:
    """The dnsmasq executable; skip (or fail where tools are required) when it is missing."""
    found = shutil.which("dnsmasq", path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin")
    if found is None:
        message = "dnsmasq is not installed (deploy/ci/install-tools.sh installs dnsmasq-base)"
        if os.environ.get("DISAGG_DEPLOY_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


class DnsServer:
    """dnsmasq answering for ``*.disagg.test`` on ``127.0.0.1:<port>``."""

    def __init__(self, workdir: Path, srv: Sequence[tuple[str, str, int]] = ()) -> None:
        """``srv``: (name, target, port) SRV records, fixed for the server's life."""
        self.port = free_port(LISTEN)
        self.hosts = workdir / "dns-hosts"
        self.hosts.write_text("")
        argv = [
            dnsmasq_binary(),
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            f"--local=/{DOMAIN}/",
            f"--addn-hosts={self.hosts}",
            f"--listen-address={LISTEN}",
            "--bind-interfaces",
            f"--port={self.port}",
            "--local-ttl=0",
            "--pid-file=",
            "--log-facility=-",
            *(f"--srv-host={name},{target},{port}" for name, target, port in srv),
        ]
        if os.geteuid() == 0:
            argv.append("--user=root")  # keep the rights to read the hosts file on SIGHUP
        self._process = ChildProcess(ProcessSpec("dnsmasq", tuple(argv), workdir / "dnsmasq.log"))
        self._reads = 0

    def start(self) -> DnsServer:
        self._process.start()
        self._await_read()
        return self

    def set_hosts(self, records: Mapping[str, Sequence[str]]) -> None:
        """Serve exactly ``records`` (name -> addresses) from now on."""
        lines = [
            f"{address} {name}" for name, addresses in records.items() for address in addresses
        ]
        self.hosts.write_text("".join(line + "\n" for line in lines))
        pid = self._process.pid
        assert pid is not None
        os.kill(pid, signal.SIGHUP)
        self._await_read()

    def _await_read(self) -> None:
        """Wait until dnsmasq logged one more read of the hosts file than before."""
        marker = f"read {self.hosts}"
        expected = self._reads + 1

        def reads() -> bool:
            if self._process.poll() is not None:
                raise RuntimeError(f"dnsmasq exited:\n{self._process.log_tail()}")
            return self._process.log_path.read_text().count(marker) >= expected

        wait_until(reads, timeout=10, what="dnsmasq to read its hosts file")
        self._reads = expected

    def stop(self) -> None:
        self._process.stop(grace_s=5)

    def __enter__(self) -> DnsServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
