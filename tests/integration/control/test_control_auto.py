"""Auto mode end to end: router and vLLM metrics in the sandbox Prometheus, the operator plans,
publishes the plan ConfigMap, and a router reading that ConfigMap follows it."""

from __future__ import annotations

from datetime import datetime

import httpx
import pytest
from kubernetes import client

from cacheroute.planner.plan import KeyExtraction, affinity_key_hash
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.settings import Budget, Stability
from tests.support.control import (
    GUARD_THROUGH_TIES,
    ControlEnv,
    condition,
    create_plan,
    expected_stats,
    get_plan,
    plan_files,
    plan_manifest,
    published_plan,
    wait_for_window,
    zipf_traffic,
)
from tests.support.router import PlanVolume, destination, exchange, headers_request, start_router_process
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

POOL = "llama"
WINDOW = 10


def test_auto_publishes_the_planners_plan_and_the_router_follows_it(env: ControlEnv) -> None:
    kube_api, namespace, prom = env.api, env.namespace, env.prometheus_url
    traffic = zipf_traffic(40, 5.0, prompt=2000, prefix_share=0.9, exponent=1.0)
    env.fleet(POOL, routers=2, engines=2).set_traffic(traffic)
    operator = env.operator(prometheus_url=prom)
    dests = env.pool(POOL)
    wait_for_window(prom, namespace, len(traffic.keys) + 2, WINDOW)
    # One period only (the first one runs at once), so the plan in the ConfigMap is that period's.
    create_plan(kube_api, namespace, plan_manifest("llama", POOL, controlPeriod="1h", metricsWindow=f"{WINDOW}s",
                                                   guard=GUARD_THROUGH_TIES))

    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("status") == "True",
             timeout=90, what="Applied=True")
    obj = get_plan(kube_api, namespace, "llama")
    status = obj["status"]
    published = published_plan(kube_api, namespace, POOL)
    assert published is not None
    assert status["planVersion"] == status["candidateVersion"]
    assert condition(obj, "Applied")["reason"] == "PlanApplied"
    assert condition(obj, "Ready")["status"] == "True"
    assert condition(obj, "MetricsAvailable")["status"] == "True"
    assert condition(obj, "Degraded")["status"] == "False"
    # The period is told in the operator's log too, not only in the status.
    told = [r["msg"] for r in operator.records()
            if r.get("msg", "").startswith(f"AffinityPlan {namespace}/llama: period applied in ")]
    assert told and f"PlanApplied: plan {status['planVersion']}" in told[0], told

    # The same statistics, read from Prometheus at the period's instant, give the same routes.
    at = int(datetime.fromisoformat(published.generated_at.replace("Z", "+00:00")).timestamp())
    stats = expected_stats(prom, namespace, WINDOW, at)
    assert len(stats) == len(traffic.keys)
    expected = compute_plan(
        stats, dests, pool=POOL, budget=Budget(), stability=Stability(), generated_at=published.generated_at,
        key_extraction=KeyExtraction(), spill_threshold=1.5,
    ).plan
    assert len(expected) > 0
    assert published.routes() == expected.routes()
    assert [(d.id, d.address, d.kv_capacity_tokens) for d in published.destinations] == [
        (d.id, d.address, d.kv_capacity_tokens) for d in dests
    ]
    assert dests[0].kv_capacity_tokens > 0  # the pool's memory plan

    # Status figures of that plan.
    assert status["admittedKeys"] == len(published)
    assert 0 < status["coveredRequestShare"] <= 1
    assert status["churn"] == 0
    assert 0 <= status["predictedKvHit"] <= 1 and status["predictedP99TtftSeconds"] > 0
    assert status["observedKvHit"] == pytest.approx(traffic.kv_hit, abs=0.05)
    assert status["lastPeriodTime"] == published.generated_at

    # Keys never appear in clear in the ConfigMaps.
    blob = b"".join(plan_files(kube_api, namespace, POOL).values())
    assert traffic.keys[0].key.encode() not in blob

    # A router mounted on that ConfigMap routes a planned key to its planned destination.
    volume = PlanVolume(env.tmp_path / "plan")
    volume.publish_files(plan_files(kube_api, namespace, POOL))
    # The destinations are pods kwok plays (nothing listens): no scraping, take them as ready.
    router = start_router_process(
        ["--plan-dir", str(volume.path), "--scrape-interval", "0"], log=env.tmp_path / "router.log"
    )
    try:
        planned = [k.key for k in traffic.keys if published.destinations_of(affinity_key_hash(k.key))]
        assert planned
        for key in planned[:3]:
            ids = set(published.destinations_of(affinity_key_hash(key)))
            addresses = {d.address for d in published.destinations if d.id in ids}
            header, _ = destination(exchange(router, headers_request(key)))
            assert header in addresses
    finally:
        router.stop()

    # The operator's own /metrics tells the same.
    text = httpx.get(f"http://127.0.0.1:{operator.health_port}/metrics", timeout=10).text
    labels = f'affinityplan="llama",namespace="{namespace}"'
    assert f'cacheroute_operator_plan_info{{{labels},pool="{POOL}",version="{status["planVersion"]}"}} 1.0' in text
    assert f"cacheroute_operator_plan_routes{{{labels}}} {float(len(published))}" in text
    assert f'cacheroute_operator_plan_guard_verdicts_total{{{labels},verdict="passed"}} 1.0' in text
    assert f'cacheroute_operator_plan_step_seconds_count{{{labels},step="guard"}} 1.0' in text
    assert f"cacheroute_operator_plan_last_success_timestamp_seconds{{{labels}}}" in text

    # Deleting the AffinityPlan stops its loop: kopf removes its finalizer and the object goes.
    client.CustomObjectsApi(kube_api).delete_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "llama"
    )

    def gone() -> bool:
        try:
            get_plan(kube_api, namespace, "llama")
        except client.ApiException as exc:
            return bool(exc.status == 404)
        return False

    wait_for(gone, timeout=60, what="the AffinityPlan to be deleted")
