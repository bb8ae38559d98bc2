"""Per-key statistics: from a trace, and their validation."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic, affinity_key_hashes, key_stats_from_trace
from cacheroute.planner.plan import affinity_key_hash
from cacheroute.planner.trace import NO_KEY, RequestTrace

TRACES = Path(os.environ.get("CACHEROUTE_TRACES_DIR", Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"))


def make_trace(rows: list[tuple[float, int, int, int, list[int]]], names: tuple[str, ...], bs: int = 4) -> RequestTrace:
    """rows: (arrival_s, key id, input tokens, output tokens, block ids)."""
    offs = np.zeros(len(rows) + 1, dtype=np.int64)
    offs[1:] = np.cumsum([len(r[4]) for r in rows])
    return RequestTrace(
        arrival_s=np.array([r[0] for r in rows], dtype=np.float64),
        key=np.array([r[1] for r in rows], dtype=np.int64),
        input_tokens=np.array([r[2] for r in rows], dtype=np.int64),
        output_tokens=np.array([r[3] for r in rows], dtype=np.int64),
        block_offsets=offs,
        block_ids=np.array([b for r in rows for b in r[4]], dtype=np.int64),
        block_size=bs,
        key_names=names,
    )


def by_name(stats: KeyStats) -> dict[str, tuple[float, float, float, float]]:
    return {
        n: (
            float(stats.rate[i]),
            float(stats.prompt_tokens[i]),
            float(stats.prefix_tokens[i]),
            float(stats.output_tokens[i]),
        )
        for i, n in enumerate(stats.names)
    }


def test_stable_prefix_is_the_common_block_prefix_of_all_requests_of_a_key() -> None:
    trace = make_trace(
        [
            (0.0, 0, 12, 10, [1, 2, 3]),
            (1.0, 1, 8, 20, [40, 41]),
            (2.0, 0, 15, 30, [1, 2, 5, 6]),
            (3.0, 2, 3, 5, [9]),
            (4.0, NO_KEY, 100, 7, [70] * 25),
            (5.0, 0, 14, 20, [1, 2, 3, 7]),
            (6.0, 2, 6, 5, [9, 10]),
            (8.0, NO_KEY, 50, 9, [71] * 13),
        ],
        ("alice", "bob", "carol"),
    )
    s = key_stats_from_trace(trace)
    got = by_name(s)
    assert s.window_s == 8.0
    # alice: three requests share blocks 1, 2 only -> 8 tokens each.
    assert got["alice"] == pytest.approx((3 / 8, (12 + 15 + 14) / 3, 8.0, 20.0))
    # bob: seen once, nothing to reuse.
    assert got["bob"] == pytest.approx((1 / 8, 8.0, 0.0, 20.0))
    # carol: one common block of 4 tokens, capped at the 3-token prompt of her first request.
    assert got["carol"] == pytest.approx((2 / 8, 4.5, 3.5, 5.0))
    assert s.unkeyed == UnkeyedTraffic(rate=2 / 8, prompt_tokens=75.0, output_tokens=8.0)


def test_window_selects_requests_and_sets_the_rate_denominator() -> None:
    trace = make_trace(
        [(float(t), 0, 8, 1, [1, 2]) for t in range(10)] + [(10.0, 1, 8, 1, [3, 4])],
        ("a", "b"),
    )
    s = key_stats_from_trace(trace, 2.0, 6.0)
    assert s.names == ("a",)
    assert s.rate[0] == pytest.approx(4 / 4.0)
    assert s.window_s == 4.0
    with pytest.raises(PlanInputError, match="spans"):
        key_stats_from_trace(trace, 5.0, 5.0)
    with pytest.raises(PlanInputError, match="holds no request"):
        key_stats_from_trace(trace, 2.2, 2.8)
    with pytest.raises(PlanInputError, match=r"window start 20 s is after the last request .* \(10 s\)"):
        key_stats_from_trace(trace, 20.0, 30.0)


def brute_force_prefix(trace: RequestTrace) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, name in enumerate(trace.key_names):
        reqs = [i for i in range(len(trace)) if trace.key[i] == k]
        if not reqs:
            continue
        if len(reqs) == 1:
            out[name] = 0.0
            continue
        blocks = [trace.blocks(i).tolist() for i in reqs]
        lcp = 0
        while all(len(b) > lcp for b in blocks) and len({b[lcp] for b in blocks}) == 1:
            lcp += 1
        out[name] = float(np.mean([min(lcp * trace.block_size, int(trace.input_tokens[i])) for i in reqs]))
    return out


@st.composite
def random_traces(draw: st.DrawFn) -> RequestTrace:
    """Prompts drawn as paths in a small tree, so block ids are prefix-chained as in real traces."""
    n_keys = draw(st.integers(1, 5))
    n = draw(st.integers(1, 30))
    node_ids: dict[tuple[int, ...], int] = {}
    rows = []
    for i in range(n):
        key = draw(st.integers(-1, n_keys - 1))
        # Few branches per position, so prefixes are shared often and diverge at any depth.
        path = draw(st.lists(st.integers(0, 2), min_size=1, max_size=7))
        blocks = [node_ids.setdefault(tuple(path[: j + 1]), len(node_ids)) for j in range(len(path))]
        size = len(blocks) * 4 - draw(st.integers(0, 3))
        rows.append((float(i), key, size, draw(st.integers(0, 9)), blocks))
    return make_trace(rows, tuple(f"k{j}" for j in range(n_keys)))


@given(random_traces())
@settings(max_examples=150, deadline=None)
def test_stable_prefix_matches_a_brute_force_reference(trace: RequestTrace) -> None:
    if len(trace) < 2:
        return
    s = key_stats_from_trace(trace)
    expected = brute_force_prefix(trace)
    assert set(s.names) == set(expected)
    for i, name in enumerate(s.names):
        assert s.prefix_tokens[i] == pytest.approx(expected[name])
        assert s.prefix_tokens[i] <= s.prompt_tokens[i]
    keyed = int(np.count_nonzero(trace.key >= 0))
    assert float(s.rate.sum()) * s.window_s == pytest.approx(keyed)  # type: ignore[operator]


def test_real_mooncake_trace_statistics_are_consistent() -> None:
    from cacheroute.planner.mooncake import read_mooncake

    path = TRACES / "mooncake_arxiv_trace_first1000.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not available")
    trace = read_mooncake(path, key="first-blocks:4")
    s = key_stats_from_trace(trace)
    assert float(s.rate.sum()) * s.window_s == pytest.approx(len(trace))  # type: ignore[operator]
    assert bool(np.all(s.prefix_tokens <= s.prompt_tokens))
    counts = np.bincount(trace.key[trace.key >= 0])
    repeated = {trace.key_names[k] for k in np.flatnonzero(counts >= 2)}
    row = {n: i for i, n in enumerate(s.names)}
    # Requests of a first-4-blocks key share those blocks, so repeated keys have a stable prefix.
    assert all(s.prefix_tokens[row[n]] > 0 for n in repeated)
    assert all(s.prefix_tokens[row[n]] == 0 for n in s.names if n not in repeated)


def test_key_hashes_match_the_plan_hash() -> None:
    names = ["alice", "bob", "ключ", "a" * 300]
    assert affinity_key_hashes(names).tolist() == [affinity_key_hash(n) for n in names]
    one, two = np.ones(4), np.full(4, 2.0)
    stats = KeyStats(tuple(names), one, two, one, one)
    assert stats.hashes_of(np.array([2, 0])).tolist() == [affinity_key_hash(names[2]), affinity_key_hash(names[0])]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": [1.0, float("nan")]}, r"stats.rate\[1\] \(key 'b'\) is nan"),
        ({"rate": [1.0, -2.0]}, r"stats.rate\[1\] \(key 'b'\) is -2.0"),
        ({"prompt_tokens": [10.0, float("inf")]}, r"stats.prompt_tokens\[1\]"),
        ({"prefix_tokens": [11.0, 1.0]}, r"prefix_tokens\[0\] \(key 'a'\) is 11.0, more than its prompt_tokens 10.0"),
        ({"names": ("a", "a")}, "lists key 'a' more than once"),
        ({"names": ("a", "")}, r"stats.names\[1\] is ''"),
        ({"output_tokens": [1.0]}, "has 1 entries, expected 2"),
        ({"rate": ["x", 1]}, "stats.rate is not numeric"),
        ({"window_s": 0.0}, "window_s is 0.0"),
    ],
)
def test_bad_statistics_are_refused_with_the_field_named(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "names": ("a", "b"),
        "rate": [1.0, 2.0],
        "prompt_tokens": [10.0, 20.0],
        "prefix_tokens": [5.0, 0.0],
        "output_tokens": [1.0, 2.0],
    }
    with pytest.raises(PlanInputError, match=message):
        KeyStats(**{**base, **kwargs})  # type: ignore[arg-type]


def test_bad_unkeyed_traffic_is_refused() -> None:
    with pytest.raises(PlanInputError, match=r"unkeyed\.rate is -1"):
        UnkeyedTraffic(rate=-1.0)
    with pytest.raises(PlanInputError, match=r"unkeyed\.prompt_tokens is nan"):
        UnkeyedTraffic(prompt_tokens=float("nan"))


def test_known_hashes_name_the_keys_without_hashing_the_row_names() -> None:
    hashes = np.array([affinity_key_hash("alpha"), 7], dtype=np.uint64)
    stats = KeyStats(
        names=("alpha", "0000000000000007"),
        rate=np.array([1.0, 2.0]),
        prompt_tokens=np.array([100.0, 100.0]),
        prefix_tokens=np.array([50.0, 50.0]),
        output_tokens=np.array([10.0, 10.0]),
        key_hashes=hashes,
    )
    assert stats.hashes.tolist() == hashes.tolist()
    assert stats.hashes_of(np.array([1])).tolist() == [7]


@pytest.mark.parametrize(
    ("hashes", "message"),
    [
        (np.array([1], dtype=np.uint64), "shape"),
        (np.array([3, 3], dtype=np.uint64), "more than once"),
        (np.array([1, 2], dtype=np.int64), "dtype"),
    ],
)
def test_known_hashes_must_be_one_distinct_uint64_per_key(hashes: np.ndarray, message: str) -> None:
    with pytest.raises(PlanInputError, match=message):
        ones = np.ones(2)
        KeyStats(names=("a", "b"), rate=ones, prompt_tokens=ones, prefix_tokens=0 * ones, output_tokens=ones,
                 key_hashes=hashes)
