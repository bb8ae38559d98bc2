"""Shadow plans and reports without touching the plan ConfigMap; Manual publishes exactly the
pinned routes, keys hashed."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from cacheroute.planner.plan import affinity_key_hash
from tests.support.control import (
    GUARD_THROUGH_TIES,
    ControlEnv,
    Traffic,
    condition,
    create_plan,
    events,
    get_plan,
    plan_exists,
    plan_files,
    plan_manifest,
    published_plan,
    wait_for_period_after,
    wait_for_window,
    zipf_traffic,
)
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

WINDOW = 10


def _serving(env: ControlEnv, pool: str, traffic: Traffic) -> None:
    """The pool's routers reporting `traffic`, and an operator reconciling the pool."""
    env.fleet(pool).set_traffic(traffic)
    env.operator(prometheus_url=env.prometheus_url)
    env.pool(pool)


def _shadow_plan_once_the_window_is_full(env: ControlEnv, pool: str, traffic: Traffic) -> None:
    wait_for_window(env.prometheus_url, env.namespace, len(traffic.keys) + 2, WINDOW)
    create_plan(env.api, env.namespace, plan_manifest(pool, pool, mode="Shadow", controlPeriod="2s",
                                                      metricsWindow=f"{WINDOW}s", guard=GUARD_THROUGH_TIES))


