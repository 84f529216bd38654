"""The answers check's verdicts (:mod:`bench.answers`): prompts, outcomes, comparison."""

from __future__ import annotations

from bench.answers import Outcome, classify, compare, make_prompts, stable_prefix, summarize


def test_prompts_are_distinct_deterministic_and_of_every_shape() -> None:
    prompts = make_prompts(90, seed=3, block_size=16)
    assert prompts == make_prompts(90, seed=3, block_size=16)
    assert prompts != make_prompts(90, seed=4, block_size=16)
    assert len({p.text for p in prompts}) == 90
    lengths = [len(p.text.split()) for p in prompts]
    assert min(lengths) < 16 < max(lengths)
    assert {p.stream for p in prompts} == {True, False}


def test_only_a_clean_200_is_a_completed_answer() -> None:
    assert classify(200, True, None, False, "x") == Outcome("completed", text="x")
    assert classify(200, False, None, False).reason == "stream ended without [DONE]"
    assert classify(200, True, "service_unavailable", False).kind == "failed"
    assert classify(503, False, None, False).reason == "http 503"
    assert classify(None, False, "ReadTimeout", False).reason == "transport: ReadTimeout"
    assert classify(None, False, None, True).kind == "aborted"


def test_a_different_answer_is_a_mismatch_and_a_missing_reference_too() -> None:
    reference = {0: "a b c", 1: "d e f"}
    found = compare(reference, reference, {0: "a b c", 1: "d e X", 2: "g"})
    assert (found.compared, found.mismatched, found.unstable) == (3, [1, 2], [])


def test_where_the_reference_disagrees_with_itself_only_the_agreed_part_counts() -> None:
    first, second = {0: "a b c d"}, {0: "a b X d"}
    assert stable_prefix(first[0], second[0]) == 4
    assert compare(first, second, {0: "a b Y"}).mismatched == []
    assert compare(first, second, {0: "a Z c d"}).mismatched == [0]
    assert compare(first, second, {0: "a b c d"}).unstable == [0]


def test_a_prefix_of_a_stable_reference_is_a_mismatch() -> None:
    assert compare({0: "a b c"}, {0: "a b c"}, {0: "a b"}).mismatched == [0]


def test_the_summary_counts_failures_by_reason() -> None:
    outcomes = [Outcome("completed"), Outcome("failed", "http 503"), Outcome("failed", "http 503")]
    assert summarize([*outcomes, Outcome("aborted")]) == {
        "completed": 1,
        "aborted": 1,
        "failed": 2,
        "failed_by_reason": {"http 503": 2},
    }
