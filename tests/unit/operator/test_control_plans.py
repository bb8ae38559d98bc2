"""Manual plans, routing equality, payload checks, the guard's view of the plan in effect, and
when the next period is due."""

from __future__ import annotations

import re
from typing import Any

import pytest

from cacheroute.operator.api.plan import AffinityPlanSpec
from cacheroute.operator.api.pool import RouterSpec
from cacheroute.operator.control.guard import engine_profile, plan_cost, restrict_plan, routing_of
from cacheroute.operator.control.loop import PlanLoop, encode_checked
from cacheroute.operator.control.metrics import PLAN_INFO, PlanMetrics
from cacheroute.operator.control.plans import check_payload, manual_plan, pinned_only, same_routing
from cacheroute.operator.control.settings import ControlSettings
from cacheroute.planner.plan import Destination, KeyExtraction, Plan, PlanError, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import encode_plan
from cacheroute.planner.replay.planned import CACHEROUTE_ROUTING

DESTS = [Destination(f"p-{i}", f"10.0.0.{i}:8000", 1.0, 1000) for i in range(3)]


def plan(routes: dict[int, list[str]], **kwargs: Any) -> Plan:
    return plan_from_routes("p", DESTS, routes, **kwargs)


def test_manual_plan_is_exactly_the_pinned_routes_hashed() -> None:
    spec = AffinityPlanSpec.model_validate({
        "poolRef": {"name": "p"}, "mode": "Manual",
        "pinned": [{"key": "acme", "destinations": ["p-2", "p-0"]}, {"key": "globex", "destinations": ["p-1"]}],
    })
    p = manual_plan(spec, DESTS, pool="p", generated_at="t", key_extraction=KeyExtraction(), spill_threshold=2.0)
    assert p.routes() == {affinity_key_hash("acme"): ("p-2", "p-0"), affinity_key_hash("globex"): ("p-1",)}
    assert p.spill_threshold == 2.0 and p.summary.admitted_keys == 2
    # Every route is pinned: routers hold the keys there rather than follow their earlier prompts.
    assert sorted(p.pinned_keys.tolist()) == sorted([affinity_key_hash("acme"), affinity_key_hash("globex")])
    payload = encode_plan(p)
    assert all(b"acme" not in data for data in payload.files.values())


def test_same_routing_ignores_summaries_and_destination_order() -> None:
    a = plan({1: ["p-0"], 2: ["p-1", "p-2"]}, generated_at="a")
    b = plan_from_routes("p", DESTS[::-1], {1: ["p-0"], 2: ["p-1", "p-2"]}, generated_at="b")
    assert same_routing(a, b)
    assert not same_routing(a, plan({1: ["p-0"], 2: ["p-2", "p-1"]}))
    assert not same_routing(a, plan({1: ["p-0"], 2: ["p-1", "p-2"]}, spill_threshold=3.0))
    moved = [Destination("p-0", "10.9.9.9:8000"), *DESTS[1:]]
    assert not same_routing(a, plan_from_routes("p", moved, {1: ["p-0"], 2: ["p-1", "p-2"]}))
    assert same_routing(a, plan_from_routes("p", moved, {1: ["p-0"], 2: ["p-1", "p-2"]}), addresses=False)
    assert same_routing(None, None) and not same_routing(a, None)
    # The same routes, pinned: routers treat them otherwise, so the plan must be published again.
    assert not same_routing(a, plan({1: ["p-0"], 2: ["p-1", "p-2"]}, pinned=True))


def test_a_payload_that_does_not_decode_to_its_plan_is_refused() -> None:
    a, b = plan({1: ["p-0"]}), plan({1: ["p-1"]})
    check_payload(a, encode_plan(a))
    with pytest.raises(PlanError, match="does not decode back"):
        check_payload(a, encode_plan(b))
    assert encode_checked(a).version == encode_plan(a).version


def test_the_plan_in_effect_loses_only_the_destinations_that_left() -> None:
    p = plan({1: ["p-0"], 2: ["p-1", "p-2"], 3: ["p-2"]})
    kept = restrict_plan(p, ("p-0", "p-1"))
    assert kept.routes() == {1: ("p-0",), 2: ("p-1",)}
    assert restrict_plan(p, ("p-0", "p-1", "p-2")) is p
    assert len(restrict_plan(p, ())) == 0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def body(last: str | None, generation: int = 1, observed: int | None = 1, period: str = "30s") -> dict[str, Any]:
    status: dict[str, Any] = {"observedGeneration": observed} if observed is not None else {}
    if last:
        status["lastPeriodTime"] = last
    return {"metadata": {"generation": generation}, "spec": {"controlPeriod": period}, "status": status}


def loop(clock: Clock) -> PlanLoop:
    return PlanLoop(object(), ControlSettings(), namespace="n", name="x", events=lambda *a: None,  # type: ignore[arg-type]
                    clock=clock)


def test_a_period_is_due_one_control_period_after_the_last_one_recorded() -> None:
    t = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    clock = Clock(t + 10)
    lp = loop(clock)
    assert lp.seconds_until_due(body(None)) == 0
    # A restarted operator keeps the rhythm the status records.
    assert lp.seconds_until_due(body("2026-01-01T00:00:00Z")) == pytest.approx(20)
    clock.now = t + 31
    assert lp.seconds_until_due(body("2026-01-01T00:00:00Z")) == 0
    # A new generation of the spec is planned at once (one second after the last period at most).
    assert lp.seconds_until_due(body("2026-01-01T00:00:00Z", generation=2, period="1h")) == 0


