"""The cache ceilings: one LRU cache of the fleet's size, and Belady's MIN on it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.planner.replay.bound import (
    key_sticky_routes,
    optimal_hit,
    oracle_admission_routes,
    routed_lru_hit,
    unified_lru_hit,
)
from cacheroute.planner.trace import NO_KEY, RequestTrace

BS = 4


def trace(prompts: Sequence[Sequence[int]], tokens: Sequence[int] | None = None) -> RequestTrace:
    n = len(prompts)
    sizes = list(tokens) if tokens is not None else [len(p) * BS for p in prompts]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(p) for p in prompts], out=offsets[1:])
    return RequestTrace(
        arrival_s=np.arange(n, dtype=np.float64),
        key=np.full(n, NO_KEY, dtype=np.int64),
        input_tokens=np.array(sizes, dtype=np.int64),
        output_tokens=np.ones(n, dtype=np.int64),
        block_offsets=offsets,
        block_ids=np.array([b for p in prompts for b in p], dtype=np.int64),
        block_size=BS,
        key_names=(),
    )


def test_a_repeated_prompt_hits_when_it_fits() -> None:
    t = trace([[1, 2], [1, 2]])
    assert unified_lru_hit(t, 2 * BS, warmup_fraction=0.0) == pytest.approx(0.5)
    assert unified_lru_hit(t, 1 * BS, warmup_fraction=0.0) == 0.0
    assert optimal_hit(t, 2 * BS, warmup_fraction=0.0) == pytest.approx(0.5)


def test_lru_counts_only_the_leading_run_and_min_counts_every_cached_block() -> None:
    t = trace([[1, 2], [3, 2]])
    assert unified_lru_hit(t, 8 * BS, warmup_fraction=0.0) == 0.0
    assert optimal_hit(t, 8 * BS, warmup_fraction=0.0) == pytest.approx(0.25)


def test_min_keeps_the_block_needed_next_where_lru_loses_it() -> None:
    # A cycle of three prompts through a cache of two: LRU always evicts what comes next.
    t = trace([[1], [2], [3]] * 4)
    assert unified_lru_hit(t, 2 * BS, warmup_fraction=0.0) == 0.0
    assert optimal_hit(t, 2 * BS, warmup_fraction=0.0) > 0.4


def test_warm_up_requests_fill_the_cache_but_are_not_counted() -> None:
    t = trace([[1, 2], [1, 2], [1, 2], [1, 2]])
    assert unified_lru_hit(t, 2 * BS, warmup_fraction=0.25) == 1.0
    assert optimal_hit(t, 2 * BS, warmup_fraction=0.25) == 1.0


def test_a_partial_last_block_weighs_its_tokens() -> None:
    t = trace([[1, 2], [1, 2]], tokens=[BS + 1, BS + 1])
    assert unified_lru_hit(t, 2 * BS, warmup_fraction=0.0) == pytest.approx((BS + 1) / (2 * (BS + 1)))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        unified_lru_hit(trace([[1]]), -1)
    with pytest.raises(ValueError, match="warm-up"):
        optimal_hit(trace([[1]]), 4, warmup_fraction=1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True), min_size=1, max_size=30),
       st.integers(0, 10))
def test_min_is_never_below_lru_and_more_cache_never_hurts_min(prompts: list[list[int]], blocks: int) -> None:
    t = trace(prompts)
    lru = unified_lru_hit(t, blocks * BS, warmup_fraction=0.0)
    best = optimal_hit(t, blocks * BS, warmup_fraction=0.0)
    assert best >= lru - 1e-12
    assert optimal_hit(t, (blocks + 1) * BS, warmup_fraction=0.0) >= best - 1e-12


def keyed(prompts: Sequence[Sequence[int]], keys: Sequence[int]) -> RequestTrace:
    t = trace(prompts)
    return RequestTrace(
        arrival_s=t.arrival_s, key=np.array(keys, dtype=np.int64), input_tokens=t.input_tokens,
        output_tokens=t.output_tokens, block_offsets=t.block_offsets, block_ids=t.block_ids, block_size=BS,
        key_names=tuple(f"k{i}" for i in range(max(keys) + 1)),
    )


def test_routing_one_time_prompts_elsewhere_beats_one_shared_lru_cache() -> None:
    # A hot prompt between scans of prompts seen once: one cache of four blocks loses the hot
    # prompt to the scans; two caches of two keep it when the scans go to the other one.
    prompts = [[1, 2], [10, 11], [12, 13], [1, 2], [14, 15], [16, 17], [1, 2]]
    t = keyed(prompts, [0, 1, 2, 0, 3, 4, 0])
    assert unified_lru_hit(t, 4 * BS, warmup_fraction=0.0) == 0.0
    routed = routed_lru_hit(t, [0, 1, 1, 0, 1, 1, 0], 2, 2 * BS, warmup_fraction=0.0)
    assert routed.hit == pytest.approx(4 / 14)
    # The price: the destination taking the scans computes four times the other's tokens.
    assert routed.computed_tokens == (2 * BS, 8 * BS)
    assert routed.imbalance == pytest.approx(1.6)


def test_the_oracle_sends_a_keys_last_request_to_scratch() -> None:
    t = keyed([[1], [2], [1], [3]], [0, 1, 0, 2])
    routes = oracle_admission_routes(t, 4, scratch=1)
    assert routes[0] < 3 and routes[1] == routes[2] == routes[3] == 3
    assert key_sticky_routes(t, 4)[0] == key_sticky_routes(t, 4)[2]


def test_routed_bound_refuses_routes_that_do_not_fit() -> None:
    t = keyed([[1], [2]], [0, 1])
    with pytest.raises(ValueError, match="destinations given"):
        routed_lru_hit(t, [0], 2, BS)
    with pytest.raises(ValueError, match="must be in"):
        routed_lru_hit(t, [0, 2], 2, BS)
    with pytest.raises(ValueError, match="scratch"):
        oracle_admission_routes(t, 2, scratch=2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True), st.integers(0, 2)),
                min_size=1, max_size=30),
       st.integers(0, 8))
def test_a_larger_lru_cache_never_serves_less_under_any_routing(requests: list[tuple[list[int], int]],
                                                                 blocks: int) -> None:
    # LRU is a stack algorithm: a larger cache holds everything a smaller one holds, at all times.
    t = trace([p for p, _ in requests])
    routes = [d for _, d in requests]
    small = routed_lru_hit(t, routes, 3, blocks * BS, warmup_fraction=0.0)
    large = routed_lru_hit(t, routes, 3, (blocks + 1) * BS, warmup_fraction=0.0)
    assert large.hit >= small.hit - 1e-12
    assert sum(large.computed_tokens) <= sum(small.computed_tokens)
