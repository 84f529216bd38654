"""An engine profile: the step-time model, cache size, scheduler limits and transfer costs that
make an emulated engine behave like one model on one machine.

Who uses it: :class:`devstack.emulator.engine.Engine` asks :meth:`StepModel.seconds` for the
duration of every step it runs and reads the limits; :func:`load_profile` reads a profile file
(``profiles/<name>.json`` beside this module, or any path) and refuses one whose fields an engine
could not run on (pydantic checks each field's type and range), naming the file and every bad
field. Pure data; no I/O but the load. Profiles built in code (the fit, tests) are not checked.

The step model is linear in what a step does, as a transformer step's cost is: a fixed cost,
a cost per token computed (weights), per sequence in the batch (sampling, bookkeeping), per
context token a decoding sequence attends to (reading its KV), and per query-key pair of a
prefill chunk (attention over the chunk and the prefix before it). Each profile file says where
its coefficients come from (``source``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

PROFILES_DIR = Path(__file__).parent / "profiles"

_STRICT = ConfigDict(extra="forbid", strict=True)
"""A profile file's objects: no unknown field, no value of another type (``"7"`` or ``7.0``
for a count)."""
Count = Annotated[int, Field(ge=1)]
Cost = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""Seconds, or seconds per unit: finite, not below 0."""
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Text = Annotated[str, Field(min_length=1)]


@dataclass(frozen=True)
class StepModel:
    """Seconds of one engine step, from what the step computes."""

    __pydantic_config__: ClassVar[ConfigDict] = _STRICT
    base_s: Cost
    per_token_s: Cost
    per_seq_s: Cost = 0.0
    per_context_token_s: Cost = 0.0
    per_attention_pair_s: Cost = 0.0

    def seconds(self, tokens: int, seqs: int, context: int, pairs: int) -> float:
        """The step's duration: ``tokens`` computed in all, over ``seqs`` sequences; decoding
        sequences attend to ``context`` cached tokens in all; prefill chunks form ``pairs``
        query-key pairs."""
        return (
            self.base_s
            + self.per_token_s * tokens
            + self.per_seq_s * seqs
            + self.per_context_token_s * context
            + self.per_attention_pair_s * pairs
        )


@dataclass(frozen=True)
class Transfer:
    """The cost of moving one request's KV from P to D: ``latency_s + bytes / bandwidth``, plus
    ``handshake_s`` the first time a D meets a P."""

    __pydantic_config__: ClassVar[ConfigDict] = _STRICT
    bytes_per_token: Annotated[int, Field(ge=0)]
    bandwidth_bytes_per_s: Positive
    latency_s: Cost
    handshake_s: Cost = 0.0

    def seconds(self, tokens: int, first_meeting: bool) -> float:
        """Seconds to move the KV of ``tokens`` tokens."""
        extra = self.handshake_s if first_meeting else 0.0
        return self.latency_s + extra + tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Profile:
    """Everything an emulated engine needs to know about the model, the machine and vLLM's
    settings on it."""

    __pydantic_config__: ClassVar[ConfigDict] = _STRICT
    name: Text
    source: str
    model: Text
    block_size: Count
    num_blocks: Count
    max_num_batched_tokens: Count
    max_num_seqs: Count
    max_model_len: Count
    step: StepModel
    transfer: Transfer
    request_overhead_s: Cost = 0.0
    """The API server's fixed work on a request before its first step (parsing, validation),
    part of every time to first token."""
    answer_overhead_s: Cost = 0.0
    """What a whole (non-streamed) answer costs after its last step: building and sending the
    JSON. A P leg's answer pays it."""
    kv_lease_s: Positive = 30.0
    """P frees a finished prefill's blocks when no D took them within this time (vLLM's
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` plays this part)."""
    work_rate: Positive | None = None
    """Pieces of :func:`devstack.burner.piece` one core did per CPU second while the step
    model was fitted (:func:`devstack.burner.work_rate`; a fitted CPU profile has it). An
    engine whose steps cost CPU (:mod:`devstack.burner`) then spends a step of ``s`` seconds as
    ``s`` x this many pieces, so a machine slower than at the fit stretches its steps as it
    stretches vLLM's; without it, as ``s`` CPU seconds."""

    def prefill_seconds(self, tokens: int) -> float:
        """How long one engine takes to prefill a ``tokens``-token prompt alone: its chunks of
        ``max_num_batched_tokens``, each a step of :attr:`step`, and the API server's overheads.
        Who calls it: the fleet benchmarks, to offer a load as a share of P's capacity."""
        seconds, computed = self.request_overhead_s + self.answer_overhead_s, 0
        while computed < tokens:
            n = min(self.max_num_batched_tokens, tokens - computed)
            pairs = n * computed + n * (n + 1) // 2
            seconds += self.step.seconds(n, 1, 0, pairs)
            computed += n
        return seconds

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences of ``context`` cached tokens each."""
        return self.step.seconds(batch, batch, batch * context, 0)

    def to_json(self) -> str:
        """The profile file's text."""
        return json.dumps(asdict(self), indent=2) + "\n"


_FILE = TypeAdapter(Profile)


def parse_profile(text: str | bytes) -> Profile:
    """The profile in a profile file's text (JSON); ``ValueError`` naming every field that is
    missing, unknown, of the wrong type or out of range (``step.base_s: input should be
    greater than or equal to 0``), or saying that the text is not JSON."""
    try:
        return _FILE.validate_json(text)
    except ValidationError as error:
        raise ValueError(_problems(error)) from None


def _problems(error: ValidationError) -> str:
    """Every problem pydantic found, as ``field.path: what is wrong``, one after another."""
    found = error.errors(include_url=False, include_input=False)
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg'].lower()}" for e in found
    )


def profile_names() -> list[str]:
    """The profiles shipped in :data:`PROFILES_DIR`."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> Profile:
    """The profile in the file ``name_or_path``, else the one of that name in
    :data:`PROFILES_DIR`; ``ValueError`` naming the shipped ones when neither exists, and
    naming the file and its bad fields (:func:`parse_profile`) when it does not hold a
    profile an engine can run on."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        names = ", ".join(profile_names())
        raise ValueError(f"profile {name_or_path!r}: no such file, nor one of {names}")
    try:
        return parse_profile(path.read_bytes())
    except ValueError as error:
        raise ValueError(f"profile file {str(path)!r}: {error}") from None


def profile_option(text: str) -> str:
    """An argparse ``type`` for a ``--profile`` option: ``text`` when it names a profile that
    loads (a shipped name or a file), else the load's error as a usage error, so a bad profile
    stops the command before it starts anything."""
    try:
        load_profile(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text