def test_a_plan_waiting_for_its_pool_or_for_traffic_is_retried_soon() -> None:
    t = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    lp = loop(Clock(t + 20))
    for reason in ("PoolNotReady", "PoolNotFound", "NoTraffic"):
        waiting = body("2026-01-01T00:00:00Z", period="5m")
        waiting["status"]["conditions"] = [{"type": "Planned", "status": "False", "reason": reason}]
        # Retried 15 s after the last period, not 5 minutes later.
        assert lp.seconds_until_due(waiting) == 0, reason
    planned = body("2026-01-01T00:00:00Z", period="5m")
    planned["status"]["conditions"] = [{"type": "Planned", "status": "True", "reason": "PlanComputed"}]
    assert lp.seconds_until_due(planned) == pytest.approx(280)


def test_a_plan_that_could_not_read_prometheus_is_retried_within_a_minute() -> None:
    t = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    lp = loop(Clock(t + 20))
    for reason, due in (("PrometheusUnreachable", 40), ("PrometheusTimeout", 40), ("PrometheusError", 40),
                        ("PrometheusNotConfigured", 3580)):
        failed = body("2026-01-01T00:00:00Z", period="1h")
        failed["status"]["conditions"] = [{"type": "MetricsAvailable", "status": "False", "reason": reason}]
        # Back a minute after the last period, not an hour: a setting to fix is not retried sooner.
        assert lp.seconds_until_due(failed) == pytest.approx(due), reason
    short = body("2026-01-01T00:00:00Z", period="30s")
    short["status"]["conditions"] = [{"type": "MetricsAvailable", "status": "False", "reason": "PrometheusTimeout"}]
    assert lp.seconds_until_due(short) == pytest.approx(10)


def test_metric_series_of_a_deleted_plan_go_away() -> None:
    m = PlanMetrics("ns-metrics", "gone")
    m.in_effect("p", "v1", 10)
    m.in_effect("p", "v2", 12)
    m.step("plan", 0.5)
    samples = {(s.labels.get("affinityplan"), s.labels.get("version")) for s in next(iter(PLAN_INFO.collect())).samples}
    assert ("gone", "v2") in samples and ("gone", "v1") not in samples
    m.forget()
    assert all(s.labels.get("affinityplan") != "gone" for s in next(iter(PLAN_INFO.collect())).samples)


def test_a_plan_needing_more_configmaps_than_routers_mount_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import cacheroute.operator.control.loop as loop_module

    monkeypatch.setattr(loop_module, "MAX_PLAN_SHARDS", 0)
    with pytest.raises(PlanError, match="routers mount at most 0"):
        encode_checked(plan({1: ["p-0"]}))


def test_a_plan_a_router_would_refuse_is_refused_before_encoding() -> None:
    twins = [Destination("p-0", "10.0.0.1:8000"), Destination("p-1", "10.0.0.1:8000")]
    with pytest.raises(PlanError, match=re.escape("address 10.0.0.1:8000 is also p-0's")):
        encode_checked(plan_from_routes("p", twins, {1: ["p-0"]}))


def test_the_guard_replays_the_pool_with_its_host_memory_tier() -> None:
    gpu_only = engine_profile(200_000)
    tiered = engine_profile(200_000, 1_468_006)
    assert (gpu_only.kv_capacity_tokens, gpu_only.host_kv_capacity_tokens) == (200_000, 0)
    assert (tiered.kv_capacity_tokens, tiered.host_kv_capacity_tokens) == (200_000, 1_468_006)
    assert tiered.host_copy_s_per_token > 0


def test_the_guard_routes_as_the_pools_routers_do() -> None:
    default = routing_of(RouterSpec())
    assert default.follow_prefixes and default.tokens_per_unit == CACHEROUTE_ROUTING.tokens_per_unit
    plain = routing_of(RouterSpec.model_validate({"followPrefixes": False, "prefixMemoryBlocks": 1000}))
    assert (plain.follow_prefixes, plain.prefix_memory_blocks) == (False, 1000)


def test_a_withdrawn_plan_keeps_its_pinned_routes_alone() -> None:
    from dataclasses import replace

    import numpy as np

    computed = plan({1: ["p-0"], 2: ["p-1", "p-2"], 3: ["p-2"]})
    with_pin = replace(computed, pinned_keys=np.array([2], dtype=np.uint64))
    kept = pinned_only(with_pin, "withdrawn")
    assert kept.routes() == {2: ("p-1", "p-2")}
    assert list(kept.pinned_keys) == [2] and kept.summary.reason == "withdrawn"
    assert kept.destinations == with_pin.destinations and len(pinned_only(computed, "none")) == 0


def test_the_operator_values_a_host_held_prefix_net_of_its_copy_back_as_the_replay_does() -> None:
    assert plan_cost(500_000, 0).host_value == 1.0
    profile = engine_profile(500_000, 4_000_000)
    cost = plan_cost(500_000, 4_000_000)
    assert cost.host_copy_s_per_token == profile.host_copy_s_per_token > 0
    assert 0.9 < cost.host_value < 1.0  # a copy back costs a few percent of the prefill it saves
