"""The cache ceilings: one LRU cache of the fleet's size, and Belady's MIN on it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.planner.replay.bound import optimal_hit, unified_lru_hit
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
