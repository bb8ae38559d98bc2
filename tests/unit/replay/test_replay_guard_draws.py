"""The guard on synthesised windows: a thin window is lengthened, a close verdict is taken again
on the median of more windows, a clear one is not."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic
from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.planner.replay.guard import (
    GuardSettings,
    ReplayGuard,
    close_to_a_limit,
    guard_from_stats,
    judge,
    median_metrics,
    replay_duration,
    shortfalls,
)
from cacheroute.planner.replay.metrics import ReplayMetrics
from cacheroute.planner.replay.run import destination_ids
from tests.unit.replay.conftest import TraceBuilder


def _stats(rate_per_key: float, keys: int = 40) -> KeyStats:
    names = tuple(f"tenant-{i}" for i in range(keys))
    ones = np.ones(keys)
    return KeyStats(names=names, rate=rate_per_key * ones, prompt_tokens=4500 * ones,
                    prefix_tokens=2000 * ones, output_tokens=50 * ones,
                    unkeyed=UnkeyedTraffic(rate=0.0, prompt_tokens=0, output_tokens=0))


def _spread_plan(stats: KeyStats, n: int = 4):
    ds = [Destination(id=d) for d in destination_ids(n)]
    routes = {affinity_key_hash(k): [ds[i % n].id] for i, k in enumerate(stats.names)}
    return plan_from_routes("pool", ds, routes)


def _metrics(kv_hit: float, p99: float) -> ReplayMetrics:
    return ReplayMetrics(policy="x", requests=100, measured=50, qps=1.0, kv_hit=kv_hit, ttft_p50_s=0.1,
                         ttft_p99_s=p99, ttft_mean_s=0.2, e2e_p50_s=1.0, e2e_p99_s=2.0, queue_p99_s=0.5,
                         load_cv_busy=0.1, load_cv_tokens=0.1, aborted=False)


def test_a_thin_window_is_lengthened_until_its_measured_half_holds_enough_requests() -> None:
    s = GuardSettings(min_measured_requests=2000, max_duration_s=1800.0, warmup_fraction=0.5)
    # 40 keys at 0.1/s: 4 requests a second, 1,000 s for 2,000 measured ones.
    assert replay_duration(_stats(0.1), 120.0, s) == pytest.approx(1000.0)
    # Busy traffic keeps the asked duration; a trickle stops at the cap.
    assert replay_duration(_stats(10.0), 120.0, s) == 120.0
    assert replay_duration(_stats(0.001), 120.0, s) == 1800.0
    # A longer asked duration is never shortened.
    assert replay_duration(_stats(0.1), 3000.0, s) == 3000.0


def test_a_replay_guard_reaches_back_for_enough_requests_when_recent_traffic_is_thin(
    make_trace: TraceBuilder,
) -> None:
    s = GuardSettings(window_s=120.0, min_measured_requests=300, max_duration_s=1800.0, warmup_fraction=0.5)
    # One request a second for an hour, then ten a second for the last two minutes.
    arrivals = [*np.arange(0.0, 3600.0, 1.0), *np.arange(3600.0, 3720.0, 0.1)]
    trace = make_trace([(float(t), "k", 10, 1, [1]) for t in arrivals])
    guard = ReplayGuard(s)
    # At one a second, 600 requests (300 measured) take ten minutes: the window reaches back that far.
    thin = guard.recent_window(trace, 3000.0)
    assert len(thin) == 600 and float(thin.arrival_s[0]) == 2400.0
    # Ten a second fill two minutes with 1,200: no further back than `window_s`.
    busy = guard.recent_window(trace, 3720.0)
    assert len(busy) == 1200 and float(busy.arrival_s[0]) == pytest.approx(3600.0)
    # A trickle stops at the cap; the start of the trace bounds any window.
    trickle = ReplayGuard(replace(s, min_measured_requests=10_000)).recent_window(trace, 3000.0)
    assert float(trickle.arrival_s[0]) == 1200.0
    assert float(guard.recent_window(trace, 100.0).arrival_s[0]) == 0.0


def test_the_replayed_window_is_as_long_as_the_rule_says() -> None:
    stats = _stats(0.1)
    v = guard_from_stats(stats, _spread_plan(stats), duration_s=60.0,
                         settings=GuardSettings(min_measured_requests=400, close_replays=1))
    # 4 requests a second over 200 s: about 800, half of them measured.
    assert v.candidate.requests == pytest.approx(800, rel=0.15)
    assert v.candidate.measured == pytest.approx(400, rel=0.15)


def test_figures_near_a_limit_are_close_and_clear_ones_are_not() -> None:
    s = GuardSettings(slo_p99_ttft_s=3.5, tolerance=0.05, tolerance_s=0.05, close_margin=0.15, close_kv_hit=0.01)
    base = _metrics(0.70, 2.0)  # p99 limit 2.15 s
    assert close_to_a_limit(judge(_metrics(0.80, 2.2), base, None, s), s)  # 2 % over the limit
    assert close_to_a_limit(judge(_metrics(0.80, 2.0), base, None, s), s)  # 7 % under it
    assert close_to_a_limit(judge(_metrics(0.705, 1.0), base, None, s), s)  # KV hit half a point above
    assert not close_to_a_limit(judge(_metrics(0.80, 1.2), base, None, s), s)
    assert not close_to_a_limit(judge(_metrics(0.60, 9.0), base, None, s), s)
    # The plan in effect near the SLO is close too.
    assert close_to_a_limit(judge(_metrics(0.80, 1.2), base, _metrics(0.80, 3.4), s), s)


def test_the_median_of_replays_is_taken_figure_by_figure() -> None:
    m = median_metrics([_metrics(0.7, 3.0), _metrics(0.9, 1.0), _metrics(0.8, 2.0)])
    assert m.kv_hit == pytest.approx(0.8)
    assert m.ttft_p99_s == pytest.approx(2.0)
    assert not m.aborted
    assert median_metrics([_metrics(0.7, 3.0), replace(_metrics(0.7, 3.0), aborted=True)]).aborted


def test_a_close_verdict_is_taken_on_the_median_of_three_windows_and_a_clear_one_on_one() -> None:
    stats = _stats(0.1)
    plan = _spread_plan(stats)
    always_close = GuardSettings(min_measured_requests=200, close_margin=10.0)
    never_close = GuardSettings(min_measured_requests=200, close_margin=0.0, close_kv_hit=0.0)
    redone = guard_from_stats(stats, plan, duration_s=60.0, settings=always_close)
    once = guard_from_stats(stats, plan, duration_s=60.0, settings=never_close)
    assert "median of 3 replays" in redone.reason
    assert "median" not in once.reason
    # The median verdict is judged on other windows' figures too: not the first window's alone.
    draws = [guard_from_stats(stats, plan, duration_s=60.0, settings=never_close, seed=k) for k in range(3)]
    assert redone.candidate.ttft_p99_s == pytest.approx(float(np.median([d.candidate.ttft_p99_s for d in draws])))
    assert redone.baseline.kv_hit == pytest.approx(float(np.median([d.baseline.kv_hit for d in draws])))


def test_guard_settings_refuse_meaningless_draw_rules() -> None:
    with pytest.raises(ValueError, match="close_replays"):
        GuardSettings(close_replays=0)
    with pytest.raises(ValueError, match="max_duration_s"):
        GuardSettings(max_duration_s=0.0)


def test_a_window_measuring_many_requests_is_judged_once_even_when_close() -> None:
    stats = _stats(0.1)
    plan = _spread_plan(stats)
    big = GuardSettings(min_measured_requests=200, close_margin=10.0, close_max_measured=100)
    assert "median" not in guard_from_stats(stats, plan, duration_s=60.0, settings=big).reason


def test_a_loss_by_hundredths_of_a_point_is_not_told_as_a_tie() -> None:
    settings = GuardSettings()
    (reason,) = shortfalls(_metrics(0.9108, 1.0), _metrics(0.9112, 1.0), settings, 0.0)
    assert reason == "KV hit 91.08% is below 91.12% without a plan"
    assert shortfalls(_metrics(0.9112, 1.0), _metrics(0.9112, 1.0), settings, 0.0) == []  # a tie passes
    (reason,) = shortfalls(_metrics(0.9150, 1.0), _metrics(0.9112, 1.0), settings, 0.005)
    assert reason == "KV hit 91.50% does not beat 91.12% without a plan by 0.5%"
