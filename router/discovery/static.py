"""The static source: the pool's configured ``instances`` list, once; nothing ever changes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from router.config import InstanceConfig
from router.discovery.source import Update, found


class StaticSource:
    kind = "static"

    def __init__(self, instances: Sequence[InstanceConfig]) -> None:
        self._instances = tuple(instances)

    async def updates(self) -> AsyncGenerator[Update, None]:
        """The configured list, then nothing (waits until cancelled)."""
        yield found(self._instances)
        await asyncio.Event().wait()
