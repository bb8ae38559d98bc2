"""Mooncake trace parsing, key derivation and the thread proxy (checked against traces/README.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cacheroute.planner.mooncake import TraceFormatError, infer_threads, parse_mooncake_lines, read_mooncake, with_keys
from cacheroute.planner.trace import NO_KEY
from cacheroute.planner.tracestats import trace_stats

TRACES = Path(os.environ.get("CACHEROUTE_TRACES_DIR", Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"))


def _line(ts: int, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def test_lines_become_a_sorted_trace_with_first_block_keys() -> None:
    lines = [
        _line(2000, 1024, 10, [1, 2]),
        "",
        _line(1000, 600, 5, [1, 3]),
        _line(3000, 100, 1, [7]),
    ]
    tr = parse_mooncake_lines(lines, key="first-blocks:1")
    assert tr.arrival_s.tolist() == [1.0, 2.0, 3.0]
    assert tr.input_tokens.tolist() == [600, 1024, 100]
    assert tr.blocks(0).tolist() == [1, 3]
    assert tr.block_size == 512
    assert tr.key[0] == tr.key[1] != tr.key[2]
    assert tr.key_names[tr.key[0]] == "fb1:1"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 1: not JSON"),
        (json.dumps({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}), "'input_length'"),
        (json.dumps({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}), "'timestamp'"),
        (json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}), "expected 2"),
        (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}), "'hash_ids'"),
    ],
)
def test_bad_lines_are_reported_with_line_and_field(line: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        parse_mooncake_lines([line])


def test_unknown_key_spec_is_rejected() -> None:
    with pytest.raises(ValueError, match="first-blocks:K"):
        parse_mooncake_lines([_line(0, 5, 1, [1])], key="first-blocks:0")


def test_thread_proxy_links_turns_through_their_new_blocks() -> None:
    lines = [
        _line(0, 1024, 10, [1, 2]),  # introduces full blocks 1, 2: marker 2
        _line(10, 1500, 10, [1, 2, 3]),  # contains 2: continues request 0; marker 3 is partial, none
        _line(20, 2048, 10, [1, 2, 4, 5]),  # contains 2 only: continues request 0 (a branch)
        _line(30, 700, 10, [8, 9]),  # unrelated
    ]
    tr = parse_mooncake_lines(lines, key="thread")
    assert infer_threads(tr).tolist() == [0, 0, 0, 3]
    assert tr.key[0] == tr.key[1] == tr.key[2] != tr.key[3]
    assert with_keys(tr, "none").key.tolist() == [NO_KEY] * 4


@pytest.mark.skipif(not (TRACES / "mooncake_conversation_trace.jsonl").is_file(), reason="shared traces absent")
@pytest.mark.parametrize(
    ("name", "threads", "in_thread", "continuation", "top_thread", "fb4_keys", "top_fb4", "reuse"),
    [
        # traces/README.md statistics (thread counts within one of the README's).
        ("mooncake_conversation_trace.jsonl", 8068, 0.497, 0.329, 0.172, 8228, 0.175, 0.374),
        ("mooncake_synthetic_trace.jsonl", 2652, 0.403, 0.336, 0.250, 2226, 0.232, 0.651),
        ("mooncake_arxiv_trace_first1000.jsonl", 923, 0.142, 0.077, 0.086, 416, 0.554, 0.391),
    ],
)
def test_shared_traces_match_their_published_statistics(  # noqa: PLR0917 (parametrized columns)
    name: str, threads: int, in_thread: float, continuation: float, top_thread: float, fb4_keys: int,
    top_fb4: float, reuse: float,
) -> None:
    tr = read_mooncake(TRACES / name, key="thread")
    st = trace_stats(tr, infer_threads(tr))
    assert abs(st.threads - threads) <= 1
    assert st.multi_turn_request_share == pytest.approx(in_thread, abs=0.001)
    assert st.continuation_share == pytest.approx(continuation, abs=0.001)
    assert st.top_keys_request_share == pytest.approx(top_thread, abs=0.001)
    assert st.ideal_token_reuse == pytest.approx(reuse, abs=0.001)
    fb4 = trace_stats(with_keys(tr, "first-blocks:4"), infer_threads(tr))
    assert fb4.distinct_keys == fb4_keys
    assert fb4.top_keys_request_share == pytest.approx(top_fb4, abs=0.001)
