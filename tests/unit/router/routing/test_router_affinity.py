"""prefix_affinity and session_affinity: stable choice per key, even spread, minimal movement
when an instance leaves or joins, and the load bound."""

from __future__ import annotations

from collections import Counter

from disagg_router.router.config import InstanceConfig
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.policies.affinity import load_bound, rendezvous_order
from disagg_router.router.routing.policies.base import RoutingInput
from disagg_router.router.routing.policies.prefix_affinity import PrefixAffinity
from disagg_router.router.routing.policies.session_affinity import SessionAffinity
from disagg_router.router.routing.prompt_keys import (
    estimated_tokens,
    prefix_key,
    prompt_of,
    render_messages,
)


def _backends(n: int, first: int = 0) -> list[BackendState]:
    return [
        BackendState(InstanceConfig(url=f"http://127.0.0.1:{8100 + i}", name=f"p{i}"), "prefill")
        for i in range(first, first + n)
    ]


def _prompt(i: int) -> RoutingInput:
    return RoutingInput({"prompt": f"system prompt of conversation {i}. " * 20})


def _assignment(policy: PrefixAffinity, backends: list[BackendState], keys: int) -> list[str]:
    return [policy.choose(backends, _prompt(i)).label for i in range(keys)]


def test_same_prefix_same_instance_whatever_follows() -> None:
    bs = _backends(4)
    policy = PrefixAffinity(prefix_chars=256, load_factor=1.25)
    shared = "You are a helpful assistant. " * 20
    picks = {
        policy.choose(bs, RoutingInput({"prompt": shared + f" turn {t}"})).label for t in range(20)
    }
    assert len(picks) == 1


def test_prefixes_spread_over_instances() -> None:
    bs = _backends(4)
    counts = Counter(_assignment(PrefixAffinity(256, 1.25), bs, 400))
    assert set(counts) == {b.label for b in bs}
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_instance_leaving_moves_only_its_keys() -> None:
    bs = _backends(4)
    policy = PrefixAffinity(256, 1.25)
    before = _assignment(policy, bs, 300)
    after = _assignment(policy, [b for b in bs if b.label != "p2"], 300)
    moved = [i for i in range(300) if before[i] != after[i]]
    assert moved and all(before[i] == "p2" for i in moved)
    assert len(moved) == before.count("p2")


def test_instance_joining_takes_keys_only_for_itself() -> None:
    bs = _backends(3)
    policy = PrefixAffinity(256, 1.25)
    before = _assignment(policy, bs, 300)
    after = _assignment(policy, bs + _backends(1, first=3), 300)
    moved = [i for i in range(300) if before[i] != after[i]]
    assert moved and all(after[i] == "p3" for i in moved)


def test_load_bound_spills_a_hot_prefix_and_is_never_exceeded() -> None:
    bs = _backends(3)
    policy = PrefixAffinity(256, load_factor=1.25)
    hot = _prompt(7)
    home = rendezvous_order(prefix_key(hot.prompt, 256), bs)[0]
    for _ in range(30):  # 30 concurrent legs of one prefix, none finishing
        bound = load_bound(bs, 1.25)
        chosen = policy.choose(bs, hot)
        chosen.in_flight += 1
        assert chosen.in_flight <= bound
    assert home.in_flight == max(b.in_flight for b in bs)
    assert all(b.in_flight > 0 for b in bs)  # the overflow spilled
    assert max(b.in_flight for b in bs) <= load_bound(bs, 1.25)


def test_requests_without_prompt_text_go_to_the_least_loaded() -> None:
    bs = _backends(2)
    bs[0].in_flight = 2
    assert PrefixAffinity(256, 1.25).choose(bs, RoutingInput({"prompt": ""})) is bs[1]


def test_chat_renders_system_first_in_order() -> None:
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
    ]
    text = render_messages(msgs)
    assert text.index("be brief") < text.index("hi") < text.index("hello")
    longer = RoutingInput({"messages": [*msgs, {"role": "user", "content": "more"}]}, chat=True)
    assert longer.prompt.startswith(text)  # type: ignore[union-attr]


def test_token_prompts_hash_their_leading_ids() -> None:
    ids = list(range(1000))
    assert prompt_of({"prompt": [ids]}, chat=False) == ids
    assert prefix_key(ids, 400) == prefix_key([*ids[:100], 7, 7], 400)
    assert estimated_tokens(ids, 4.0) == 1000
    assert estimated_tokens("x" * 2048, 4.0) == 512


def test_session_affinity_header_then_user_then_least_loaded() -> None:
    bs = _backends(4)
    policy = SessionAffinity("x-session-id", 1.25)
    by_header = {
        policy.choose(bs, RoutingInput({"prompt": f"q{i}"}, headers={"x-session-id": "abc"})).label
        for i in range(10)
    }
    assert len(by_header) == 1
    by_user = {
        policy.choose(bs, RoutingInput({"prompt": f"q{i}", "user": "u1"})).label for i in range(10)
    }
    assert len(by_user) == 1
    spread = Counter(
        policy.choose(bs, RoutingInput({"user": f"user-{i}"})).label for i in range(200)
    )
    assert len(spread) == 4
    bs[0].in_flight, bs[1].in_flight, bs[2].in_flight = 1, 1, 1
    assert policy.choose(bs, RoutingInput({"prompt": "anonymous"})) is bs[3]
