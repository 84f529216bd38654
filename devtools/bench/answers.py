"""The answers check's pure logic: deterministic prompts, one request's outcome, and the
comparison of completed answers with an aggregated instance's.

Who calls it: :mod:`bench.answers_run` (``disagg-bench answers``). Nothing here does I/O, starts
processes or reads the clock, so the checker's verdicts are unit-tested on their own.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

_WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "forest",
    "engine",
    "paper",
    "orbit",
    "signal",
    "garden",
    "copper",
    "violet",
    "harbor",
    "quartz",
    "meadow",
    "pillar",
    "falcon",
    "canvas",
    "ember",
    "glacier",
    "lantern",
    "marble",
    "nectar",
    "prism",
]

Kind = Literal["completed", "aborted", "failed"]


@dataclass(frozen=True)
class AnswerPrompt:
    """One prompt: ``prompt_id`` keys its reference and its answers; ``stream`` how it is sent."""

    prompt_id: int
    text: str
    stream: bool


@dataclass(frozen=True)
class Outcome:
    """How one request ended: ``completed`` (200, and a stream that ended with ``[DONE]`` and no
    error event), ``aborted`` (the checker left on purpose) or ``failed`` with a ``reason``. A
    failure is allowed; only a completed answer that differs from the reference is wrong."""

    kind: Kind
    reason: str = ""
    text: str = ""


@dataclass(frozen=True)
class Comparison:
    """``compared``: completed answers with a reference; ``mismatched``: the prompt ids whose
    text differs from the reference's within its stable part; ``unstable``: prompts whose two
    reference runs disagree (compared only up to where they agree)."""

    compared: int
    mismatched: list[int] = field(default_factory=list)
    unstable: list[int] = field(default_factory=list)


def make_prompts(count: int, seed: int, block_size: int) -> list[AnswerPrompt]:
    """``count`` distinct prompts from ``seed``: a third under one block of words, a third of
    several blocks, a third after one of a few shared multi-block prefixes (prefix-cache hits
    and partial-block reuse); every other one streamed."""
    rng = random.Random(seed)
    prefixes = [
        " ".join(rng.choice(_WORDS) for _ in range(block_size * 2))
        for _ in range(max(1, count // 20))
    ]
    prompts: list[AnswerPrompt] = []
    seen: set[str] = set()
    while len(prompts) < count:
        shape = len(prompts) % 3
        low, high = ((2, block_size - 1), (block_size + 1, block_size * 5), (2, block_size * 2))[
            shape
        ]
        head = rng.choice(prefixes) + " " if shape == 2 else ""
        text = head + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))
        if text not in seen:
            seen.add(text)
            prompts.append(AnswerPrompt(len(prompts), text, stream=len(prompts) % 2 == 0))
    return prompts


def classify(
    status: int | None, done: bool, error: str | None, aborted: bool, text: str = ""
) -> Outcome:
    """One request's outcome: ``status`` the HTTP status (None: no answer), ``done`` whether it
    ended cleanly (``[DONE]``, or a whole JSON answer), ``error`` an error event's or transport
    error's text, ``aborted`` whether the checker left it on purpose."""
    if aborted:
        return Outcome("aborted")
    if status is None:
        return Outcome("failed", f"transport: {error or 'no answer'}")
    if status != 200:
        return Outcome("failed", f"http {status}")
    if error is not None:
        return Outcome("failed", f"error event: {error}")
    if not done:
        return Outcome("failed", "stream ended without [DONE]")
    return Outcome("completed", text=text)


def stable_prefix(first: str, second: str) -> int:
    """How many leading characters two reference runs of one prompt agree on."""
    agreed = 0
    for left, right in zip(first, second, strict=False):
        if left != right:
            break
        agreed += 1
    return agreed


def compare(
    reference: Mapping[int, str], second: Mapping[int, str], answers: Mapping[int, str]
) -> Comparison:
    """Each completed answer against the first reference run, over the part both reference runs
    agree on (all of it when they are equal). An answer without a reference is a mismatch."""
    mismatched: list[int] = []
    unstable: list[int] = []
    for prompt_id, text in sorted(answers.items()):
        expected = reference.get(prompt_id)
        if expected is None:
            mismatched.append(prompt_id)
            continue
        upto = len(expected)
        again = second.get(prompt_id)
        if again is not None and again != expected:
            unstable.append(prompt_id)
            upto = stable_prefix(expected, again)
        if text[:upto] != expected[:upto] or (upto == len(expected) and text != expected):
            mismatched.append(prompt_id)
    return Comparison(len(answers), mismatched, unstable)


def summarize(outcomes: Iterable[Outcome]) -> dict[str, object]:
    """Counts per kind and failures per reason, for the report."""
    kinds: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for outcome in outcomes:
        kinds[outcome.kind] += 1
        if outcome.kind == "failed":
            reasons[outcome.reason[:120]] += 1
    return {
        "completed": kinds["completed"],
        "aborted": kinds["aborted"],
        "failed": kinds["failed"],
        "failed_by_reason": dict(sorted(reasons.items())),
    }
