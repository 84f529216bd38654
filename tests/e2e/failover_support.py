"""What the real-vLLM D failover tests share: their 1P2D stack, P's lease, stopping, killing
and restarting an instance, P's block size, waiting for the KV blocks to be given back.

Who uses it: tests/e2e/test_decode_failover_e2e.py, test_failover_matrix.py and
test_fault_matrix.py (restarting a killed instance).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import psutil
import pytest

from devstack.process import group_members
from devstack.stack import Stack, StackInstance, StackOptions
from devstack.vllm_server import VllmServer
from tests.e2e.e2e_support import kv_blocks, module_stack
from tests.support.wait import wait_until

OURS = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("disagg_router.connector.facade") is None,
        reason="disagg_router.connector.facade (our vLLM connector) is not in this checkout",
    ),
]
"""The marks of a module that runs real vLLM with our connector."""
LEASE_S = 10.0
"""P's lease on a finished prefill's blocks (shorter than the default 30 s: P's blocks of a dead
D's transfer are back within it)."""
MARGIN_S = 10.0


@contextlib.contextmanager
def failover_stack(e2e_dir: Path, extra_args: Sequence[str] = ()) -> Iterator[Stack]:
    """1P2D with our connector, eager, P's lease ``LEASE_S``, for one module."""
    options = StackOptions(
        kind="ours",
        topology="1p2d",
        enforce_eager=True,
        connector_extra_config={"lease_s": LEASE_S},
        extra_args=tuple(extra_args),
    )
    with module_stack(options, e2e_dir) as started:
        yield started


def until_kv_freed(instances: Sequence[StackInstance]) -> None:
    """Wait until each of ``instances`` holds no KV blocks, up to P's lease and a margin (P's
    blocks of a dead D's transfer come back when the lease ends)."""
    for instance in instances:
        wait_until(
            lambda instance=instance: kv_blocks(instance) == 0,  # type: ignore[misc]
            timeout=LEASE_S + MARGIN_S,
            what=f"{instance.name}'s KV blocks back to 0",
        )


def block_size(instance: StackInstance) -> int:
    """The instance's KV block size (vLLM's ``cache_config_info``)."""
    text = httpx.get(f"{instance.url}/metrics", timeout=10).text
    found = re.search(r'block_size="(\d+)"', text)
    assert found is not None, "vllm:cache_config_info names the block size"
    return int(found.group(1))


@contextlib.contextmanager
def stopped(instance: StackInstance) -> Iterator[None]:
    """Every process of ``instance`` that serves requests stopped (SIGSTOP) until the block ends;
    continued then, however it is left (a killed one is gone: nothing to continue).
    multiprocessing's resource trackers keep running: they serve nothing, and after a kill they
    unlink what the dead processes registered."""
    pid = instance.server.pid
    assert pid is not None, f"{instance.name} is not running"
    members = [m for m in group_members(pid) if "resource_tracker" not in " ".join(m.cmdline())]
    for proc in members:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.suspend()
    try:
        yield
    finally:
        for proc in members:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()


def restart(stack: Stack, instance: StackInstance) -> None:
    """Start a killed ``instance`` again (its group reaped first) in its place in ``stack``."""
    with contextlib.suppress(ProcessLookupError):
        instance.server.stop()  # reaps the killed group
    server = VllmServer(instance.server.spec)
    server.start()
    server.wait_ready(300)
    index = stack.instances.index(instance)
    stack.instances[index] = dataclasses.replace(instance, server=server)
    # As when the stack started: one plain request before any leg. On a processor with AMX
    # tiles a fresh vLLM CPU 0.32 D whose first request brings pushed KV has had its engine die
    # without a word right after the transfer; a plain request first does not.
    stack.warm_up()
