"""Following routed prefixes in the router: the prompt's prefix chain, the memory over endpoints,
and one ext_proc stream per turn of a conversation."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.extproc import Exchange, RouterCore
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.prompts import BLOCK_CHARS, BLOCK_TOKENS, MAX_BLOCKS, prefix_chain, prompt_text
from cacheroute.router.table import build_table
from tests.support.extproc import body, handle, headers, routed_to, sample

Mode = processing_mode_pb2.ProcessingMode
ADDRESSES = [f"10.0.1.{i}:8000" for i in range(1, 9)]


def chat(*turns: str, system: str = "You are terse.") -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


# --- the chain -------------------------------------------------------------------------------------


def test_a_later_turn_extends_the_chain_of_the_earlier_one() -> None:
    first = prefix_chain(prompt_text(chat("a" * 3000)))
    later = prefix_chain(prompt_text(chat("a" * 3000, "b" * 500, "c" * 800)))
    assert len(first) == -(-len(prompt_text(chat("a" * 3000))) // BLOCK_CHARS)
    # Every full block of the first prompt is shared; its last, partial block is not.
    assert later[: len(first) - 1] == first[:-1]
    assert later[len(first) - 1] != first[-1]


def test_prompts_that_differ_early_share_nothing_after_the_difference() -> None:
    one = prefix_chain(prompt_text(chat("x" * 5000)))
    other = prefix_chain(prompt_text(chat("x" * 5000, system="You are verbose.")))
    assert one[0] != other[0]
    assert not set(one) & set(other)


def test_moving_text_between_messages_changes_the_chain() -> None:
    a = prefix_chain(prompt_text(chat("hello world", "ok")))
    b = prefix_chain(prompt_text(chat("hello", " world ok")))
    assert a != b


def test_completions_prompts_and_responses_input_have_chains() -> None:
    assert prefix_chain(prompt_text({"prompt": "p" * 2500})) == prefix_chain("p" * 2500)
    assert len(prefix_chain(prompt_text({"prompt": ["q" * 10]}))) == 1
    assert len(prefix_chain(prompt_text({"input": "r" * 10, "instructions": "be brief"}))) == 1
    assert prefix_chain(prompt_text({"model": "m"})) == []


def test_a_huge_prompt_stops_its_chain_at_the_cap() -> None:
    assert len(prefix_chain("z" * (BLOCK_CHARS * (MAX_BLOCKS + 10)))) == MAX_BLOCKS


# --- the memory over endpoints -----------------------------------------------------------------------


def following_picker(n: int = 8, unplanned: str = "p2c") -> Picker:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, seed=5, unplanned=unplanned, follow_prefixes=True)
    plan = plan_from_routes("pool", [Destination(f"pool-{i}", a) for i, a in enumerate(ADDRESSES[:n])], {})
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    return picker


def test_every_turn_of_a_conversation_goes_where_the_first_went() -> None:
    picker = following_picker()
    turns = ["t" * 4000]
    first = picker.pick(None, prompt_tokens=1100, chain=prefix_chain(prompt_text(chat(*turns))))
    followed = []
    for i in range(6):
        turns += [f"answer {i} " * 20, f"question {i} " * 20]
        chain = prefix_chain(prompt_text(chat(*turns)))
        decision = picker.pick(None, prompt_tokens=len(prompt_text(chat(*turns))) // 4, chain=chain)
        followed.append(decision.endpoints[0])
        assert decision.outcome in ("followed", "p2c")
    assert set(followed) == {first.endpoints[0]}
    # Without the memory, plain p2c scatters the same turns.
    forgetful = Picker(picker.pool, seed=5, unplanned="p2c")
    scattered = {forgetful.pick(None).endpoints[0] for _ in range(6)}
    assert len(scattered) > 1


def test_a_turn_is_charged_only_what_its_endpoint_does_not_hold() -> None:
    picker = following_picker()
    chain = prefix_chain(prompt_text({"prompt": "h" * (40 * BLOCK_CHARS)}))
    tokens = 40 * BLOCK_TOKENS
    first = picker.pick(None, prompt_tokens=tokens, chain=chain)
    assert first.charge == tokens
    # The next turn: the whole history plus one new block of 50 tokens.
    again = picker.pick(None, prompt_tokens=tokens + 50, chain=[*chain, 12345])
    assert again.endpoints[0] is first.endpoints[0]
    assert again.charge == 50


def test_an_endpoint_that_leaves_is_forgotten() -> None:
    picker = following_picker(3)
    chain = prefix_chain(prompt_text(chat("k" * 8000)))
    first = picker.pick(None, prompt_tokens=2000, chain=chain).endpoints[0]
    assert picker.remembered_prefixes == len(chain)
    remaining = [a for a in ADDRESSES[:3] if a != first.address]
    picker.pool.set_plan_destinations([Destination(f"pool-{a}", a) for a in remaining])
    assert picker.remembered_prefixes == 0
    decision = picker.pick(None, prompt_tokens=2000, chain=chain)
    assert decision.outcome == "p2c" and decision.endpoints[0].address in remaining


def test_a_stuffed_destination_is_not_followed_past_the_load_bound() -> None:
    picker = following_picker(2)
    chain = prefix_chain(prompt_text(chat("s" * 8000)))
    first = picker.pick(None, prompt_tokens=2000, chain=chain).endpoints[0]
    for _ in range(40):
        picker.pool.acquire(first)
    decision = picker.pick(None, prompt_tokens=2000, chain=chain)
    assert decision.endpoints[0] is not first


def test_a_long_system_prompt_does_not_herd_new_conversations_once_two_endpoints_hold_it() -> None:
    """A system prompt longer than the questions after it: following it would send every new
    conversation to the endpoint the previous one went to, up to the load bound, then to the next.
    Once a second endpoint holds it, it is no reason to prefer the last one: new conversations are
    scored, and the two holders, holding it alike, share them by load."""
    picker = following_picker(4, unplanned="key-p2c")
    system = "You follow the house style guide. " * 600  # 20,400 characters: 19 whole blocks
    outcomes: list[str] = []
    went: list[Any] = []
    for i in range(40):
        text = prompt_text(chat(f"question {i}: " + "why? " * 40, system=system))
        decision = picker.pick(None, prompt_tokens=len(text) // 4, chain=prefix_chain(text))
        picker.pool.acquire(decision.endpoints[0], decision.charge)  # every request still in flight
        outcomes.append(decision.outcome)
        went.append(decision.endpoints[0])
    second = next(i for i, e in enumerate(went) if e is not went[0])
    assert "followed" not in outcomes[second + 1 :]
    assert set(outcomes[second + 1 :]) == {"scored"}
    assert sorted(Counter(id(e) for e in went).values()) == [20, 20]


def test_an_unplanned_key_goes_where_part_of_its_prompt_is_held_unless_that_endpoint_is_busy() -> None:
    """Key-seeded p2c keeps a key on its two ring candidates; with prefix memory an unplanned
    request that shares less than half its prompt with an earlier one is scored instead, and the
    endpoint holding the shared part wins while loads are close."""
    picker = following_picker(unplanned="key-p2c")
    document = "shared manual " * 700  # 9,800 characters: 9 whole blocks
    went = picker.pick(None, prompt_tokens=2450, chain=prefix_chain(prompt_text({"prompt": document}))).endpoints[0]

    def alone(key: str) -> Any:
        # Where the key goes with nothing of its prompt held anywhere: its first ring candidate.
        unrelated = prefix_chain(prompt_text({"prompt": key * 3000}))
        return picker.pick(affinity_key_hash(key), prompt_tokens=3000, chain=unrelated).endpoints[0]

    key = next(k for k in (f"user-{i}" for i in range(100)) if alone(k) is not went)
    question = {"prompt": document + "question " * 1800}  # 9 of 25 blocks held: not worth following
    chain = prefix_chain(prompt_text(question))
    decision = picker.pick(affinity_key_hash(key), prompt_tokens=6250, chain=chain)
    assert (decision.outcome, decision.endpoints[0]) == ("scored", went)
    # The holder as busy as the whole spread of load: the share it holds (3 x 9/25) is not enough.
    for _ in range(3):
        picker.pool.acquire(went)
    other = prefix_chain(prompt_text({"prompt": document + "follow-up " * 1600}))
    decision = picker.pick(affinity_key_hash(key), prompt_tokens=6250, chain=other)
    assert decision.outcome == "scored"
    assert decision.endpoints[0] is not went


# --- one stream per turn ----------------------------------------------------------------------------


def following_core() -> RouterCore:
    picker = following_picker()
    return RouterCore(picker, RouterMetrics(picker.pool, sketch_size=16, export_key_names=False),
                      max_body_bytes=1 << 20)


def test_with_a_key_header_the_router_still_reads_the_body_to_follow() -> None:
    core = following_core()
    conversation = chat("d" * 6000)
    ex = Exchange(core)
    (first,) = handle(ex, headers(Mode.BUFFERED, key="alice"))
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.HasField("header_mutation")
    (reply,) = handle(ex, body(json.dumps(conversation).encode(), True))
    went = routed_to(reply)
    ex.finish()
    assert ex.key is not None and ex.key.name == "alice"
    conversation["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    for _ in range(3):
        ex = Exchange(core)
        handle(ex, headers(Mode.FULL_DUPLEX_STREAMED))
        replies = handle(ex, body(json.dumps(conversation).encode(), True))
        assert routed_to(replies[0]) == went
        ex.finish()
    followed = sample(core, "cacheroute_router_decisions_total", outcome="followed") or 0.0
    assert followed + (sample(core, "cacheroute_router_decisions_total", outcome="p2c") or 0.0) == 4


def test_short_equal_prompts_do_not_pull_a_request_off_its_route() -> None:
    """A greeting shorter than one block is sent by many users: it is not worth following."""
    picker = following_picker()
    greeting = prefix_chain(prompt_text(chat("hello")))
    first = picker.pick(None, prompt_tokens=20, chain=greeting).endpoints[0]
    outcomes = {picker.pick(None, prompt_tokens=20, chain=greeting).outcome for _ in range(20)}
    assert outcomes == {"p2c"}
    assert picker.remembered_prefixes == 1 and first is not None


def test_a_pinned_route_is_not_left_to_follow_a_prefix() -> None:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, seed=5, unplanned="p2c", follow_prefixes=True)
    destinations = [Destination(f"pool-{i}", a) for i, a in enumerate(ADDRESSES[:4])]
    plan = plan_from_routes("pool", destinations, {affinity_key_hash("pinned"): ["pool-3"],
                                                   affinity_key_hash("computed"): ["pool-3"]})
    plan = replace(plan, pinned_keys=np.array([affinity_key_hash("pinned")], dtype=np.uint64))
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    busy = pool.by_address[ADDRESSES[3]]
    pool.acquire(busy)
    pool.acquire(busy)
    chain = prefix_chain(prompt_text(chat("shared document " * 400)))
    # The document was first sent without a key: p2c prefers the three idle endpoints.
    elsewhere = picker.pick(None, prompt_tokens=1700, chain=chain).endpoints[0]
    assert elsewhere is not busy
    computed = picker.pick(affinity_key_hash("computed"), prompt_tokens=1700, chain=chain)
    assert (computed.outcome, computed.endpoints[0]) == ("followed", elsewhere)
    pinned = picker.pick(affinity_key_hash("pinned"), prompt_tokens=1700, chain=chain)
    assert (pinned.outcome, pinned.endpoints[0]) == ("planned", busy)


def test_the_memory_holds_as_many_prefixes_as_the_plan_s_destinations_hold() -> None:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, follow_prefixes=True, prefix_memory_blocks=10_000)
    assert picker.prefix_memory_capacity == 10_000  # no plan yet: the limit
    destinations = [Destination(f"pool-{i}", a, 1.0, 2_560, 1_280) for i, a in enumerate(ADDRESSES[:2])]
    plan = plan_from_routes("pool", destinations, {})
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    assert picker.prefix_memory_capacity == 2 * (2_560 + 1_280) // BLOCK_TOKENS
    sent = Counter(picker.pick(None, prompt_tokens=300, chain=[i]).endpoints[0] for i in range(40))
    # Each endpoint keeps the last 15 prefixes sent to it (3,840 tokens of 256).
    assert picker.remembered_prefixes == sum(min(n, 15) for n in sent.values())


def test_without_a_plan_the_memory_holds_what_the_endpoints_hold() -> None:
    """Shadow mode or before the first plan: as many prefixes as the known endpoints' KV holds,
    following membership; a plan's capacities take over once one is in effect."""
    pool = EndpointPool(scraping=False)
    pool.set_static(ADDRESSES[:2])
    picker = Picker(pool, follow_prefixes=True, prefix_memory_blocks=10_000, endpoint_kv_tokens=2_560)
    assert picker.prefix_memory_capacity == 2 * 2_560 // BLOCK_TOKENS
    pool.set_static(ADDRESSES[:3])
    assert picker.prefix_memory_capacity == 3 * 2_560 // BLOCK_TOKENS
    picker.install(build_table(plan_from_routes("pool", [], {}), "empty"))  # the pool's first, empty plan
    assert picker.prefix_memory_capacity == 3 * 2_560 // BLOCK_TOKENS
    destinations = [Destination(f"pool-{i}", a, 1.0, 5_120, 0) for i, a in enumerate(ADDRESSES[:3])]
    pool.set_plan_destinations(destinations)
    picker.install(build_table(plan_from_routes("pool", destinations, {}), "v1"))
    assert picker.prefix_memory_capacity == 3 * 5_120 // BLOCK_TOKENS
    unknown = Picker(pool, follow_prefixes=True, prefix_memory_blocks=10_000)
    assert unknown.prefix_memory_capacity == 3 * (10_000 // 3)  # the limit, shared out


def test_a_conversation_the_fleet_has_evicted_since_its_last_turn_is_not_followed() -> None:
    """A memory the size of the caches forgets what they evicted: the next turn of an old
    conversation is routed for balance, not pulled to where its history used to be."""

    def next_turn_outcome(endpoint_kv_tokens: int) -> str:
        pool = EndpointPool(scraping=False)
        pool.set_static(ADDRESSES[:4])
        picker = Picker(pool, seed=5, unplanned="p2c", follow_prefixes=True, endpoint_kv_tokens=endpoint_kv_tokens)
        old = chat("o" * 8000)
        picker.pick(None, prompt_tokens=2_000, chain=prefix_chain(prompt_text(old)))
        for i in range(200):  # other conversations since: 200 x 8 blocks, past what 4 x 2,560 tokens hold
            picker.pick(None, prompt_tokens=2_000, chain=prefix_chain(prompt_text(chat(f"{i:04d}" * 2000))))
        later = chat("o" * 8000, "ok", "and then?")
        return picker.pick(None, prompt_tokens=2_010, chain=prefix_chain(prompt_text(later))).outcome

    assert next_turn_outcome(0) == "followed"  # fleet not known: the memory outlives the caches
    assert next_turn_outcome(2_560) == "p2c"
