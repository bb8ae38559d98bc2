"""Conditions, status and Events after a period."""

from __future__ import annotations

from datetime import UTC, datetime

from cacheroute.operator.control import conditions as cond
from cacheroute.operator.control.conditions import Finding
from cacheroute.operator.control.period import PeriodResult, verdict_text
from cacheroute.operator.control.report import events_to_post, new_status
from cacheroute.planner.replay.guard import GuardVerdict
from cacheroute.planner.replay.metrics import ReplayMetrics

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = datetime(2026, 1, 1, 0, 5, tzinfo=UTC)


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = cond.merge([], [Finding(cond.METRICS_AVAILABLE, True, "MetricsRead", "ok")], generation=3, now=T0)
    same = cond.merge(first, [Finding(cond.METRICS_AVAILABLE, True, "MetricsRead", "still ok")], generation=4, now=T1)
    flipped = cond.merge(same, [Finding(cond.METRICS_AVAILABLE, False, "PrometheusTimeout", "slow")], generation=4,
                         now=T1)
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert same[0]["message"] == "still ok" and same[0]["observedGeneration"] == 4
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:05:00Z"
    assert (flipped[0]["status"], flipped[0]["reason"]) == ("False", "PrometheusTimeout")


def test_conditions_not_found_this_period_stay_and_ready_comes_first() -> None:
    old = cond.merge([], [Finding(cond.APPLIED, True, "PlanApplied")], generation=1, now=T0)
    merged = cond.merge(old, [Finding(cond.DEGRADED, True, "PoolNotReady"), Finding(cond.READY, True, "PlanInEffect")],
                        generation=1, now=T1)
    assert [c["type"] for c in merged] == ["Ready", "Applied", "Degraded"]
    assert merged[1]["reason"] == "PlanApplied"


def test_auto_is_ready_while_a_plan_is_in_effect_even_when_degraded() -> None:
    result = PeriodResult("kept", 1_767_225_600, [Finding(cond.DEGRADED, True, "PrometheusUnreachable", "down")])
    status = new_status({"planVersion": "abc"}, result, mode="Auto", generation=2, now=1_767_225_601)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "PlanInEffect")
    assert status["lastPeriodTime"] == "2026-01-01T00:00:00Z" and status["observedGeneration"] == 2
    none = new_status({}, result, mode="Manual", generation=2, now=1_767_225_601)
    assert next(c for c in none["conditions"] if c["type"] == "Ready")["reason"] == "NoPlan"


def test_a_plan_another_one_claimed_the_pool_from_is_not_ready_though_a_plan_is_in_effect() -> None:
    claimed = "the plan of pool llama is published by AffinityPlan first; this one is not applied"
    result = PeriodResult("kept", 1, [Finding(cond.APPLIED, False, cond.POOL_CLAIMED, claimed)])
    status = new_status({"planVersion": "abc"}, result, mode="Auto", generation=1, now=2)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "PoolClaimed", claimed)


def test_the_empty_plan_a_pool_starts_with_is_in_effect_and_says_it_routes_nothing() -> None:
    waiting = PeriodResult("kept", 1, [Finding(cond.METRICS_AVAILABLE, False, cond.NO_TRAFFIC, "none")],
                           status={"planVersion": "e0", "admittedKeys": 0}, empty_in_effect="e0")
    ready = next(c for c in new_status({}, waiting, mode="Auto", generation=1, now=2)["conditions"]
                 if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "PlanInEffect") and "routing no key" in ready["message"]
    applied = PeriodResult("applied", 1, status={"planVersion": "p1"}, empty_in_effect="e0")
    ready = next(c for c in new_status({}, applied, mode="Auto", generation=1, now=2)["conditions"]
                 if c["type"] == "Ready")
    assert ready["message"] == "plan p1 is in effect"


def test_shadow_is_ready_when_it_reported_a_candidate() -> None:
    result = PeriodResult("shadow", 1, [Finding(cond.PLANNED, True, "PlanComputed")])
    status = new_status({}, result, mode="Shadow", generation=None, now=2)
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["reason"] == "ShadowReporting"
    failed = PeriodResult("kept", 1, [Finding(cond.PLANNED, False, "PoolNotReady", "none ready")])
    status = new_status({}, failed, mode="Shadow", generation=None, now=2)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PoolNotReady")


def test_shadow_says_which_plan_still_routes() -> None:
    # Switched from Auto to Shadow: the plan Auto published stays in the ConfigMaps and routes.
    after_auto = PeriodResult("shadow", 1, [Finding(cond.PLANNED, True, "PlanComputed")])
    status = new_status({"planVersion": "a1"}, after_auto, mode="Shadow", generation=None, now=2)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["message"] == (
        "the last period reported a candidate; plan a1 stays in effect (Shadow publishes nothing)")
    fresh = PeriodResult("shadow", 1, [Finding(cond.PLANNED, True, "PlanComputed")], empty_in_effect="e0")
    status = new_status({"planVersion": "e0"}, fresh, mode="Shadow", generation=None, now=2)
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["message"] == (
        "the last period reported a candidate")


