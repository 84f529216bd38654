"""Supervision of the router's background tasks: a task that crashes is noticed, logged, counted,
shown in ``/ready`` and restarted with a growing delay.

Who calls it: the app lifespan (:mod:`disagg_router.router.http.app`) owns one :class:`Supervisor`
per app run and starts the health monitor, the load-signal scraper and the config-file watcher
through it; the discovery manager (:mod:`disagg_router.router.discovery.manager`) starts each pool's
discovery watcher through it. A supervised coroutine is meant to run until cancelled: if it raises,
or returns, that is a crash. The supervisor reads the outcome from the finished task
(``Task.exception()``), so it needs no catch-all handler, and restarts it after ``backoff`` seconds,
doubling per consecutive crash up to ``max_backoff``; a run that lasted ``stable_after`` seconds
resets the delay. Cancelling the task :meth:`Supervisor.start` returned (or
:meth:`Supervisor.close`) stops the coroutine and forgets it. Single event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from disagg_router.router.observability.metrics import RouterMetrics

log = logging.getLogger(__name__)

Run = Callable[[], Coroutine[Any, Any, None]]


def _ignore(_: str) -> None:
    return None


@dataclass(frozen=True)
class TaskHealth:
    """What ``/ready`` shows for one supervised task."""

    running: bool
    crashes: int = 0
    last_error: str | None = None

    def as_json(self) -> dict[str, object]:
        return {"running": self.running, "crashes": self.crashes, "last_error": self.last_error}


class Supervisor:
    """Runs named background coroutines and restarts them when they crash."""

    def __init__(
        self,
        metrics: RouterMetrics,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        stable_after: float = 60.0,
    ) -> None:
        self._metrics = metrics
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._stable_after = stable_after
        self._health: dict[str, TaskHealth] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._crashed: dict[str, asyncio.Event] = {}

    def start(
        self, name: str, run: Run, on_crash: Callable[[str], None] = _ignore
    ) -> asyncio.Task[None]:
        """Run ``run()`` under ``name`` (unique among running tasks) until cancelled;
        ``on_crash(error)`` is called after each crash is recorded (it must not raise)."""
        task = asyncio.create_task(self._keep(name, run, on_crash), name=f"supervise {name}")
        self._tasks[name] = task
        self._health[name] = TaskHealth(running=True)
        return task

    def status(self) -> dict[str, TaskHealth]:
        """Per task name: running now (False while waiting to restart), crashes, last error."""
        return dict(self._health)

    def crashed(self, name: str) -> asyncio.Event:
        """Set once the task ``name`` has crashed (never cleared)."""
        return self._crashed.setdefault(name, asyncio.Event())

    async def close(self) -> None:
        """Cancel every supervised task and wait for them to end."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, name: str, run: Run, on_crash: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        delay = self._backoff
        try:
            while True:
                started = loop.time()
                error = await self._run_once(name, run)
                if loop.time() - started >= self._stable_after:
                    delay = self._backoff
                self._crash(name, error, delay)
                on_crash(error)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_backoff)
                self._health[name] = replace(self._health[name], running=True)
        finally:
            if self._tasks.get(name) is asyncio.current_task():  # not replaced meanwhile
                del self._tasks[name]
                self._health.pop(name, None)

    async def _run_once(self, name: str, run: Run) -> str:
        """Run one attempt to its end; what ended it (cancelling this cancels the attempt)."""
        task = asyncio.create_task(run(), name=name)
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            return "cancelled"
        exc = task.exception()
        if exc is None:
            return "ended"
        log.error("background task %s crashed", name, exc_info=exc)
        return f"{exc.__class__.__name__}: {exc}"

    def _crash(self, name: str, error: str, delay: float) -> None:
        health = self._health[name]
        self._health[name] = TaskHealth(False, health.crashes + 1, error)
        self._metrics.background_crashes.labels(name).inc()
        self.crashed(name).set()
        log.error("background task %s stopped (%s); restarting in %gs", name, error, delay)