def test_shadow_fills_status_and_never_writes_the_configmap(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    traffic = zipf_traffic(30, 5.0, prompt=2000, prefix_share=0.9, exponent=1.0)
    _serving(env, "qwen", traffic)
    # The pool's reconciler creates the plan ConfigMap with an empty plan.
    core = client.CoreV1Api(kube_api)
    wait_for(lambda: bool(core.read_namespaced_config_map("qwen-plan", namespace)), timeout=60,
             what="the pool's empty plan")
    before = core.read_namespaced_config_map("qwen-plan", namespace).metadata.resource_version
    _shadow_plan_once_the_window_is_full(env, "qwen", traffic)

    wait_for(lambda: condition(get_plan(kube_api, namespace, "qwen"), "Applied").get("reason") == "ShadowMode",
             timeout=90, what="a Shadow period")
    first = get_plan(kube_api, namespace, "qwen")
    # Two more periods: still reporting, still nothing written.
    later = wait_for_period_after(kube_api, namespace, "qwen", first["status"]["lastPeriodTime"])
    later = wait_for_period_after(kube_api, namespace, "qwen", later["status"]["lastPeriodTime"])
    status = later["status"]
    assert core.read_namespaced_config_map("qwen-plan", namespace).metadata.resource_version == before
    names = [cm.metadata.name for cm in core.list_namespaced_config_map(namespace).items]
    assert [n for n in names if n.startswith("qwen-plan")] == ["qwen-plan"]
    empty = published_plan(kube_api, namespace, "qwen")
    assert empty is not None and len(empty) == 0
    assert status["planVersion"] != status["candidateVersion"]
    assert len(status["candidateVersion"]) == 16
    assert status["admittedKeys"] > 0
    assert 0 < status["coveredRequestShare"] <= 1
    assert 0 <= status["predictedKvHit"] <= 1 and status["predictedP99TtftSeconds"] > 0
    assert status["observedKvHit"] == pytest.approx(traffic.kv_hit, abs=0.05)
    assert status["observedKvHit"] == round(status["observedKvHit"], 4)  # as `kubectl get` prints it
    applied = condition(later, "Applied")
    assert applied["status"] == "False" and "would apply" in applied["message"]
    assert condition(later, "Ready")["reason"] == "ShadowReporting"
    assert condition(later, "Planned")["status"] == "True"
    assert events(kube_api, namespace, "ShadowPlanned")


def test_manual_publishes_exactly_the_pinned_routes(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    env.operator(prometheus_url=env.prometheus_url)
    env.pool("llama")
    pins = {"tenant-a/system-prompt": ("llama-1",), "tenant-b": ("llama-0", "llama-1")}
    pinned = [{"key": k, "destinations": list(v)} for k, v in pins.items()]
    create_plan(kube_api, namespace, plan_manifest("pins", "llama", mode="Manual", controlPeriod="2s", pinned=pinned))

    wait_for(lambda: condition(get_plan(kube_api, namespace, "pins"), "Applied").get("status") == "True",
             timeout=90, what="Applied=True")
    obj = get_plan(kube_api, namespace, "pins")
    plan = published_plan(kube_api, namespace, "llama")
    assert plan is not None
    assert plan.routes() == {affinity_key_hash(k): v for k, v in pins.items()}
    # Pinned in the header: routers hold the keys to these routes, not to where their prompts went.
    assert set(plan.pinned_keys.tolist()) == {affinity_key_hash(k) for k in pins}
    assert obj["status"]["planVersion"] == obj["status"]["candidateVersion"]
    assert obj["status"]["admittedKeys"] == 2
    assert condition(obj, "Planned")["reason"] == "PinnedRoutes"
    blob = b"".join(plan_files(kube_api, namespace, "llama").values())
    assert b"tenant-a" not in blob and b"tenant-b" not in blob

    # A second AffinityPlan on the same pool does not take it over.
    create_plan(kube_api, namespace, plan_manifest("intruder", "llama", mode="Manual", controlPeriod="1h",
                                                    pinned=[{"key": "tenant-z", "destinations": ["llama-0"]}]))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "intruder"), "Applied").get("reason") == "PoolClaimed",
             timeout=60, what="Applied=False PoolClaimed")
    intruder = get_plan(kube_api, namespace, "intruder")
    assert intruder["status"].get("planVersion") == obj["status"]["planVersion"]
    assert (condition(intruder, "Ready")["status"], condition(intruder, "Ready")["reason"]) == ("False", "PoolClaimed")
    assert condition(intruder, "Degraded")["status"] == "True"

    # A pinned route naming a destination the pool does not have is refused; the plan stays.
    version = obj["status"]["planVersion"]
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "pins",
        {"spec": {"pinned": [{"key": "tenant-c", "destinations": ["llama-7"]}]}},
    )
    wait_for(lambda: condition(get_plan(kube_api, namespace, "pins"), "Planned").get("reason") == "InvalidPinned",
             timeout=60, what="Planned=False InvalidPinned")
    refused = get_plan(kube_api, namespace, "pins")
    # The period that refused the pins read this window too: MetricsAvailable is its, not an older one's.
    assert condition(refused, "MetricsAvailable")["observedGeneration"] == refused["metadata"]["generation"]
    plan = published_plan(kube_api, namespace, "llama")
    assert plan is not None and plan.routes() == {affinity_key_hash(k): v for k, v in pins.items()}
    assert get_plan(kube_api, namespace, "pins")["status"]["planVersion"] == version

    # Released (Shadow publishes nothing), the pool goes to the plan that waited for it within its
    # retry, not an hour later at the waiting plan's next period.
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "pins", {"spec": {"mode": "Shadow"}}
    )
    wait_for(lambda: condition(get_plan(kube_api, namespace, "intruder"), "Applied").get("status") == "True",
             timeout=45, what="the waiting plan applied")
    # With no traffic to plan from, the Shadow plan still says it applies nothing (not Manual's Applied).
    wait_for(lambda: condition(get_plan(kube_api, namespace, "pins"), "Applied").get("reason") == "ShadowMode",
             timeout=30, what="Applied=False ShadowMode")
    taken = {affinity_key_hash("tenant-z"): ("llama-0",)}
    plan = published_plan(kube_api, namespace, "llama")
    assert plan is not None and plan.routes() == taken

    # A plan that would publish exactly the plan in effect takes the pool over all the same: its
    # next change is published, not refused.
    core = client.CoreV1Api(kube_api)
    create_plan(kube_api, namespace, plan_manifest("twin", "llama", mode="Manual", controlPeriod="1h",
                                                    pinned=[{"key": "tenant-z", "destinations": ["llama-0"]}]))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "twin"), "Applied").get("reason") == "PoolClaimed",
             timeout=60, what="the twin refused")
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "intruder", {"spec": {"mode": "Shadow"}}
    )
    wait_for(lambda: (core.read_namespaced_config_map("llama-plan", namespace).metadata.annotations or {})
             .get("cacheroute.dev/affinity-plan") == "twin", timeout=45, what="the twin named the publisher")
    # The period writes the twin's status after naming it (its Events go first).
    wait_for(lambda: condition(get_plan(kube_api, namespace, "twin"), "Applied").get("reason") == "Unchanged",
             timeout=10, what="the twin's Applied=True Unchanged")
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "twin",
        {"spec": {"pinned": [{"key": "tenant-z", "destinations": ["llama-1"]}]}},
    )
    taken = {affinity_key_hash("tenant-z"): ("llama-1",)}

    def twin_published() -> bool:
        plan = published_plan(kube_api, namespace, "llama")
        return plan is not None and plan.routes() == taken

    wait_for(twin_published, timeout=30, what="the twin's new pin published")

    # Deleted, the plan names itself no more as the pool's publisher; its routes stay in effect.
    client.CustomObjectsApi(kube_api).delete_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "twin"
    )
    wait_for(lambda: not plan_exists(kube_api, namespace, "twin"), timeout=60, what="the AffinityPlan gone")
    head = core.read_namespaced_config_map("llama-plan", namespace)
    assert "cacheroute.dev/affinity-plan" not in (head.metadata.annotations or {})
    plan = published_plan(kube_api, namespace, "llama")
    assert plan is not None and plan.routes() == taken



