"""Synthetic dataset: exact lengths, shared prefix, seeding, text prompts via a real tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from bench.dataset import SyntheticSpec, make_text_prompts, make_token_prompts


def test_token_prompts_lengths_and_shared_prefix() -> None:
    spec = SyntheticSpec(num_requests=5, input_len=64, output_len=8, prefix_len=16, vocab_size=100)
    reqs = make_token_prompts(spec)
    assert len(reqs) == 5
    for r in reqs:
        assert isinstance(r.prompt, tuple)
        assert len(r.prompt) == r.prompt_len == 64
        assert r.output_len == 8
        assert all(spec.first_id <= t < 100 for t in r.prompt)
        assert r.prompt[:16] == reqs[0].prompt[:16]
    assert len({r.prompt[16:] for r in reqs}) == 5  # suffixes differ
    assert make_token_prompts(spec) == reqs


def test_no_prefix_means_distinct_prompts() -> None:
    reqs = make_token_prompts(SyntheticSpec(num_requests=3, input_len=32, output_len=1))
    assert reqs[0].prompt[:8] != reqs[1].prompt[:8]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("input_len", {"input_len": 0}),
        ("output_len", {"output_len": 0}),
        ("prefix_len", {"prefix_len": 99}),
        ("vocab_size", {"vocab_size": 3}),
    ],
)
def test_bad_spec_names_field(field: str, kwargs: dict[str, int]) -> None:
    base = {"num_requests": 1, "input_len": 10, "output_len": 1}
    with pytest.raises(ValueError, match=field):
        make_token_prompts(SyntheticSpec(**{**base, **kwargs}))


def _word_tokenizer(size: int) -> Tokenizer:
    vocab = {f"w{i}": i for i in range(size)}
    vocab["[UNK]"] = size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_text_prompts_encode_to_exact_length() -> None:
    tok = _word_tokenizer(200)
    spec = SyntheticSpec(num_requests=4, input_len=50, output_len=4, prefix_len=10, vocab_size=200)
    reqs = make_text_prompts(
        spec,
        encode=lambda t: tok.encode(t, add_special_tokens=False).ids,
        decode=lambda ids: tok.decode(list(ids)),
    )
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert len(tok.encode(r.prompt, add_special_tokens=False).ids) == 50
    assert reqs[0].prompt.split()[:10] == reqs[1].prompt.split()[:10]
