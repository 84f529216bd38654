"""How fast an instance serves its part of a push request, learned from what the router sees: a
P's prefills as a queue with a learned speed (when will this prefill finish?) and how early its
prefills end against that prediction, a D's lead (its leg sent to D accepting it). Binding D late
(:mod:`disagg_router.router.dispatch.binding`) reads them all.

Who calls it: :mod:`disagg_router.router.instances.state` keeps one :class:`Pace` per instance.
The dispatch reaches it there: the P leg opens a ticket when it sends a prefill and closes it with
the outcome, the D leg observes D's lead, the binding asks for predictions. Pure: no I/O, no
clock of its own (callers pass ``time.monotonic()``), no asyncio; one event loop mutates it, so
nothing locks.

The model: P serves the prefills this router sent it first come, first served, each taking
``seconds_per_token * tokens`` once the one before it ended (vLLM batches prefills, but its
throughput in prompt tokens is what a queue drains at). ``seconds_per_token`` is the decayed ratio
of observed service times to tokens, a service time being the span from when P could start the
prefill (it was sent, and the prefill before it had ended) to its answer. Requests other
routers send to P are not seen: they make P later than predicted, which binds D early (the eager
side), never late.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MIN_SAMPLES = 3
"""Finished prefills P needs before its finish is predicted (until then D binds at once)."""

DEFAULT_LEAD_S = 0.25
"""A D's lead before any was observed: D's hand-over measured upstream (about 200 ms p50)."""


DEVIATIONS = 1.0
"""How many mean deviations above the mean a :class:`Spread`'s bound is: one keeps P's wait
for D's registration at 0 for most requests (the median's goal) without holding D's blocks
as long as two did (``disagg-bench bind``, docs/benchmarks/binding.md)."""


@dataclass
class Spread:
    """A decayed mean and mean deviation of observed seconds; :meth:`bound` is the mean plus
    :data:`DEVIATIONS` deviations (``default`` until anything is observed)."""

    weight: float = 0.2
    default: float = 0.0
    _mean: float | None = None
    _dev: float = 0.0

    def observe(self, seconds: float) -> None:
        if self._mean is None:
            self._mean = seconds
            return
        self._dev += self.weight * (abs(seconds - self._mean) - self._dev)
        self._mean += self.weight * (seconds - self._mean)

    def bound(self) -> float:
        return self.default if self._mean is None else self._mean + DEVIATIONS * self._dev


@dataclass
class _Open:
    tokens: int
    sent: float
    predicted: float | None  # when sent: its error is reported
    asked: float | None = None  # the last prediction given out: its error teaches the margin


@dataclass
class PrefillPace:
    """One P's open prefills (in the order sent) and its learned speed.

    ``forget``: the weight each older observation keeps per new one (0.9: about the last ten
    prefills count)."""

    forget: float = 0.9
    _open: dict[int, _Open] = field(default_factory=dict)
    _next: int = 0
    _last_end: float = float("-inf")
    _seconds: float = 0.0
    _tokens: float = 0.0
    _samples: int = 0
    _early: Spread = field(default_factory=Spread)
    _listeners: set[Callable[[], None]] = field(default_factory=set)

    @property
    def learned(self) -> bool:
        return self._samples >= MIN_SAMPLES and self._tokens > 0

    @property
    def seconds_per_token(self) -> float | None:
        return self._seconds / self._tokens if self.learned else None

    def send(self, tokens: int, now: float) -> int:
        """A prefill of ``tokens`` prompt tokens sent now; its ticket."""
        ticket = self._next
        self._next += 1
        self._open[ticket] = _Open(max(tokens, 1), now, None)
        self._open[ticket].predicted = self._predict(ticket, now)
        return ticket

    def finish(self, ticket: int, now: float) -> float | None:
        """When the prefill ``ticket`` is predicted to end; None when P's speed is not learned
        yet or the prefill ended. An overdue prefill ahead of it is taken to end now. The
        prediction is remembered: how early the prefill then ends teaches :meth:`margin`."""
        predicted = self._predict(ticket, now)
        if predicted is not None:
            self._open[ticket].asked = predicted
        return predicted

    def _predict(self, ticket: int, now: float) -> float | None:
        """:meth:`finish` without remembering it (the prediction made when a prefill is sent
        is reported, never learned from)."""
        per_token = self.seconds_per_token
        if per_token is None or ticket not in self._open:
            return None
        cursor = self._last_end
        for key, item in self._open.items():
            cursor = max(cursor, item.sent) + per_token * item.tokens
            cursor = max(cursor, now)
            if key == ticket:
                return cursor
        return None  # not reached: ticket is open

    def done(self, ticket: int, now: float, answered: bool) -> float | None:
        """The prefill ``ticket`` ended now: answered (which teaches P's speed, in the same
        tokens the prediction counts: estimates absorb both their own error and P's prefix
        cache hits) or not (failed or cancelled: nothing learned). Returns how late an answer
        came against the prediction made when it was sent (negative: early), None when there
        was none. Tells the listeners."""
        item = self._open.pop(ticket, None)
        if item is None:
            return None
        error = None
        if answered:
            self._learn(now - max(item.sent, self._last_end), item.tokens)
            self._last_end = now
            error = None if item.predicted is None else now - item.predicted
            if item.asked is not None:
                self._early.observe(max(0.0, item.asked - now))
        for listener in list(self._listeners):
            listener()
        return error

    def margin(self) -> float:
        """Seconds to bind D ahead of this P's predicted finish beyond D's lead: how early its
        prefills ended against the last prediction given for them after they were sent (the
        binding's), mean plus :data:`DEVIATIONS` deviations; 0 until seen."""
        return self._early.bound()

    def _learn(self, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._seconds = self._seconds * self.forget + seconds
        self._tokens = self._tokens * self.forget + tokens
        self._samples += 1

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a prefill ends (predictions may then move)."""
        self._listeners.add(listener)

    def unlisten(self, listener: Callable[[], None]) -> None:
        self._listeners.discard(listener)


def decode_lead() -> Spread:
    """One D's lead: from its leg sent to D accepting the request (its answer's headers); its
    bound is how far ahead of P's finish D's leg goes out (:data:`DEFAULT_LEAD_S` until seen)."""
    return Spread(default=DEFAULT_LEAD_S)


@dataclass
class Pace:
    """What is learned of one instance: as a P, its prefills; as a D, its lead."""

    prefill: PrefillPace = field(default_factory=PrefillPace)
    decode: Spread = field(default_factory=decode_lead)