def test_a_scaled_pool_is_planned_for_within_seconds_not_a_control_period_later(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    env.operator(prometheus_url=env.prometheus_url)
    env.pool("llama", replicas=3)
    pinned = [{"key": "tenant-a", "destinations": ["llama-2"]}]
    create_plan(kube_api, namespace, plan_manifest("pins", "llama", mode="Manual", controlPeriod="1h", pinned=pinned))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "pins"), "Applied").get("status") == "True",
             timeout=90, what="Applied=True")

    # llama-2 goes: the pin names a destination the pool no longer has, seen at once.
    env.scale("llama", 2)
    wait_for(lambda: condition(get_plan(kube_api, namespace, "pins"), "Planned").get("reason") == "InvalidPinned",
             timeout=45, what="Planned=False InvalidPinned after the scale-down, well within the 1 h period")
    assert "llama-2" in condition(get_plan(kube_api, namespace, "pins"), "Planned")["message"]


def test_an_auto_plan_publishes_its_pins_before_there_is_traffic_to_plan_from(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    env.operator(prometheus_url=env.prometheus_url)  # no router has sent a request: NoTraffic
    env.pool("llama")
    pins = {"tenant-a": ("llama-1",), "tenant-b": ("llama-0", "llama-1")}
    pinned = [{"key": k, "destinations": list(v)} for k, v in pins.items()]
    create_plan(kube_api, namespace, plan_manifest("llama", "llama", controlPeriod="2s",
                                                    metricsWindow=f"{WINDOW}s", pinned=pinned))

    def published() -> bool:
        plan = published_plan(kube_api, namespace, "llama")
        return plan is not None and plan.routes() == {affinity_key_hash(k): v for k, v in pins.items()}

    wait_for(published, timeout=90, what="the pins published without traffic")
    # The status follows the publication within the period.
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("status") == "True",
             timeout=30, what="Applied=True")
    obj = get_plan(kube_api, namespace, "llama")
    plan = published_plan(kube_api, namespace, "llama")
    assert plan is not None and set(plan.pinned_keys.tolist()) == {affinity_key_hash(k) for k in pins}
    assert obj["status"]["admittedKeys"] == 2
    # The period planned nothing more, and says why; the pins are in effect, and it is a wait.
    assert (condition(obj, "Planned")["status"], condition(obj, "Planned")["reason"]) == (
        "False", "MetricsUnavailable")
    assert (condition(obj, "Degraded")["status"], condition(obj, "Degraded")["reason"]) == ("False", "NoTraffic")
    assert condition(obj, "Applied")["status"] == "True"  # PlanApplied, then Unchanged
    (applied,) = events(kube_api, namespace, "PlanApplied")
    assert "pinned routes alone, not replayed (no window to plan from yet)" in applied.message
    assert condition(obj, "Ready")["reason"] == "PlanInEffect"

    # A pin edited while there is still no traffic: the pins alone are published again.
    pins = {"tenant-a": ("llama-0",)}
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "llama",
        {"spec": {"pinned": [{"key": "tenant-a", "destinations": ["llama-0"]}]}},
    )
    wait_for(published, timeout=60, what="the edited pins published")


