"""Hot reload of the config file: SIGHUP, and optionally a watch on the file.

Who calls it: the app lifespan (:mod:`disagg_router.router.http.app`), when the app was built from a
file (``disagg-router serve``). :meth:`ConfigReloader.reload` re-reads and validates the file
exactly like ``check-config``:

- valid: the new routing table is swapped in at once
  (:meth:`disagg_router.router.routing.table.LiveRouting.apply`):
  new requests use it, requests in flight finish on the instances they started on, instances
  that left are drained (no new legs), instances that joined are health-checked (and, for a P in
  push mode, identity-probed) right away and used only once that passes;
- invalid (unreadable, bad YAML, or a field that fails validation): rejected with the same
  field-named message ``check-config`` prints; the previous config keeps serving.

Either way one log line and ``disagg_router_config_reloads_total{result}`` say what happened.
Settings read once at start stay as they were: the HTTP client's connection timeouts and limits,
and ``reload.watch`` itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import watchfiles

from disagg_router.router.config import load_config
from disagg_router.router.errors import ConfigError
from disagg_router.router.instances.state import BackendState
from disagg_router.router.runtime import Runtime

log = logging.getLogger(__name__)

CheckBackends = Callable[[Sequence[BackendState]], Coroutine[Any, Any, None]]


class ConfigReloader:
    """Applies the file at ``path`` to ``runtime``; ``check`` health-checks joining backends."""

    def __init__(
        self,
        runtime: Runtime,
        path: Path,
        check: CheckBackends,
        on_applied: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_applied``: called after each applied reload (discovery follows the new pools)."""
        self.runtime = runtime
        self.path = path
        self._check = check
        self._on_applied = on_applied
        self._tasks: set[asyncio.Task[None]] = set()

    def reload(self) -> bool:
        """Re-read the file and swap it in if valid; True when applied (call on the loop)."""
        try:
            settings = load_config(self.path)
        except ConfigError as exc:
            self.runtime.metrics.config_reloads.labels("rejected").inc()
            log.error(
                "config reload rejected: invalid config %s: %s; the previous config keeps serving",
                self.path,
                exc.message,
            )
            return False
        changes = self.runtime.routing.apply(settings)
        self.runtime.tenancy.configure(settings)
        self._on_applied()
        added = [b for c in changes for b in c.added]
        removed = [b for c in changes for b in c.removed]
        self.runtime.metrics.config_reloads.labels("applied").inc()
        log.info(
            "config reloaded from %s: models %s; %d instances joined (checked before use), "
            "%d left (drained)",
            self.path,
            ", ".join(settings.model_names),
            len(added),
            len(removed),
        )
        if added:
            task = asyncio.get_running_loop().create_task(self._check(added))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    async def watch(self) -> None:
        """Reload whenever the file's content may have changed (cancel to stop).

        Watches the directory the path is in, as given (not resolved), and, when the path
        resolves outside it, the target's directory; after each batch of changes it compares
        the file's identity (where it resolves to, inode, size, mtime) with the last one seen.
        So a file replaced by rename (editors) and a Kubernetes ConfigMap update (the kubelet
        writes a new timestamped directory and swaps the ``..data`` symlink to it, then deletes
        the old one) are seen every time, not only the first.
        """
        path = self.path.absolute()
        seen = _fingerprint(path)
        while True:
            dirs = _watched_dirs(path)
            async for _ in watchfiles.awatch(*dirs, watch_filter=None, debounce=300):
                now = _fingerprint(path)
                if now != seen:
                    seen = now
                    self.reload()
                if _watched_dirs(path) != dirs:
                    break  # the file now resolves elsewhere: watch there instead

    async def close(self) -> None:
        """Cancel checks still running."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _fingerprint(path: Path) -> tuple[str, int, int, int, int] | None:
    """Where ``path`` resolves to and its device, inode, size and mtime (None if unreadable)."""
    try:
        st = path.stat()
        return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return None


def _watched_dirs(path: Path) -> tuple[Path, ...]:
    """The directory of ``path`` as given, plus its resolved target's if that lies outside it."""
    home = path.parent
    target = path.resolve().parent
    return (home,) if target == home or target.is_relative_to(home) else (home, target)
