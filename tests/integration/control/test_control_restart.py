"""The operator killed mid-period and restarted: its next plan starts from the plan in the
ConfigMap, so the workload's drift moves at most `stability.maxChurn` of the planned load."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
import pytest
from kubernetes import client

from cacheroute.planner.plan import KeyExtraction, Plan
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.settings import Budget, Stability
from tests.support.control import (
    GUARD_THROUGH_TIES,
    ControlEnv,
    KeyLoad,
    Traffic,
    condition,
    create_plan,
    expected_stats,
    get_plan,
    key_label,
    plan_manifest,
    published_plan,
    wait_for_period_after,
    wait_for_window,
    zipf_traffic,
)
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

WINDOW = 10
MAX_CHURN = 0.1


def moved_share(before: Plan, after: Plan) -> float:
    """Share of `before`'s keys that `after` routes elsewhere."""
    a, b = before.routes(), after.routes()
    return sum(1 for k, dests in a.items() if b.get(k) != dests) / len(a)


def test_restarted_operator_replans_from_the_published_plan(env: ControlEnv) -> None:
    kube_api, namespace, prom = env.api, env.namespace, env.prometheus_url
    before = zipf_traffic(40, 5.0, prompt=2000, prefix_share=0.9, exponent=1.0)
    fleet = env.fleet("llama")
    fleet.set_traffic(before)
    first = env.operator(prometheus_url=prom)
    dests = env.pool("llama")
    wait_for_window(prom, namespace, len(before.keys) + 2, WINDOW)
    create_plan(kube_api, namespace, plan_manifest(
        "llama", "llama", controlPeriod="4s", metricsWindow=f"{WINDOW}s", stability={"maxChurn": MAX_CHURN},
        guard=GUARD_THROUGH_TIES,
    ))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "PlanApplied",
             timeout=90, what="a first plan applied")
    first.kill()  # between two periods, without a chance to clean up
    obj = get_plan(kube_api, namespace, "llama")
    p1 = published_plan(kube_api, namespace, "llama")
    assert p1 is not None and obj["status"]["planVersion"] and len(p1) == len(before.keys)

    # The workload drifts: the same keys, the heaviest now the lightest.
    rates = [k.rate for k in before.keys][::-1]
    keys = tuple(KeyLoad(k.key, r, k.prompt_tokens, k.prefix_tokens) for k, r in zip(before.keys, rates, strict=True))
    drifted = Traffic(keys, other_rate=before.other_rate, unkeyed_rate=before.unkeyed_rate)
    fleet.set_traffic(drifted)
    head, tail = key_label(before.keys[0].key), key_label(before.keys[-1].key)
    series = 'increase(cacheroute_router_key_requests_total{{namespace="{ns}",key="{key}"}}[{w}s])'
    ratio = (f"sum({series.format(ns=namespace, key=head, w=WINDOW)})"
             f" / sum({series.format(ns=namespace, key=tail, w=WINDOW)})")

    def drifted_window() -> bool:
        result = httpx.get(f"{prom}/api/v1/query", params={"query": ratio}, timeout=10).json()["data"]["result"]
        return bool(result) and float(result[0]["value"][1]) < 0.05

    wait_for(drifted_window, timeout=60, what="a window of the drifted traffic", interval=0.5)
    # One more period only, so the ConfigMap holds the plan of the first period after the restart.
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "llama", {"spec": {"controlPeriod": "1h"}}
    )
    env.operator(prometheus_url=prom)
    obj = wait_for_period_after(kube_api, namespace, "llama", obj["status"]["lastPeriodTime"], timeout=90)
    assert condition(obj, "Applied")["status"] == "True"
    p2 = published_plan(kube_api, namespace, "llama")
    assert p2 is not None

    at = int(datetime.fromisoformat(obj["status"]["lastPeriodTime"].replace("Z", "+00:00")).timestamp())
    stats = expected_stats(prom, namespace, WINDOW, at)

    def plan(previous: Plan | None) -> Any:
        return compute_plan(stats, dests, pool="llama", budget=Budget(), stability=Stability(max_churn=MAX_CHURN),
                            previous=previous, key_extraction=KeyExtraction(), spill_threshold=1.5)

    with_previous, fresh = plan(p1), plan(None)
    assert p2.routes() == with_previous.plan.routes()
    assert obj["status"]["churn"] <= MAX_CHURN + 1e-9
    assert obj["status"]["forcedChurn"] == 0
    # Without the previous plan the drift would have moved far more keys.
    assert moved_share(p1, fresh.plan) > 3 * max(moved_share(p1, p2), 0.05)

    # A destination leaves: the next period re-places its keys, as forced churn.
    env.scale("llama", 1)
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "llama", {"spec": {"controlPeriod": "2s"}}
    )
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "PlanApplied"
             and get_plan(kube_api, namespace, "llama")["status"]["planVersion"] != obj["status"]["planVersion"],
             timeout=60, what="a plan without the destination that left")
    p3 = published_plan(kube_api, namespace, "llama")
    assert p3 is not None and [d.id for d in p3.destinations] == ["llama-0"]
    assert set(p3.routes().values()) == {("llama-0",)}
    status = get_plan(kube_api, namespace, "llama")["status"]
    assert status["forcedChurn"] > 0 and status["churn"] >= status["forcedChurn"]
