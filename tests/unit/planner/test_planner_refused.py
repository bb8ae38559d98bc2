"""Traffic a server refuses for its length is neither planned nor replayed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic
from cacheroute.planner.plan import Destination
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.refused import over_all_traffic, without_refused
from cacheroute.planner.replay.guard import GuardSettings, guard_from_stats
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE

MODEL_LENGTH = 32_768


def _stats(long_prompt: float = 1_500_000.0, unkeyed_prompt: float = 800.0) -> KeyStats:
    names = ("tenant-0", "tenant-1", "longkey", "tenant-2")
    return KeyStats(
        names=names,
        rate=np.array([2.0, 1.0, 0.05, 0.5]),
        prompt_tokens=np.array([4000.0, 6000.0, long_prompt, 3000.0]),
        prefix_tokens=np.array([3000.0, 5000.0, 0.9 * long_prompt, 2000.0]),
        output_tokens=np.full(4, 100.0),
        unkeyed=UnkeyedTraffic(rate=0.5, prompt_tokens=unkeyed_prompt, output_tokens=100.0),
        window_s=300.0,
    )


def test_keys_whose_prompts_are_longer_than_the_model_are_left_out_and_said() -> None:
    kept, refused = without_refused(_stats(), MODEL_LENGTH)
    assert kept.names == ("tenant-0", "tenant-1", "tenant-2")
    assert kept.rate.tolist() == [2.0, 1.0, 0.5]
    assert np.array_equal(kept.hashes, _stats().hashes[[0, 1, 3]])
    assert kept.unkeyed == _stats().unkeyed and kept.window_s == 300.0
    assert (refused.keys, refused.keyless, refused.rate) == (1, False, 0.05)
    assert refused.describe(MODEL_LENGTH) == (
        "left out 1 key(s) (0.05 request(s)/s) whose mean prompt is longer than the model's length "
        "(32,768 tokens; the longest mean 1,500,000): a server refuses them")


def test_keyless_traffic_longer_than_the_model_is_left_out_too() -> None:
    kept, refused = without_refused(_stats(unkeyed_prompt=50_000.0), MODEL_LENGTH)
    assert kept.unkeyed.rate == 0.0 and len(kept) == 3
    assert (refused.keys, refused.keyless) == (1, True) and refused.rate == pytest.approx(0.55)
    assert "1 key(s) and keyless traffic" in refused.describe(MODEL_LENGTH)


def test_traffic_within_the_model_is_kept_as_it_is() -> None:
    stats = _stats(long_prompt=MODEL_LENGTH)
    kept, refused = without_refused(stats, MODEL_LENGTH)
    assert kept is stats and not refused
    with pytest.raises(ValueError, match="at least one token"):
        without_refused(stats, 0)


def test_a_refused_key_gets_no_route_and_no_longer_sinks_the_guard() -> None:
    # The prompts fit one destination's KV cache (480,000 tokens), so only the model's length
    # tells that every one of them is refused.
    stats = _stats(long_prompt=300_000.0)
    ds = [Destination(id=f"d-{i}", kv_capacity_tokens=480_000) for i in range(2)]
    profile = replace(DEFAULT_PROFILE, kv_capacity_tokens=480_000)
    settings = GuardSettings(min_measured_requests=500)
    as_served = compute_plan(stats, ds, pool="pool").plan
    assert stats.hashes[2] in as_served.routes()
    # Replayed as if served, its prefills hold up everything queued behind them.
    before = guard_from_stats(stats, as_served, duration_s=300.0, profile=profile, settings=settings)
    assert not before.passed and before.left_out == 0, before.reason
    kept, _ = without_refused(stats, MODEL_LENGTH)
    plan = compute_plan(kept, ds, pool="pool").plan
    assert stats.hashes[2] not in plan.routes()
    after = guard_from_stats(kept, plan, duration_s=300.0, profile=profile, settings=settings)
    assert after.passed, after.reason
    assert after.candidate.ttft_p99_s < before.candidate.ttft_p99_s / 5


def test_a_plan_without_the_refused_traffic_tells_its_shares_of_all_requests() -> None:
    stats = _stats(unkeyed_prompt=50_000.0)
    kept, _ = without_refused(stats, MODEL_LENGTH)
    ds = [Destination(id=f"d-{i}", kv_capacity_tokens=480_000) for i in range(2)]
    plan = compute_plan(kept, ds, pool="pool").plan
    whole = over_all_traffic(plan, kept, stats)
    # The routed keys' 3.5 requests/s of 4.05 in all, not of the 3.5 the plan was computed from.
    assert plan.summary.admitted_request_share == pytest.approx(1.0)
    assert whole.summary.admitted_request_share == pytest.approx(3.5 / 4.05)
    tokens = 2 * 4000 + 6000 + 0.5 * 3000
    assert whole.summary.admitted_token_share == pytest.approx(
        plan.summary.admitted_token_share * tokens / (tokens + 0.05 * 1_500_000 + 0.5 * 50_000))
    assert whole.routes() == plan.routes() and whole.summary.admitted_keys == plan.summary.admitted_keys
