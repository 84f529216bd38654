"""OpenAI-style server-sent events as bytes: :class:`EventReader` reads them, :func:`encode_event`
writes one.

An OpenAI stream is a sequence of ``data: <JSON>`` events ended by ``data: [DONE]``. The router's
decode leg (:mod:`disagg_router.router.upstream.calls`) reads with :class:`EventReader`, which
yields the events up to that terminator (not yielded) as bytes, ready for the client, so the relay
passes them on unparsed; it raises :class:`StreamEndedEarly` when the stream ends without it and
:class:`NotEventStream` when the answer is not an event stream; transport errors propagate. Every
event the router (and the fake vLLM) writes is made by :func:`encode_event`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from itertools import repeat

from disagg_router.router.upstream.h1 import TransportError

DONE = "[DONE]"
"""The data of the event that ends an OpenAI stream."""

_DATA = b"data: "
_DONE_EVENT = b"data: [DONE]"
_DONE_READ = _DONE_EVENT + b"\n\n"


class StreamEndedEarly(Exception):
    """The event stream ended before its ``data: [DONE]`` event."""


class NotEventStream(Exception):
    """The answer's content type is not an event stream's."""


def encode_event(data: bytes) -> bytes:
    """One ``data:`` event: every event the router writes (``data`` must hold no newline, as
    JSON encoded in one line does)."""
    return _DATA + data + b"\n\n"


def encode_data(data: str) -> bytes:
    """One ``data:`` event of text data (see :func:`encode_event`)."""
    return encode_event(data.encode())


DONE_EVENT = encode_data(DONE)
"""The event that ends an OpenAI stream, as written."""


class EventSplitter:
    """Cuts an event stream, fed as the bytes read in order, into events ready for a client.

    Each event comes out as ``data: <data>\n\n`` with the data the SSE rules give it (what
    an SSE client such as ``httpx-sse`` yields, undecodable UTF-8 replaced), so
    an OpenAI stream's events (one ``data: `` line each, ``\n\n`` after it) come out as the very
    bytes read, without a copy per event; other line endings, fields, comments and multi-line
    data are read by the rules. Events after ``[DONE]`` are dropped. Pure, no I/O.
    """

    def __init__(self) -> None:
        self._rest = b""
        self._last_id = False  # an ``id`` field was seen: every blank line then dispatches
        self.done = False
        """``[DONE]`` was read."""

    def feed(self, chunk: bytes) -> bytes:
        """The events completed by ``chunk`` (``b""`` if none), up to ``[DONE]``."""
        if (  # one whole plain event, the usual read of a decoding stream: as read
            not self._rest
            and chunk.endswith(b"\n\n")
            and chunk.startswith(_DATA)
            and chunk.count(b"\n") == 2
            and chunk.isascii()
            and b"\r" not in chunk
            and chunk != _DONE_READ
            and not self.done
        ):
            return chunk
        buf = self._rest + chunk if self._rest else chunk
        if b"\r" in buf:  # a lone CR or CRLF ends lines too; a final CR may start a CRLF
            tail = b"\r" if buf.endswith(b"\r") else b""
            buf = buf[: len(buf) - len(tail)].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            buf += tail
        end = buf.rfind(b"\n\n") + 2
        if end < 2 or self.done:
            self._rest = b"" if self.done else buf
            return b""
        head, self._rest = buf[:end], buf[end:]
        if not head.isascii():
            head = head.decode("utf-8", "replace").encode()
        blocks = head.split(b"\n\n")
        odd = blocks.pop()  # b"\n" after an odd run of line ends (one more blank line), else b""
        done = blocks.index(_DONE_EVENT) if _DONE_EVENT in blocks else -1
        events = blocks if done < 0 else blocks[:done]
        # Every event one ``data:`` line (its only line ends are the two after it): checked in
        # C over the events' bytes, not per event in Python.
        span = sum(map(len, events)) + 2 * len(events)
        plain = all(map(bytes.startswith, events, repeat(_DATA)))
        if (done >= 0 or not odd) and plain and head.count(b"\n", 0, span) == 2 * len(events):
            if done < 0:
                return head  # the common case: the bytes as read
            self.done, self._rest = True, b""  # the rest is dropped (see the class doc)
            return head[:span]
        return b"".join(self._events(blocks, odd))

    def _events(self, blocks: list[bytes], odd: bytes) -> list[bytes]:
        out: list[bytes] = []
        for block in blocks:
            for data in self._block(block):
                if data == b"[DONE]":
                    self.done = True
                    return out
                out.append(_DATA + data + b"\n\n")
        if odd and self._last_id:  # the extra blank line dispatches an empty event
            out.append(_DATA + b"\n\n")
        return out

    def _block(self, block: bytes) -> list[bytes]:
        """The data of each event one block of lines (between blank lines) dispatches."""
        found: list[bytes] = []
        data: list[bytes] | None = None
        fields = False  # event or retry set since the last dispatch
        for line in [*block.split(b"\n"), b""]:
            if not line:
                if data is not None or fields or self._last_id:
                    found.append(b"\n".join(data or []))
                data, fields = None, False
                continue
            if line.startswith(b":"):
                continue
            name, _, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if name == b"data":
                data = [*(data or []), value]
            elif name == b"id" and b"\0" not in value:
                self._last_id = bool(value)
            elif (name == b"event" and value) or (name == b"retry" and value.isdigit()):
                fields = True
        return found


class EventReader:
    """The events of a stream whose body arrives through ``read`` (each await: the next chunk,
    ``b""`` at its end), up to ``[DONE]`` (not included): each non-empty batch
    :meth:`EventSplitter.feed` gives, as soon as it is read. An async iterator object rather
    than an async generator: the decode leg makes one per streamed request, and each async
    generator costs the event loop's bookkeeping (a weak reference registered and removed).

    :class:`NotEventStream` (from the first ``__anext__``) when ``content_type`` is not an event
    stream's; after ``[DONE]`` the rest of the body is read to its end (so the connection can
    be reused), a transport error there ignored; :class:`StreamEndedEarly` when the body ends
    without ``[DONE]``; other errors propagate.
    """

    def __init__(
        self,
        read: Callable[[], Awaitable[bytes]],
        content_type: str,
        splice: Callable[[Callable[[bytes], None] | None], bool] | None = None,
    ) -> None:
        """``splice``: the body's own ``splice`` (:meth:`EventReader.splice` uses it)."""
        self._read = read
        self._content_type: str | None = content_type
        self._splitter = EventSplitter()
        self._splice = splice

    def splice(self, deliver: Callable[[bytes], None] | None) -> bool:
        """Give each batch of events to ``deliver`` as the bytes arrive, in the event loop's
        callback, rather than from ``__anext__`` (``None``: back to ``__anext__``). Taken only
        once the stream has begun (its first batch was read), before ``[DONE]``, and when the
        body allows it; returns whether it was. ``__anext__`` still ends the stream (after the
        events delivered) or raises its error. ``deliver`` must not raise or block.

        Who calls it: the relay, through the decode leg's reader, while it waits for D."""
        if self._splice is None:
            return False
        if deliver is None:
            return self._splice(None)
        splitter = self._splitter
        if self._content_type is not None or splitter.done:
            return False

        def sink(chunk: bytes) -> None:
            events = splitter.feed(chunk)
            if events:
                deliver(events)

        return self._splice(sink)

    def __aiter__(self) -> EventReader:
        return self

    async def __anext__(self) -> bytes:
        if self._content_type is not None:
            kind, self._content_type = self._content_type.partition(";")[0], None
            if "text/event-stream" not in kind:
                raise NotEventStream(f"expected an event stream, got content type {kind!r}")
        splitter = self._splitter
        while True:
            try:
                chunk = await self._read()
            except TransportError:
                if not splitter.done:
                    raise
                chunk = b""
            if not chunk:
                if not splitter.done:
                    raise StreamEndedEarly("stream ended before [DONE]")
                raise StopAsyncIteration
            events = splitter.feed(chunk)
            if events:
                return events
