"""Requests no destination could hold (a server refuses them) are left out of the guard's replay
and counted, instead of keeping the whole window from being judged."""

from __future__ import annotations

import numpy as np
import pytest

from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic
from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.planner.replay.guard import GuardSettings, guard, guard_from_stats
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE
from cacheroute.planner.replay.run import check_fits, destination_ids
from cacheroute.planner.replay.window import fitting_window, window_from_stats
from tests.unit.replay.conftest import build_trace, flat_profile

CAPACITY = DEFAULT_PROFILE.kv_capacity_tokens


def _stats(giant_prompt: float, giant_rate: float = 0.2, keys: int = 30) -> KeyStats:
    """`keys` ordinary keys and, last, one whose prompts are `giant_prompt` tokens long."""
    names = (*(f"tenant-{i}" for i in range(keys)), "giant")
    ones = np.ones(keys + 1)
    rate = np.full(keys + 1, 0.2)
    rate[-1] = giant_rate
    prompt = 4500 * ones
    prompt[-1] = giant_prompt
    return KeyStats(names=names, rate=rate, prompt_tokens=prompt, prefix_tokens=2000 * ones,
                    output_tokens=50 * ones, unkeyed=UnkeyedTraffic(rate=0.5, prompt_tokens=800, output_tokens=50))


def _plan(stats: KeyStats, n: int = 4):
    ds = [Destination(id=d) for d in destination_ids(n)]
    return plan_from_routes("pool", ds, {affinity_key_hash(k): [ds[i % n].id] for i, k in enumerate(stats.names)})


def test_a_synthesised_window_leaves_out_exactly_the_requests_too_long_to_hold() -> None:
    stats = _stats(giant_prompt=4 * CAPACITY)
    whole = window_from_stats(stats, duration_s=600.0, seed=3)
    kept = fitting_window(stats, duration_s=600.0, kv_capacity_tokens=CAPACITY, seed=3)
    giant = whole.key == stats.names.index("giant")
    assert kept.left_out == int(giant.sum()) > 50
    # The others are the same draw: same arrivals, sizes and keys, in order, and all fit.
    assert np.array_equal(kept.trace.arrival_s, whole.arrival_s[~giant])
    assert np.array_equal(kept.trace.input_tokens, whole.input_tokens[~giant])
    assert np.array_equal(kept.trace.key, whole.key[~giant])
    check_fits(kept.trace, CAPACITY)
    # A key's requests still share its prefix blocks.
    first = np.flatnonzero(kept.trace.key == 0)[:2]
    shared = 2000 // kept.trace.block_size
    assert np.array_equal(kept.trace.blocks(int(first[0]))[:shared], kept.trace.blocks(int(first[1]))[:shared])
    # Without a capacity nothing is left out.
    assert fitting_window(stats, duration_s=600.0, seed=3).left_out == 0


def test_the_guard_judges_the_rest_of_a_window_holding_requests_too_long_to_hold() -> None:
    stats = _stats(giant_prompt=4 * CAPACITY)
    settings = GuardSettings(min_measured_requests=200, close_margin=0.0, close_kv_hit=0.0)
    # Before, the whole window went unjudged ("need more KV than one destination holds").
    with pytest.raises(ValueError, match="more KV than one destination holds"):
        check_fits(window_from_stats(stats, duration_s=600.0), CAPACITY)
    verdict = guard_from_stats(stats, _plan(stats), duration_s=600.0, settings=settings)
    drawn = fitting_window(stats, duration_s=600.0, kv_capacity_tokens=CAPACITY)
    assert verdict.left_out == drawn.left_out > 0
    assert verdict.candidate.requests == len(drawn.trace)
    assert f"left out {drawn.left_out:,} request(s) longer than one destination's KV cache holds" in verdict.reason
    assert verdict.to_dict()["left_out"] == drawn.left_out
    # Nothing is said when every request fits.
    fine = guard_from_stats(_stats(giant_prompt=4500), _plan(stats), duration_s=600.0, settings=settings)
    assert fine.left_out == 0 and "left out" not in fine.reason


def test_a_close_verdict_taken_on_three_windows_still_counts_what_was_left_out() -> None:
    stats = _stats(giant_prompt=4 * CAPACITY)
    always_close = GuardSettings(min_measured_requests=200, close_margin=10.0)
    verdict = guard_from_stats(stats, _plan(stats), duration_s=600.0, settings=always_close)
    assert "median of 3 replays" in verdict.reason
    assert verdict.left_out > 0 and "left out" in verdict.reason


def test_a_window_of_nothing_but_requests_too_long_to_hold_is_not_judged() -> None:
    stats = _stats(giant_prompt=4 * CAPACITY, keys=0)
    stats = KeyStats(names=stats.names, rate=stats.rate, prompt_tokens=stats.prompt_tokens,
                     prefix_tokens=stats.prefix_tokens, output_tokens=stats.output_tokens,
                     unkeyed=UnkeyedTraffic(rate=0.0, prompt_tokens=0, output_tokens=0))
    with pytest.raises(ValueError, match=r"every one of the window's .* request\(s\) needs more KV"):
        guard_from_stats(stats, _plan(stats), duration_s=600.0)


def test_a_recorded_window_with_one_request_too_long_is_judged_as_the_window_without_it() -> None:
    ok = [(0.1 * i, f"k{i % 3}", 8, 2, [i % 3, 100 + i]) for i in range(40)]
    giant = (2.05, "k1", 4000, 2, list(range(1000, 2000)))
    window = build_trace([*ok[:21], giant, *ok[21:]])
    profile = flat_profile(kv_capacity_tokens=1000)
    ds = [Destination(id=d) for d in destination_ids(2)]
    plan = plan_from_routes("pool", ds, {affinity_key_hash(f"k{i}"): [ds[i % 2].id] for i in range(3)})
    settings = GuardSettings(slo_p99_ttft_s=2.0)
    with_giant = guard(window, plan, None, profile=profile, settings=settings)
    without = guard(build_trace(ok), plan, None, profile=profile, settings=settings)
    assert with_giant.left_out == 1 and without.left_out == 0
    assert with_giant.candidate == without.candidate and with_giant.baseline == without.baseline
    with pytest.raises(ValueError, match="every one of the guard window's 1 request"):
        guard(build_trace([giant]), plan, None, profile=profile, settings=settings)
