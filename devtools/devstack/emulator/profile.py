"""An engine profile: the step-time model, cache size, scheduler limits and transfer costs that
make an emulated engine behave like one model on one machine.

Who uses it: :class:`devstack.emulator.engine.Engine` asks :meth:`StepModel.seconds` for the
duration of every step it runs and reads the limits; :func:`load_profile` reads a profile file
(``profiles/<name>.json`` beside this module, or any path). Pure data; no I/O but the load.

The step model is linear in what a step does, as a transformer step's cost is: a fixed cost,
a cost per token computed (weights), per sequence in the batch (sampling, bookkeeping), per
context token a decoding sequence attends to (reading its KV), and per query-key pair of a
prefill chunk (attention over the chunk and the prefix before it). Each profile file says where
its coefficients come from (``source``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class StepModel:
    """Seconds of one engine step, from what the step computes."""

    base_s: float
    per_token_s: float
    per_seq_s: float = 0.0
    per_context_token_s: float = 0.0
    per_attention_pair_s: float = 0.0

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

    bytes_per_token: int
    bandwidth_bytes_per_s: float
    latency_s: float
    handshake_s: float = 0.0

    def seconds(self, tokens: int, first_meeting: bool) -> float:
        """Seconds to move the KV of ``tokens`` tokens."""
        extra = self.handshake_s if first_meeting else 0.0
        return self.latency_s + extra + tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Profile:
    """Everything an emulated engine needs to know about the model, the machine and vLLM's
    settings on it."""

    name: str
    source: str
    model: str
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    step: StepModel
    transfer: Transfer
    request_overhead_s: float = 0.0
    """The API server's fixed work on a request before its first step (parsing, validation),
    part of every time to first token."""
    answer_overhead_s: float = 0.0
    """What a whole (non-streamed) answer costs after its last step: building and sending the
    JSON. A P leg's answer pays it."""
    kv_lease_s: float = 30.0
    """P frees a finished prefill's blocks when no D took them within this time (vLLM's
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` plays this part)."""
    work_rate: float | None = None
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


def profile_from_mapping(data: dict[str, Any]) -> Profile:
    """A profile from a parsed profile file; ``KeyError``/``TypeError`` on a missing or
    unknown field."""
    fields = dict(data)
    fields["step"] = StepModel(**fields["step"])
    fields["transfer"] = Transfer(**fields["transfer"])
    return Profile(**fields)


def profile_names() -> list[str]:
    """The profiles shipped in :data:`PROFILES_DIR`."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> Profile:
    """The profile in the file ``name_or_path``, else the one of that name in
    :data:`PROFILES_DIR`; ``ValueError`` naming the shipped ones when neither exists."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        names = ", ".join(profile_names())
        raise ValueError(f"profile {name_or_path!r}: no such file, nor one of {names}")
    data: dict[str, Any] = json.loads(path.read_text())
    return profile_from_mapping(data)
