"""ClientWatch: a client's disconnect cancels the watched task where it waits, and only then."""

from __future__ import annotations

import asyncio
from typing import Any

from disagg_router.router.http.disconnect import NOTICE, ClientWatch, DisconnectNotice, notice_of


class Receive:
    """An ASGI ``receive``: hands out the messages put into it, waiting while there are none."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def __call__(self) -> dict[str, Any]:
        return await self.messages.get()


async def _watched_wait(receive: Receive, release: asyncio.Event) -> tuple[str, int]:
    """Waits on ``release`` under a watch; says how the wait ended and the task's cancel count."""
    watch = ClientWatch(receive)
    try:
        await release.wait()
        outcome = "released"
    except asyncio.CancelledError:
        if not watch.left():
            raise
        outcome = "client left"
    finally:
        watch.stop()
    task = asyncio.current_task()
    assert task is not None
    return outcome, task.cancelling()


def test_disconnect_cancels_the_wait_and_is_not_left_counted() -> None:
    async def main() -> tuple[str, int]:
        receive, release = Receive(), asyncio.Event()
        task = asyncio.create_task(_watched_wait(receive, release))
        receive.messages.put_nowait({"type": "http.request", "body": b"", "more_body": False})
        receive.messages.put_nowait({"type": "http.disconnect"})
        return await task

    assert asyncio.run(main()) == ("client left", 0)


def test_no_cancel_after_stop() -> None:
    async def main() -> str:
        receive = Receive()
        watch = ClientWatch(receive)
        watch.stop()
        receive.messages.put_nowait({"type": "http.disconnect"})
        done = asyncio.Event()
        asyncio.get_running_loop().call_soon(done.set)
        await done.wait()  # the watcher's turn came before this: a cancel would have landed here
        return "not cancelled"

    assert asyncio.run(main()) == "not cancelled"


def test_someone_elses_cancel_is_not_taken_for_a_disconnect() -> None:
    async def main() -> str:
        receive, release = Receive(), asyncio.Event()
        task = asyncio.create_task(_watched_wait(receive, release))
        await asyncio.sleep(0)  # the task is waiting under its watch
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancellation propagated"
        return "swallowed"

    assert asyncio.run(main()) == "cancellation propagated"


async def _noticed_wait(notice: DisconnectNotice, release: asyncio.Event) -> str:
    """Waits on ``release`` under a watch told by ``notice``; says how the wait ended."""
    watch = ClientWatch(Receive(), notice)
    try:
        await release.wait()
        return "released"
    except asyncio.CancelledError:
        if not watch.left():
            raise
        return "client left"
    finally:
        watch.stop()


def test_a_connections_notice_cancels_its_requests_wait_without_a_task() -> None:
    async def main() -> tuple[str, int, int]:
        notice, release = DisconnectNotice(), asyncio.Event()
        task = asyncio.create_task(_noticed_wait(notice, release))
        await asyncio.sleep(0)  # the task waits under its watch
        tasks = len(asyncio.all_tasks())
        notice.connection_lost()
        return await task, tasks, task.cancelling()

    assert asyncio.run(main()) == ("client left", 2, 0)  # main and the request: no watcher


def test_a_connection_already_lost_cancels_at_the_next_await() -> None:
    async def main() -> str:
        notice = DisconnectNotice()
        notice.connection_lost()
        return await _noticed_wait(notice, asyncio.Event())

    assert asyncio.run(main()) == "client left"


def test_a_stopped_watch_is_not_told_and_a_later_request_is() -> None:
    """Keep-alive: one notice serves the connection's requests one after another."""

    async def main() -> list[str]:
        notice, release = DisconnectNotice(), asyncio.Event()
        release.set()
        first = await _noticed_wait(notice, release)  # answered: its watch stopped
        second = asyncio.create_task(_noticed_wait(notice, asyncio.Event()))
        await asyncio.sleep(0)
        notice.connection_lost()
        return [first, await second]

    assert asyncio.run(main()) == ["released", "client left"]


def test_the_notice_is_found_only_where_the_server_put_one() -> None:
    notice = DisconnectNotice()
    assert notice_of({"extensions": {NOTICE: notice}}) is notice
    assert notice_of({"extensions": {NOTICE: "not a notice"}}) is None
    assert notice_of({"type": "http"}) is None