def test_events_skip_repeats_of_a_failure_and_of_a_judged_candidate() -> None:
    old = {
        "candidateVersion": "v2",
        "conditions": cond.merge([], [Finding(cond.DEGRADED, True, "PoolNotReady"),
                                      Finding(cond.METRICS_AVAILABLE, True, "MetricsRead")], generation=1, now=T0),
    }
    again = PeriodResult("kept", 1)
    again.tell("Warning", "PoolNotReady", "still none")
    assert events_to_post(old, again) == []
    rejected = PeriodResult("rejected", 1, status={"candidateVersion": "v2"})
    rejected.tell("Warning", cond.GUARD_REJECTED, "same candidate")
    assert events_to_post(old, rejected) == []
    rejected.status["candidateVersion"] = "v3"
    assert [e.reason for e in events_to_post(old, rejected)] == [cond.GUARD_REJECTED]



def test_a_failure_is_told_again_for_a_new_spec() -> None:
    old = {
        "observedGeneration": 3,
        "conditions": cond.merge([], [Finding(cond.DEGRADED, True, cond.INVALID_PINNED)], generation=3, now=T0),
    }
    again = PeriodResult("failed", 1)
    again.tell("Warning", cond.INVALID_PINNED, "pinned key 'a' names p-7")
    assert events_to_post(old, again, 3) == []
    # The spec was edited (another pin refused): told, or its Events would name the first mistake only.
    assert [e.message for e in events_to_post(old, again, 4)] == ["pinned key 'a' names p-7"]


def test_waiting_for_a_pool_or_for_traffic_is_told_once_and_is_not_degraded() -> None:
    fresh = PeriodResult("kept", 1)
    fresh.add(Finding(cond.METRICS_AVAILABLE, False, cond.NO_TRAFFIC, "no router requests"),
              Finding(cond.DEGRADED, False, cond.NO_TRAFFIC, "no router requests"))
    status = new_status({}, fresh, mode="Auto", generation=1, now=2)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("False", "NoTraffic")
    (event,) = events_to_post({}, fresh)
    assert (event.kind, event.reason) == ("Normal", "NoTraffic")
    still = PeriodResult("kept", 2)
    still.add(Finding(cond.METRICS_AVAILABLE, False, cond.NO_TRAFFIC, "no router requests"))
    assert events_to_post(status, still) == []
    starting = PeriodResult("kept", 1)
    starting.tell("Normal", cond.POOL_NOT_READY, "no ready destination")
    old = {"conditions": cond.merge([], [Finding(cond.DEGRADED, False, cond.POOL_NOT_READY)], generation=1, now=T0)}
    assert events_to_post(old, starting) == []


def test_metrics_available_turning_either_way_is_told() -> None:
    old = {"conditions": cond.merge([], [Finding(cond.METRICS_AVAILABLE, True, "MetricsRead")], generation=1, now=T0)}
    down = PeriodResult("kept", 1, [Finding(cond.METRICS_AVAILABLE, False, "PrometheusUnreachable", "refused")])
    (event,) = events_to_post(old, down)
    assert (event.kind, event.reason) == ("Warning", "PrometheusUnreachable")
    steady = PeriodResult("kept", 1, [Finding(cond.METRICS_AVAILABLE, True, "MetricsRead", "ok")])
    assert events_to_post(old, steady) == []


def test_metrics_staying_unavailable_for_another_reason_is_told() -> None:
    old = {"conditions": cond.merge(
        [], [Finding(cond.METRICS_AVAILABLE, False, "PrometheusUnreachable")], generation=1, now=T0)}
    back = PeriodResult("kept", 1, [Finding(cond.METRICS_AVAILABLE, False, cond.INCOMPLETE_WINDOW, "holds 5 s")])
    (event,) = events_to_post(old, back)
    # Prometheus answers again, but the wait for its window is no failure.
    assert (event.kind, event.reason, event.message) == ("Normal", cond.INCOMPLETE_WINDOW, "holds 5 s")
    same = PeriodResult("kept", 1, [Finding(cond.METRICS_AVAILABLE, False, "PrometheusUnreachable", "refused")])
    assert events_to_post(old, same) == []


def test_a_failure_that_is_also_metrics_turning_is_told_once() -> None:
    old = {"conditions": cond.merge([], [Finding(cond.METRICS_AVAILABLE, True, "MetricsRead")], generation=1, now=T0)}
    gone = PeriodResult("kept", 1, [Finding(cond.METRICS_AVAILABLE, False, cond.POOL_NOT_FOUND, "no pool")])
    gone.tell("Warning", cond.POOL_NOT_FOUND, "no pool")
    (event,) = events_to_post(old, gone)
    assert (event.kind, event.reason, event.message) == ("Warning", cond.POOL_NOT_FOUND, "no pool")


def _verdict(left_out: int) -> GuardVerdict:
    m = ReplayMetrics(policy="x", requests=100, measured=50, qps=1.0, kv_hit=0.62, ttft_p50_s=0.1, ttft_p99_s=1.25,
                      ttft_mean_s=0.2, e2e_p50_s=1.0, e2e_p99_s=2.0, queue_p99_s=0.5, load_cv_busy=0.1,
                      load_cv_tokens=0.1, aborted=False)
    return GuardVerdict(passed=True, reason="", candidate=m, baseline=m, current=None, better_than_current=True,
                        left_out=left_out)


def test_an_applied_plan_says_how_many_requests_too_long_to_hold_its_replay_left_out() -> None:
    told = verdict_text(_verdict(1234))
    assert told.startswith("guard passed: predicted KV hit 62.0%")
    assert told.endswith("; left out 1,234 request(s) longer than one destination's KV cache holds "
                         "(a server refuses them)")
    assert "left out" not in verdict_text(_verdict(0))
