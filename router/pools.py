"""A pool of backends of one role plus its policy; picks instances for a dispatch.

Who calls it: the orchestrator, once per dispatch and leg. ``require_identity`` is set for the
prefill pool in push mode: an instance whose identity is neither configured nor discovered yet
cannot be paired and is skipped.
"""

from __future__ import annotations

from collections.abc import Collection

from router.backends import BackendState, Role
from router.config import PoolConfig
from router.errors import NoBackendAvailable
from router.policies import Policy, make_policy


class Pool:
    def __init__(self, role: Role, config: PoolConfig, require_identity: bool) -> None:
        self.role = role
        self.backends = [BackendState(config=i, role=role) for i in config.instances]
        self.require_identity = require_identity
        self._policy: Policy = make_policy(config.policy)

    def usable(self) -> list[BackendState]:
        """Healthy backends (with a push identity where required), in pool order."""
        return [
            b
            for b in self.backends
            if b.healthy and (not self.require_identity or b.identity is not None)
        ]

    def choose(self, exclude: Collection[str] = ()) -> BackendState:
        """Pick a usable backend, avoiding labels in ``exclude`` when any other is usable."""
        usable = self.usable()
        if not usable:
            raise NoBackendAvailable(f"no usable {self.role} instance")
        fresh = [b for b in usable if b.label not in exclude]
        return self._policy.choose(fresh or usable)
