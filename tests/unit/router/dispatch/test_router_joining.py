"""One client stream made of two D streams (:mod:`disagg_router.router.dispatch.joining`): what
the client sees across the seam, and the request that continues the stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg_router.router.dispatch.joining import (
    JoinRules,
    StreamJoin,
    asking_ids,
    ineligible,
)
from disagg_router.router.request import ClientRequest

PROMPT = [101, 102, 103, 104]


def _text(
    i: int, text: str, ids: list[int], finish: str | None = None, prompt: list[int] | None = None
) -> dict[str, Any]:
    """A completion chunk as vLLM streams it with ``return_token_ids`` (the prompt's ids in the
    first chunk's choice, null after), its choice's keys in vLLM 0.32's order."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    choice |= {"stop_reason": None, "prompt_token_ids": prompt, "token_ids": ids}
    return {"id": f"cmpl-{i}", "created": 100 + i, "model": "m", "choices": [choice]}


def _delta(i: int, delta: dict[str, Any], ids: list[int] | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": f"chat-{i}", "created": 100 + i, "model": "m", "choices": [choice]}


def _completion(**body: Any) -> ClientRequest:
    return ClientRequest(
        body={"model": "m", "prompt": "hi", "stream": True, **body},
        chat=False,
        stream=True,
        model="m",
    )


def _chat(**body: Any) -> ClientRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ClientRequest(
        body={"model": "m", "messages": messages, "stream": True, **body},
        chat=True,
        stream=True,
        model="m",
    )


def test_a_completion_stream_joins_with_one_id_each_token_once_and_usage_counted_once() -> None:
    join = StreamJoin(client_ids=False)
    first = join.event(_text(1, "a", [7], prompt=PROMPT))
    second = join.event(_text(1, "b", [8]))
    assert first is not None and second is not None
    assert first["choices"][0].keys() == {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
    }
    assert join.resumable() and join.generated == [7, 8]
    request = _completion(max_tokens=5, min_tokens=3)
    continued = join.continuation(request)
    assert continued.body["prompt"] == [*PROMPT, 7, 8]
    assert continued.body["max_tokens"] == 3 and continued.body["min_tokens"] == 1
    assert continued.body["return_token_ids"] is True
    join.next_segment()
    # the second D's stream: its own id and times, its prompt = the first prompt + 2 tokens
    third = join.event(_text(2, "c", [9], prompt=[*PROMPT, 7, 8]))
    last = join.event(_text(2, "", [10], finish="length"))
    usage = {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    tail = join.event({"id": "cmpl-2", "created": 102, "model": "m", "choices": [], "usage": usage})
    assert third is not None and last is not None and tail is not None
    assert {c["id"] for c in (first, second, third, last, tail)} == {"cmpl-1"}
    assert {c["created"] for c in (first, third, tail)} == {101}
    assert "prompt_token_ids" not in third["choices"][0]
    assert [c["choices"][0]["text"] for c in (first, second, third)] == ["a", "b", "c"]
    assert last["choices"][0]["finish_reason"] == "length"  # the second D's finish
    assert tail["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert join.usage == tail["usage"]


def test_token_ids_the_client_asked_for_stay_in_its_stream() -> None:
    join = StreamJoin(client_ids=True)
    first = join.event(_text(1, "a", [7], prompt=PROMPT))
    assert first is not None
    assert first["choices"][0]["prompt_token_ids"] == PROMPT
    assert first["choices"][0]["token_ids"] == [7]
    join.next_segment()
    again = join.event(_text(2, "b", [8], prompt=[*PROMPT, 7]))
    assert again is not None  # the prompt's ids are given once
    assert again["choices"][0] == {
        "index": 0,
        "text": "b",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "token_ids": [8],
    }


def test_a_chat_continuation_repeats_no_role_and_leaves_reasoning_and_content_intact() -> None:
    """vLLM's chat stream: a role chunk without token ids, then tokens with theirs."""
    join = StreamJoin(client_ids=False)
    role = join.event(
        {**_delta(1, {"role": "assistant", "content": ""}, None), "prompt_token_ids": PROMPT}
    )
    thought = join.event(_delta(1, {"reasoning_content": "think"}, [5]))
    held = join.event(_delta(1, {}, [6]))  # ids vLLM sends while its parser holds text back
    assert role is not None and role["choices"][0]["delta"]["role"] == "assistant"
    assert thought is not None and thought["choices"][0]["delta"] == {"reasoning_content": "think"}
    assert held is None
    assert join.resumable()  # the role chunk names no token, and needs no id
    continued = join.continuation(_chat(max_completion_tokens=10))
    assert continued.prompt_ids == (*PROMPT, 5, 6)
    assert continued.body["messages"] == [{"role": "user", "content": "hi"}]
    assert continued.body["max_completion_tokens"] == 8
    join.next_segment()
    assert join.event(_delta(2, {"role": "assistant", "content": ""}, None)) is None
    answer = join.event(_delta(2, {"content": "ok"}, [11]))
    assert answer is not None
    assert answer["id"] == "chat-1" and answer["choices"][0]["delta"] == {"content": "ok"}


def test_a_stream_with_a_tool_call_begun_or_a_token_without_its_id_is_not_continued() -> None:
    join = StreamJoin(client_ids=False)
    join.event({**_delta(1, {"role": "assistant"}, None), "prompt_token_ids": PROMPT})
    call = {"index": 0, "id": "call-1", "function": {"name": "f", "arguments": ""}}
    out = join.event(_delta(1, {"tool_calls": [call]}, [5]))
    assert out is not None and out["choices"][0]["delta"] == {"tool_calls": [call]}
    assert not join.resumable()
    no_ids = StreamJoin(client_ids=False)
    no_ids.event(_text(1, "a", [7], prompt=PROMPT))
    no_ids.event({"id": "x", "choices": [{"index": 0, "text": "b", "finish_reason": None}]})
    assert not no_ids.resumable()


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (_completion(), None),
        (_completion(prompt=[1, 2, 3]), None),
        (_chat(), None),
        (_completion(prompt=["a", "b"]), "several prompts"),
        (_completion(n=2), "several choices"),
        (_completion(echo=True), "echo or beam search"),
        (_completion(seed=7), "seeded sampling"),
        (
            _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "non-text content",
        ),
    ],
)
def test_which_requests_can_be_continued(request_: ClientRequest, reason: str | None) -> None:
    assert ineligible(request_, JoinRules()) == reason
    assert ineligible(_completion(seed=7), JoinRules(seeded=True)) is None


def test_asking_ids_leaves_the_client_s_request_alone() -> None:
    request = _completion()
    asked = asking_ids(request)
    assert asked.body["return_token_ids"] is True and "return_token_ids" not in request.body


def _wire(chunk: dict[str, Any]) -> bytes:
    """A chunk as vLLM writes it: compact JSON."""
    return json.dumps(chunk, separators=(",", ":")).encode()


@pytest.mark.parametrize("client_ids", [False, True])
def test_the_unparsed_path_gives_what_the_parsed_one_gives(client_ids: bool) -> None:
    """Chunks the join reads without parsing come out as the parsed path makes them, and
    count the same ids; what it must judge is left to the parsed path."""
    chunks = [
        _text(1, "a", [7], prompt=PROMPT),  # the prompt's ids: parsed
        _text(1, "b", [8, 9]),
        _text(1, "", []),  # ids came before their text
        _text(1, 'say "token_ids":[1]', [10]),  # the marker inside a string
        _text(1, "c", [11], finish="length"),
        _delta(1, {"content": "x"}, [12]),
        _delta(1, {}, [13]),  # held back: parsed (dropped)
    ]
    fast, slow = StreamJoin(client_ids), StreamJoin(client_ids)
    for chunk in chunks:
        plain = fast.plain_event(_wire(chunk))
        got = json.loads(plain) if plain is not None else fast.event(json.loads(_wire(chunk)))
        assert got == slow.event(json.loads(_wire(chunk))), chunk
    assert fast.generated == slow.generated == [7, 8, 9, 10, 11, 12, 13]
    assert fast.plain_event(_wire(chunks[0])) is None  # the prompt's ids are judged
    assert fast.plain_event(_wire(chunks[-1])) is None
    fast.next_segment()
    assert fast.plain_event(_wire(chunks[1])) is None  # a continuation's chunks are rewritten