def test_a_pool_scaled_to_zero_is_said_so_and_shows_no_kv_hit_until_it_serves_again(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    env.serving("llama", 30, WINDOW)
    create_plan(kube_api, namespace, plan_manifest("llama", "llama", controlPeriod="2s",
                                                    metricsWindow=f"{WINDOW}s", guard=GUARD_THROUGH_TIES))

    def observed() -> bool:
        return get_plan(kube_api, namespace, "llama").get("status", {}).get("observedKvHit") is not None

    wait_for(observed, timeout=90, what="an observed KV hit")
    # The same traffic period after period: each candidate routes as the plan in effect, and
    # Applied names both versions (they differ: a candidate's summary carries its own time).
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "Unchanged",
             timeout=60, what="Applied=True Unchanged")
    obj = get_plan(kube_api, namespace, "llama")
    assert condition(obj, "Applied")["message"] == (
        f"candidate {obj['status']['candidateVersion']} routes as plan {obj['status']['planVersion']}, "
        "which stays in effect"
    )
    # In Shadow the same candidates are reported as keeping that plan, which still routes.
    version = obj["status"]["planVersion"]
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans", "llama", {"spec": {"mode": "Shadow"}}
    )
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "ShadowMode",
             timeout=60, what="Applied=False ShadowMode")
    obj = get_plan(kube_api, namespace, "llama")
    assert condition(obj, "Applied")["message"].startswith(
        f"mode Shadow: would keep plan {version} in effect, which candidate {obj['status']['candidateVersion']} "
        "routes as")
    assert f"plan {version} stays in effect" in condition(obj, "Ready")["message"]

    env.scale("llama", 0)

    def scaled() -> bool:
        return "scaled to zero" in condition(get_plan(kube_api, namespace, "llama"), "Planned").get("message", "")

    wait_for(scaled, timeout=60, what="Planned=False saying the pool is scaled to zero")
    obj = get_plan(kube_api, namespace, "llama")
    assert condition(obj, "Planned")["reason"] == "PoolNotReady"
    assert condition(obj, "Degraded")["status"] == "False"  # asked for, not a fault
    # No engine serves: the last window's hit ratio is not shown as the pool's.
    assert obj["status"].get("observedKvHit") is None

    env.scale("llama", 2)
    wait_for(observed, timeout=90, what="the KV hit observed again")
    assert condition(get_plan(kube_api, namespace, "llama"), "Planned")["status"] == "True"


