"""The contract between a discovery source and its consumer.

A source's ``updates()`` is an async iterator that never ends on its own (cancel the task that
iterates it, or close it). Each item is either :class:`Found` (the complete current set, sorted by
label, possibly empty) or :class:`Failed` (this attempt could not tell; the consumer keeps what it
knew). Labels are derived from what the source sees (address and port, or pod name), so every
router replica that sees the same records produces the same labels.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from typing import Protocol

from disagg_router.router.config import InstanceConfig


@dataclass(frozen=True)
class Found:
    """The complete set of instances the source sees now, sorted by label."""

    instances: tuple[InstanceConfig, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(i.label for i in self.instances)


@dataclass(frozen=True)
class Failed:
    """The source could not learn the set this time; ``error`` says why."""

    error: str


Update = Found | Failed


class DiscoverySource(Protocol):
    """Yields :data:`Update` items forever; ``kind`` names it in metrics and ``/ready``."""

    kind: str

    def updates(self) -> AsyncGenerator[Update, None]: ...


def base_url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port`` with IPv6 literals bracketed."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"{scheme}://{host}:{port}"


def found(instances: Iterable[InstanceConfig]) -> Found:
    """A :class:`Found` with one instance per label (the first by URL wins), sorted by label."""
    by_label: dict[str, InstanceConfig] = {}
    for instance in sorted(instances, key=lambda i: (i.label, i.url)):
        by_label.setdefault(instance.label, instance)
    return Found(tuple(by_label[label] for label in sorted(by_label)))
