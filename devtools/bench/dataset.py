"""Seeded synthetic dataset: prompts of an exact token length with an optional shared prefix.

Every prompt is ``input_len`` tokens, of which the first ``prefix_len`` are identical across all
requests (the shared prefix) and the rest are drawn per request. Prompts are token ids (sent as
``prompt: [ids]``, exact by construction) or text made with the served model's tokenizer and
re-checked by encoding it again (:func:`make_text_prompts`). Output length is forced with
``max_tokens`` plus ``ignore_eos`` by the client.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Ids below this are skipped: small ids hold special tokens (BOS/EOS/PAD, role markers).
DEFAULT_FIRST_ID = 16


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of a synthetic dataset."""

    num_requests: int
    input_len: int
    output_len: int
    prefix_len: int = 0
    vocab_size: int = 4096
    seed: int = 0
    first_id: int = DEFAULT_FIRST_ID

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field."""
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {self.num_requests}")
        if self.input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if not 0 <= self.prefix_len <= self.input_len:
            raise ValueError(f"prefix_len must be in [0, input_len], got {self.prefix_len}")
        if self.vocab_size <= self.first_id:
            raise ValueError(f"vocab_size must be > {self.first_id}, got {self.vocab_size}")


@dataclass(frozen=True)
class BenchRequest:
    """One request of the dataset: a prompt (token ids or text) and its token counts."""

    prompt: tuple[int, ...] | str
    prompt_len: int
    output_len: int


def make_token_prompts(spec: SyntheticSpec) -> list[BenchRequest]:
    """Build ``spec.num_requests`` token-id prompts; the same spec always gives the same list."""
    spec.validate()
    rng = random.Random(spec.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(spec.first_id, spec.vocab_size) for _ in range(n)]

    prefix = draw(spec.prefix_len)
    suffix_len = spec.input_len - spec.prefix_len
    return [
        BenchRequest(tuple(prefix + draw(suffix_len)), spec.input_len, spec.output_len)
        for _ in range(spec.num_requests)
    ]


Encode = Callable[[str], Sequence[int]]
Decode = Callable[[Sequence[int]], str]


def make_text_prompts(
    spec: SyntheticSpec, encode: Encode, decode: Decode, max_rounds: int = 8
) -> list[BenchRequest]:
    """Build text prompts that encode to exactly ``spec.input_len`` tokens.

    Text is decoded from random ids, then re-encoded; ids are trimmed or topped up until the
    round trip is exact. ``encode`` must not add special tokens. Raises ``ValueError`` if a prompt
    cannot be made exact in ``max_rounds`` rounds (a tokenizer that merges everything).
    """
    requests: list[BenchRequest] = []
    rng = random.Random(spec.seed + 1)
    for token_request in make_token_prompts(spec):
        ids = list(token_request.prompt) if isinstance(token_request.prompt, tuple) else []
        text = decode(ids)
        for _ in range(max_rounds):
            got = list(encode(text))
            if len(got) == spec.input_len:
                break
            if len(got) > spec.input_len:
                got = got[: spec.input_len]
            else:
                extra = spec.input_len - len(got)
                got += [rng.randrange(spec.first_id, spec.vocab_size) for _ in range(extra)]
            text = decode(got)
        else:
            raise ValueError(
                f"input_len: could not make a text prompt of exactly {spec.input_len} tokens"
            )
        requests.append(BenchRequest(text, spec.input_len, spec.output_len))
    return requests
