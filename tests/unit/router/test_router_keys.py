"""Where a request's affinity key comes from, and the token estimates."""

from __future__ import annotations

import json

from cacheroute.planner.plan import KeyExtraction, affinity_key_hash
from cacheroute.router import keys
from cacheroute.router.keys import HEADER, HeaderKeys, Key
from cacheroute.router.settings import KeyOverrides

DEFAULT = KeyExtraction()


def doc(**fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_header_wins_over_body_and_session() -> None:
    extraction = KeyExtraction(session_header="x-session")
    headers = {"x-affinity-key": "tenant-a", "x-session": "s1"}
    key = keys.request_key(headers, doc(user="u1"), extraction)
    assert key == keys.Key(affinity_key_hash("tenant-a"), keys.HEADER, "tenant-a")


def test_body_field_then_session_header_then_prompt() -> None:
    extraction = KeyExtraction(session_header="x-session", prompt_prefix_chars=10)
    by_body = keys.request_key({"x-session": "s1"}, doc(user="u1"), extraction)
    assert by_body is not None and by_body.source == keys.BODY
    by_session = keys.request_key({"x-session": "s1"}, doc(), extraction)
    assert by_session is not None and by_session.source == keys.SESSION
    by_prompt = keys.request_key({}, doc(), extraction)
    assert by_prompt is not None
    assert by_prompt.source == keys.PROMPT
    assert by_prompt.name is None
    assert keys.request_key({}, None, KeyExtraction(body_field=None)) is None


def test_dotted_body_field_and_integer_values() -> None:
    extraction = KeyExtraction(body_field="metadata.session_id")
    assert keys.key_from_body({"metadata": {"session_id": 42}}, extraction) == keys.Key(
        affinity_key_hash("42"), keys.BODY, "42"
    )
    assert keys.key_from_body({"metadata": "flat"}, extraction) is None
    assert keys.key_from_body({"metadata": {"session_id": ""}}, extraction) is None
    assert keys.key_from_body({"metadata": {"session_id": True}}, extraction) is None


def test_prompt_prefix_is_system_then_first_user_message() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Summarise "}, {"type": "text", "text": "this"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and this"},
        ]
    }
    assert keys.prompt_prefix(body, 1000) == "You are terse.\nSummarise this"
    assert keys.prompt_prefix(body, 8) == "You are "
    assert keys.prompt_prefix({"prompt": "Once upon a time"}, 4) == "Once"
    assert keys.prompt_prefix({"prompt": ["first", "second"]}, 100) == "first"
    assert keys.prompt_prefix({"instructions": "Be kind.", "input": "hello"}, 100) == "Be kind.\nhello"
    # Same prefix, same key: follow-up turns of a conversation share it.
    extraction = KeyExtraction(body_field=None, prompt_prefix_chars=64)
    later = dict(body, messages=[*body["messages"], {"role": "assistant", "content": "done"}])
    assert keys.key_from_prompt(body, extraction) == keys.key_from_prompt(later, extraction)


def test_malformed_bodies_give_no_document() -> None:
    assert keys.parse_body(b'{"model": "m", "messages": [') is None
    assert keys.parse_body(b"[1, 2]") is None
    assert keys.parse_body(b"\xff\xfe") is None
    assert keys.parse_body(json.dumps(doc()).encode()) == doc()


def test_token_estimates() -> None:
    assert keys.estimate_prompt_tokens(0) == 0
    assert keys.estimate_prompt_tokens(401) == 101
    history = [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "u" * 400}]
    body = json.dumps({"model": "m", "messages": [*history, {"role": "user", "content": "new question"}]}).encode()
    # Everything before the newest message, JSON punctuation included.
    assert 200 <= keys.estimate_prefix_tokens(body) <= 200 * 1.15
    single = json.dumps({"messages": [{"role": "user", "content": "x" * 1000}]}).encode()
    assert keys.estimate_prefix_tokens(single) == 0
    assert keys.estimate_prefix_tokens(json.dumps({"prompt": "x" * 100}).encode()) == 0
    # A quoted word inside content is escaped and does not count as a message boundary.
    tricky = json.dumps({"messages": [{"role": "user", "content": 'say "role" twice "role"'}]}).encode()
    assert keys.estimate_prefix_tokens(tricky) == 0


def test_usage_in_a_response_chunk() -> None:
    final = b'data: {"choices": [], "usage": {"prompt_tokens": 1234, "completion_tokens": 5}}\n\n'
    assert keys.usage_prompt_tokens(final) == 1234
    assert keys.usage_prompt_tokens(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n') is None


def test_flags_override_the_plan_and_can_switch_sources_off() -> None:
    plan = KeyExtraction(header="X-Tenant", body_field="user", session_header="X-Session", prompt_prefix_chars=32)
    assert KeyOverrides().apply(plan) == KeyExtraction("x-tenant", "user", "x-session", 32)
    overridden = KeyOverrides(header="x-key", body_field="", session_header="", prompt_prefix_chars=0).apply(plan)
    assert overridden == KeyExtraction("x-key", None, None, 0)
    assert not keys.wants_body(overridden)


def test_header_keys_hash_as_the_planner_does_and_start_over_when_full() -> None:
    keys = HeaderKeys(capacity=2)
    first = keys.add("tenant-1")
    assert first == Key(affinity_key_hash("tenant-1"), HEADER, "tenant-1")
    assert keys.get("tenant-1") is first
    keys.add("tenant-2")
    keys.add("tenant-3")  # full: the memory starts over with this key alone
    assert list(keys) == ["tenant-3"]
    assert keys.get("tenant-1") is None
