"""Steps that cost CPU: an emulated engine's step spent as CPU time on a core of its own, so it
slows down when that core is shared, as a vLLM CPU engine does.

An emulated engine normally sleeps through a step, which no other process on the machine can
slow down. A real vLLM CPU instance computes its steps on its core, and whatever else runs there
(the router, the load generator) takes its share of that core. :class:`Burner` gives one engine
a child process pinned to one core that spends each step's seconds as its own CPU time: the
step's wall time is then the profile's time stretched by the core's other users, the same way.

A machine whose cores run slower than when the profile was fitted (this one's do, by up to
half, from minute to minute) stretches a real step but not a step of CPU seconds. A profile
that carries the rate of a fixed piece of work at its fit (:attr:`Profile.work_rate
<devstack.emulator.profile.Profile.work_rate>`, measured by :func:`work_rate`) has each step
spent as that work instead: ``seconds`` x the rate pieces, which take longer on a slower core,
as the real step does.

Who uses it: :class:`devstack.emulator.fleet.Fleet`, one burner per engine given a core
(``FleetSpec.cpu_cores``), started and closed with the fleet; the engine awaits
:meth:`Burner.burn` instead of sleeping. ``python -m devstack.burner --core N [--work-rate
R]`` is the child: it reads each step's seconds as an 8-byte little-endian float on stdin,
spends them (as CPU seconds, or as ``round(seconds * R)`` pieces of work), and answers the CPU
seconds it spent (8 bytes); it exits at the end of its input.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import sys
import time
from collections.abc import Callable

_SECONDS = struct.Struct("<d")


def piece() -> int:
    """The fixed piece of work :func:`work_rate` and :func:`spend_work` count: interpreter
    work, as much of a tiny model's vLLM CPU step is (a few microseconds)."""
    total = 0
    for i in range(200):
        total += i
    return total


def spend(seconds: float) -> float:
    """Keep this thread on its CPU until it has used ``seconds`` of CPU time; the CPU time used
    (a little more than ``seconds``: the last check's)."""
    start = time.thread_time()
    used = 0.0
    while used < seconds:
        used = time.thread_time() - start
    return used


def spend_work(pieces: int, work: Callable[[], object] = piece) -> float:
    """Do ``work`` ``pieces`` times on this thread; the CPU time it took."""
    start = time.thread_time()
    for _ in range(pieces):
        work()
    return time.thread_time() - start


def work_rate(cpu_seconds: float, work: Callable[[], object] = piece) -> float:
    """Pieces of ``work`` this thread does per CPU second now, over about ``cpu_seconds``.
    Who calls it: the profile fit (:func:`bench.profile_fit.run_fit`), around its
    measurements, to record the machine's speed in the profile."""
    start = time.thread_time()
    done = 0
    while (used := time.thread_time() - start) < cpu_seconds:
        for _ in range(100):
            work()
        done += 100
    return done / used


def serve(core: int, rate: float | None = None) -> int:
    """The child's loop (see the module docstring), pinned to ``core``; ``rate``: pieces of
    work per step second, else a step is spent as CPU seconds."""
    os.sched_setaffinity(0, {core})
    read, write = sys.stdin.buffer, sys.stdout.buffer
    while len(request := read.read(_SECONDS.size)) == _SECONDS.size:
        (seconds,) = _SECONDS.unpack(request)
        used = spend(seconds) if rate is None else spend_work(round(seconds * rate))
        write.write(_SECONDS.pack(used))
        write.flush()
    return 0


class BurnerGone(Exception):
    """The burner process ended or broke its protocol; the step cannot be spent."""


class Burner:
    """One engine's burner process on ``core``; ``work_rate``: spend each step as that many
    pieces of work per second (the profile's :attr:`work_rate
    <devstack.emulator.profile.Profile.work_rate>`), else as CPU seconds. Start it with
    :meth:`start` on the loop that will await :meth:`burn`, one step at a time; :meth:`close`
    ends it (idempotent). ``async with Burner(core) as burner`` does both."""

    def __init__(self, core: int, work_rate: float | None = None) -> None:
        self.core = core
        self.work_rate = work_rate
        self.spent_s = 0.0
        """CPU seconds the burner reports it spent, over all steps."""
        self.round_trip_s = 0.0
        """Wall seconds of asking for nothing and getting the answer, on an idle core (measured
        by :meth:`start`): taken off each step's CPU time, so a step on an idle core lasts
        the profile's time."""
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> Burner:
        """Start the process; returns once it answers."""
        argv = [sys.executable, "-m", "devstack.burner", "--core", str(self.core)]
        if self.work_rate is not None:
            argv += ["--work-rate", repr(self.work_rate)]
        self._process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        await self.burn(0.0)  # answered once the child runs: its start is no step's
        trips = []
        for _ in range(5):
            start = time.monotonic()
            await self.burn(0.0)
            trips.append(time.monotonic() - start)
        self.round_trip_s = min(trips)
        return self

    async def __aenter__(self) -> Burner:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def pid(self) -> int | None:
        """The process's id while it runs (None before :meth:`start` and after :meth:`close`)."""
        return None if self._process is None else self._process.pid

    async def burn(self, seconds: float) -> None:
        """Spend a step of ``seconds`` on the burner's core (as CPU seconds or as work, see the
        class); returns when it is spent.
        :class:`BurnerGone` when the process is not there to do it."""
        process = self._process
        if process is None or process.stdin is None or process.stdout is None:
            raise BurnerGone("the burner is not running")
        try:
            process.stdin.write(_SECONDS.pack(max(0.0, seconds - self.round_trip_s)))
            answer = await process.stdout.readexactly(_SECONDS.size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise BurnerGone(f"the burner on core {self.core} ended: {exc!r}") from exc
        self.spent_s += _SECONDS.unpack(answer)[0]

    async def close(self, timeout: float = 5.0) -> None:
        """End the process: its input closed, killed if it has not ended within ``timeout``."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()


def _positive(text: str) -> float:
    """``--work-rate``: a number above 0 (else a usage error, not a child that never works)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.burner")
    parser.add_argument("--core", type=int, required=True)
    parser.add_argument("--work-rate", type=_positive, default=None)
    args = parser.parse_args(argv)
    return serve(args.core, args.work_rate)


if __name__ == "__main__":
    sys.exit(main())
