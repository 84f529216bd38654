"""A minimal progress bar on stderr (redraws in place on a TTY, else one line per 10 %)."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    """Counts finished requests. Owned by one run; call :meth:`close` when the run ends."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self._total = max(total, 0)
        self._label = label
        self._done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._last_decile = -1

    @property
    def done(self) -> int:
        return self._done

    def update(self, n: int = 1) -> None:
        self._done += n
        if self._tty:
            self._draw("\r")
            return
        decile = (10 * self._done) // self._total if self._total else 10
        if decile != self._last_decile:
            self._last_decile = decile
            self._draw("")
            self._stream.write("\n")
        self._stream.flush()

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, prefix: str) -> None:
        width = 30
        filled = (width * self._done) // self._total if self._total else width
        bar = "#" * filled + "." * (width - filled)
        self._stream.write(f"{prefix}{self._label} [{bar}] {self._done}/{self._total}")
        self._stream.flush()
