"""Container-engine helpers for the docker deploy test: the shared e2e lock and compose projects.

Who calls it: tests/deploy/test_deploy_compose_docker.py. The lock is ``/tmp/vllm-e2e.lock`` (the
team's lock for anything that loads the 2 cores); if an ancestor process already holds it (the test
run was started under ``flock /tmp/vllm-e2e.lock ...``) it is not taken again, which would deadlock.
:class:`ComposeProject` always runs ``docker-compose`` with an explicit project name and file, so
teardown removes exactly what the test created.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

E2E_LOCK = Path(os.environ.get("VLLM_E2E_LOCK", "/tmp/vllm-e2e.lock"))


def _ancestors() -> set[int]:
    pids: set[int] = set()
    pid = os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4: the parent's pid
    return pids


def flock_holders(path: Path) -> set[int]:
    """Pids holding a flock on ``path`` according to /proc/locks."""
    inode = os.stat(path).st_ino
    holders: set[int] = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "FLOCK" in fields and "->" not in fields:
            pid, dev_inode = fields[-4], fields[-3]
            if dev_inode.rsplit(":", 1)[-1] == str(inode):
                holders.add(int(pid))
    return holders


@contextmanager
def e2e_lock(path: Path = E2E_LOCK) -> Iterator[None]:
    """Hold the shared e2e lock (blocking) unless this process or an ancestor already holds it."""
    path.touch(exist_ok=True)
    if flock_holders(path) & _ancestors():
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class ComposeProject:
    """One ``docker-compose`` project: a binary, a compose file, a name and its environment."""

    compose: str
    file: Path
    name: str
    env: Mapping[str, str]

    def run(self, *args: str, timeout: float, check: bool = True) -> str:
        """Run ``docker-compose -p NAME -f FILE ARGS``; return stdout (stderr joined on failure)."""
        result = subprocess.run(
            [self.compose, "-p", self.name, "-f", str(self.file), *args],
            env=dict(self.env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"docker-compose {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        return result.stdout

    def published_port(self, service: str, port: int) -> int:
        """The loopback host port published for ``service``'s container ``port``."""
        out = self.run("port", service, str(port), timeout=60).strip()
        host, _, host_port = out.rpartition(":")
        assert host == "127.0.0.1", f"{service}:{port} published on {host!r}, not loopback"
        return int(host_port)

    def health_logs(self) -> str:
        """Each of the project's containers: its name and health state with the last checks'
        output (``docker inspect``), for a failure's report: a health check that never passed
        says why only there."""
        label = f"label=com.docker.compose.project={self.name}"
        ids = subprocess.run(
            ["docker", "ps", "-a", "-q", "--filter", label],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout.split()
        if not ids:
            return "(no containers)"
        form = "{{.Name}} {{.State.Status}} {{json .State.Health}}"
        out = subprocess.run(
            ["docker", "inspect", "--format", form, *ids],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return (out.stdout + out.stderr)[-8000:]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes still labelled with this project (should be none)."""
        label = f"label=com.docker.compose.project={self.name}"
        found: dict[str, list[str]] = {}
        for kind, cmd in (
            ("containers", ["docker", "ps", "-a", "-q", "--filter", label]),
            ("networks", ["docker", "network", "ls", "-q", "--filter", label]),
            ("volumes", ["docker", "volume", "ls", "-q", "--filter", label]),
        ):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
            found[kind] = out.stdout.split()
        return found
