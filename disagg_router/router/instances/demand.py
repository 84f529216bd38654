"""The KV cache a D pool's requests need: what ``push.bind: adaptive`` compares with the pool's
size.

Who calls it: each :class:`~disagg_router.router.routing.pools.Pool` keeps one
:class:`KvDemand`; a dispatch attempt's :class:`~disagg_router.router.dispatch.holds.Holds` adds
its prompt's tokens when the attempt starts and takes them back at its close, whether D is
bound yet or not. :func:`disagg_router.router.dispatch.binding.binds_late` reads the total
through the pool. Pure: no I/O; one event loop mutates it, so nothing locks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KvDemand:
    """Prompt tokens of this router's requests in flight on one D pool: those D serves alone,
    those whose D is bound (its blocks are registered or written) and those whose D is not
    bound yet (an eager binding would hold their blocks now)."""

    tokens: int = 0

    def add(self, tokens: int) -> None:
        self.tokens += max(tokens, 0)

    def remove(self, tokens: int) -> None:
        self.tokens = max(self.tokens - max(tokens, 0), 0)
