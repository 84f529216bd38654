"""ClientWatch: a client's disconnect cancels the watched task where it waits, and only then."""

from __future__ import annotations

import asyncio
from typing import Any

from router.http.disconnect import ClientWatch


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