def test_two_auto_plans_created_together_publish_one_and_the_other_is_claimed(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    env.serving("llama", 30, WINDOW)
    # Both first periods start at once and read the same (unclaimed) plan in effect.
    for name in ("first", "second"):
        create_plan(kube_api, namespace, plan_manifest(name, "llama", controlPeriod="1h", metricsWindow=f"{WINDOW}s",
                                                        guard={"enabled": False}))

    def settled() -> bool:
        reasons = {condition(get_plan(kube_api, namespace, n), "Applied").get("reason") for n in ("first", "second")}
        return reasons == {"PlanApplied", "PoolClaimed"}

    wait_for(settled, timeout=90, what="one plan applied, the other claimed out, in their first periods")
    winner = next(n for n in ("first", "second")
                  if condition(get_plan(kube_api, namespace, n), "Applied")["reason"] == "PlanApplied")
    head = client.CoreV1Api(kube_api).read_namespaced_config_map("llama-plan", namespace)
    assert head.metadata.annotations["cacheroute.dev/affinity-plan"] == winner


def test_a_plan_republishes_a_deleted_configmap_and_stops_describing_a_deleted_pool(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    env.operator()
    env.pool("llama")
    pins = {"tenant-a": ("llama-1",)}
    # An hour's period: only the loop's own checks between periods can act within the test.
    create_plan(kube_api, namespace, plan_manifest("pins", "llama", mode="Manual", controlPeriod="1h",
                                                    pinned=[{"key": "tenant-a", "destinations": ["llama-1"]}]))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "pins"), "Applied").get("status") == "True",
             timeout=90, what="Applied=True")
    expected = {affinity_key_hash(k): v for k, v in pins.items()}

    # Deleted by hand: the pool's reconciler recreates it empty, and the plan publishes its pins again.
    core = client.CoreV1Api(kube_api)
    core.delete_namespaced_config_map("llama-plan", namespace)

    def pins_back() -> bool:
        plan = published_plan(kube_api, namespace, "llama")
        return plan is not None and plan.routes() == expected

    wait_for(lambda: not pins_back(), timeout=30, what="the ConfigMap gone or emptied", interval=0.2)
    wait_for(pins_back, timeout=60, what="the pinned routes published again")
    obj = get_plan(kube_api, namespace, "pins")
    assert condition(obj, "Ready")["status"] == "True"

    # The pool deleted: its plan ConfigMaps went with it; the status stops describing a plan in effect.
    client.CustomObjectsApi(kube_api).delete_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "inferencepools", "llama"
    )

    def gone() -> bool:
        ready = condition(get_plan(kube_api, namespace, "pins"), "Ready")
        return (ready.get("status"), ready.get("reason")) == ("False", "PoolNotFound")

    wait_for(gone, timeout=45, what="Ready=False PoolNotFound")
    status = get_plan(kube_api, namespace, "pins")["status"]
    assert status.get("planVersion") is None and status.get("admittedKeys") is None
    assert status.get("candidateVersion") is None
    assert condition(get_plan(kube_api, namespace, "pins"), "Applied")["reason"] == "PoolNotFound"


def test_a_plan_configmap_edited_into_no_plan_is_told_and_published_over(env: ControlEnv) -> None:
    import base64
    import gzip

    kube_api, namespace = env.api, env.namespace
    env.operator()
    env.pool("llama")
    create_plan(kube_api, namespace, plan_manifest("pins", "llama", mode="Manual", controlPeriod="2s",
                                                    pinned=[{"key": "tenant-a", "destinations": ["llama-1"]}]))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "pins"), "Applied").get("status") == "True",
             timeout=90, what="Applied=True")
    expected = {affinity_key_hash("tenant-a"): ("llama-1",)}
    core = client.CoreV1Api(kube_api)
    # A hand edit: the header replaced by an empty gzip stream; the version annotation stays.
    empty = base64.b64encode(gzip.compress(b"")).decode()
    core.patch_namespaced_config_map("llama-plan", namespace, {"binaryData": {"plan.json.gz": empty}})

    def told() -> list[object]:
        return events(kube_api, namespace, "PlanUnreadable")

    wait_for(lambda: bool(told()), timeout=30, what="a PlanUnreadable Event")
    [event] = told()
    assert event.type == "Warning" and event.involved_object.name == "pins"  # type: ignore[attr-defined]
    assert "llama hold no valid plan" in event.message  # type: ignore[attr-defined]

    def pins_back() -> bool:
        plan = published_plan(kube_api, namespace, "llama")
        return plan is not None and plan.routes() == expected

    wait_for(pins_back, timeout=30, what="the pinned routes published over the edit")
    # Readable again: not told every period.
    last = get_plan(kube_api, namespace, "pins")["status"]["lastPeriodTime"]
    assert wait_for_period_after(kube_api, namespace, "pins", last) and len(told()) == 1


def test_a_window_without_reusable_prefixes_says_why_nothing_is_planned(env: ControlEnv) -> None:
    # What the routers report for /v1/completions traffic: keys and prompts, no reusable prefix.
    kube_api, namespace = env.api, env.namespace
    traffic = zipf_traffic(20, 5.0, prompt=2000, prefix_share=0.0, exponent=1.0)
    _serving(env, "flat", traffic)
    _shadow_plan_once_the_window_is_full(env, "flat", traffic)

    def planned() -> dict[str, Any]:
        return condition(get_plan(kube_api, namespace, "flat"), "Planned")

    wait_for(lambda: "reusable prefix" in planned().get("message", ""), timeout=90,
             what="a Planned condition saying why nothing is admitted")
    message = planned()["message"]
    assert ": 0 routes (0 pinned)" in message
    assert "a /v1/completions request shows none" in message
