"""A candidate that loses in the guard is not applied: the plan in effect stays, unless it has
itself become worse than no plan, when it is withdrawn."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from cacheroute.planner.plan import affinity_key_hash
from tests.support.control import (
    GROUP,
    GUARD_THROUGH_TIES,
    VERSION,
    ControlEnv,
    KeyLoad,
    condition,
    create_plan,
    events,
    get_plan,
    plan_manifest,
    published_plan,
    wait_for_period_after,
    wait_for_quiet_keys,
    wait_for_window,
    zipf_traffic,
)
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

WINDOW = 10


def test_low_reuse_candidate_is_rejected_and_the_plan_in_effect_stays(env: ControlEnv) -> None:
    from kubernetes import client

    kube_api, namespace = env.api, env.namespace
    good = zipf_traffic(40, 5.0, prompt=2000, prefix_share=0.9, exponent=1.0)
    fleet = env.fleet("llama")
    fleet.set_traffic(good)
    env.operator(prometheus_url=env.prometheus_url)
    env.pool("llama")
    wait_for_window(env.prometheus_url, namespace, len(good.keys) + 2, WINDOW)
    # A first plan for these keys, applied without the guard: the routers keep 40 keys on their
    # ring candidates about as well as a plan does (85.0 % against 85.1 % served KV hit in the
    # guard's replay), so no plan for them would clear the bar below.
    create_plan(kube_api, namespace, plan_manifest("llama", "llama", controlPeriod="2s", metricsWindow=f"{WINDOW}s",
                                                   guard={"enabled": False}))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "PlanApplied",
             timeout=90, what="a first plan applied")
    first = get_plan(kube_api, namespace, "llama")["status"]["planVersion"]
    # The guard asks a plan to buy at least half a point of KV hit over no plan: pinning keys that
    # cannot reuse anything then never pays, whatever load balance the replay predicts.
    guard = {"enabled": True, "minKvHitGain": 0.005}
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "affinityplans", "llama", {"spec": {"guard": guard}})

    # New keys with a 100-token reusable prefix: less than a KV block, so no hit to gain.
    fleet.set_traffic(zipf_traffic(40, 8.0, prompt=2000, prefix_share=0.05, exponent=0.0, name="low"))
    wait_for_quiet_keys(env.prometheus_url, namespace, [k.key for k in good.keys], WINDOW)
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "GuardRejected",
             timeout=90, what="Applied=False GuardRejected")
    obj = get_plan(kube_api, namespace, "llama")
    in_effect = obj["status"]["planVersion"]
    assert in_effect == first
    published = published_plan(kube_api, namespace, "llama")
    assert published is not None
    # Two more periods: rejected again, and the ConfigMap still holds the plan in effect.
    for _ in range(2):
        obj = wait_for_period_after(kube_api, namespace, "llama", obj["status"]["lastPeriodTime"])
        applied = condition(obj, "Applied")
        assert (applied["status"], applied["reason"]) == ("False", "GuardRejected")
        # The KV hit rule at least (a little traffic of the old keys may still be in the window).
        assert "does not beat" in applied["message"] and "without a plan by 0.5%" in applied["message"]
        assert f"plan {in_effect} stays" in applied["message"]
    assert obj["status"]["planVersion"] == in_effect
    assert obj["status"]["candidateVersion"] != in_effect
    after = published_plan(kube_api, namespace, "llama")
    assert after is not None and after.routes() == published.routes()
    assert condition(obj, "Degraded")["status"] == "False"
    assert condition(obj, "Ready")["status"] == "True"
    assert events(kube_api, namespace, "GuardRejected")


def test_a_plan_in_effect_worse_than_no_plan_is_withdrawn(env: ControlEnv) -> None:
    from kubernetes import client

    kube_api, namespace = env.api, env.namespace
    # 40 keys of 9,000 reusable tokens: 360,000 in all, more than one destination's KV (255,632
    # tokens here) holds, and a quarter of it (90,000) per destination of four. Piled on one, they
    # evict each other however long the guard's window (69.5 % against 84.5 % without a plan in
    # one run); with shorter prefixes the pile fits, and only a short window's cold start told
    # them apart.
    traffic = zipf_traffic(40, 5.0, prompt=10000, prefix_share=0.9, exponent=1.0)
    env.fleet("llama").set_traffic(traffic)
    env.operator(prometheus_url=env.prometheus_url)
    # Four destinations: no plan keeps each key on two of them, the pile on one (and spills).
    env.pool("llama", replicas=4)
    custom = client.CustomObjectsApi(kube_api)
    # Routers that do not follow prefixes: every key sticks to what its plan entry says.
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "inferencepools", "llama",
                                          {"spec": {"router": {"followPrefixes": False}}})
    wait_for_window(env.prometheus_url, namespace, len(traffic.keys) + 2, WINDOW)
    # A plan piling every key on one destination, put in effect by hand.
    pile = [{"key": k.key, "destinations": ["llama-0"]} for k in traffic.keys]
    create_plan(kube_api, namespace, plan_manifest("llama", "llama", mode="Manual", controlPeriod="2s",
                                                   metricsWindow=f"{WINDOW}s", pinned=pile))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "PlanApplied",
             timeout=90, what="the pile applied")
    piled = get_plan(kube_api, namespace, "llama")["status"]["planVersion"]

    # Auto, asking every candidate for 90 points of KV hit over no plan: none can pass, and the
    # pile, judged on the same traffic, is worse than no plan.
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "affinityplans", "llama",
                                          {"spec": {"mode": "Auto", "pinned": None, "guard": {"minKvHitGain": 0.9}}})
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "PlanWithdrawn",
             timeout=90, what="Applied=True PlanWithdrawn")
    obj = get_plan(kube_api, namespace, "llama")
    applied = condition(obj, "Applied")
    assert applied["status"] == "True"
    assert f"plan {piled} withdrawn, worse than no plan" in applied["message"], applied["message"]
    assert obj["status"]["planVersion"] != piled and obj["status"]["admittedKeys"] == 0
    plan = published_plan(kube_api, namespace, "llama")
    assert plan is not None and len(plan) == 0
    assert events(kube_api, namespace, "PlanWithdrawn")
    # The next candidate loses again, and nothing is left to withdraw: the empty plan stays.
    withdrawn = obj["status"]["planVersion"]
    obj = wait_for_period_after(kube_api, namespace, "llama", obj["status"]["lastPeriodTime"])
    assert condition(obj, "Applied")["reason"] == "GuardRejected"
    assert obj["status"]["planVersion"] == withdrawn


def test_after_shadow_a_rejected_candidate_leaves_the_figures_of_the_empty_plan_in_effect(env: ControlEnv) -> None:
    from kubernetes import client

    kube_api, namespace = env.api, env.namespace
    env.serving("llama", 40, WINDOW)
    create_plan(kube_api, namespace, plan_manifest("llama", "llama", mode="Shadow", controlPeriod="2s",
                                                   metricsWindow=f"{WINDOW}s"))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "ShadowMode",
             timeout=90, what="a Shadow period")
    shadow = get_plan(kube_api, namespace, "llama")["status"]
    # Shadow reports the plan it would apply.
    assert shadow["admittedKeys"] > 0
    # Auto, asking for 90 points of KV hit over no plan: the candidate loses, and only the pool's
    # empty plan is in effect. The status describes that plan, not what Shadow would have applied.
    client.CustomObjectsApi(kube_api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "affinityplans", "llama", {"spec": {"mode": "Auto", "guard": {"minKvHitGain": 0.9}}})
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "GuardRejected",
             timeout=90, what="Applied=False GuardRejected")
    obj = get_plan(kube_api, namespace, "llama")
    assert obj["status"]["admittedKeys"] == 0
    assert obj["status"]["coveredRequestShare"] == 0
    assert obj["status"]["planVersion"] == shadow["planVersion"]
    assert "(no routes" in condition(obj, "Applied")["message"]
    # The predicted figures are the guard's replay of the empty plan, not Shadow's candidate.
    assert obj["status"]["predictedKvHit"] < shadow["predictedKvHit"]


def test_a_candidate_too_thin_to_replay_waits_for_traffic_without_a_warning(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    # A request every few days: Prometheus counts it, the planner plans for it, and the guard's
    # longest replay (30 minutes) still synthesises no request from it.
    thin = zipf_traffic(3, 3e-6, prompt=2000, prefix_share=0.9, exponent=1.0)
    env.fleet("llama").set_traffic(thin)
    env.operator(prometheus_url=env.prometheus_url)
    env.pool("llama")
    wait_for_window(env.prometheus_url, namespace, len(thin.keys) + 2, WINDOW)
    create_plan(kube_api, namespace, plan_manifest("llama", "llama", controlPeriod="2s", metricsWindow=f"{WINDOW}s"))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "NoTraffic",
             timeout=90, what="Applied=False NoTraffic")
    obj = get_plan(kube_api, namespace, "llama")
    applied = condition(obj, "Applied")
    assert applied["status"] == "False"
    assert "not judged, too little traffic to replay" in applied["message"], applied["message"]
    # A wait, as for a window without requests: neither Degraded nor a Warning to page anyone.
    assert (condition(obj, "Degraded")["status"], condition(obj, "Degraded")["reason"]) == ("False", "NoTraffic")
    # The plan in effect (the pool's empty one) stays, and its figures with it.
    assert obj["status"]["candidateVersion"] != obj["status"]["planVersion"]
    assert obj["status"]["admittedKeys"] == 0
    wait_for(lambda: bool(events(kube_api, namespace, "NoTraffic")), timeout=30, what="a NoTraffic Event")
    assert all(e.type == "Normal" for e in events(kube_api, namespace, "NoTraffic"))
    assert not events(kube_api, namespace, "GuardRejected")
    # Told once while it lasts, though every period finds the same.
    obj = wait_for_period_after(kube_api, namespace, "llama", obj["status"]["lastPeriodTime"])
    obj = wait_for_period_after(kube_api, namespace, "llama", obj["status"]["lastPeriodTime"])
    assert condition(obj, "Applied")["reason"] == "NoTraffic"
    assert len(events(kube_api, namespace, "NoTraffic")) == 1


def test_keys_longer_than_the_model_are_neither_planned_nor_replayed(env: ControlEnv) -> None:
    kube_api, namespace = env.api, env.namespace
    # Prompts a server refuses (the model's length is 131,072 tokens here): 200,000 tokens, which one
    # destination's KV (255,632 tokens) would hold, and two million, which it would not. Replayed as
    # if served, the first made the guard reject every candidate, the second kept it from judging
    # any, for as long as they stayed in the metrics window.
    good = zipf_traffic(40, 5.0, prompt=2000, prefix_share=0.9, exponent=1.0)
    refused = (KeyLoad("long", 0.5, 200_000, 180_000), KeyLoad("giant", 0.5, 2_000_000, 1_800_000))
    traffic = replace(good, keys=(*good.keys, *refused))
    env.fleet("llama").set_traffic(traffic)
    env.operator(prometheus_url=env.prometheus_url)
    env.pool("llama")
    wait_for_window(env.prometheus_url, namespace, len(traffic.keys) + 2, WINDOW)
    create_plan(kube_api, namespace, plan_manifest("llama", "llama", controlPeriod="2s", metricsWindow=f"{WINDOW}s",
                                                   guard=GUARD_THROUGH_TIES))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "PlanApplied",
             timeout=90, what="the candidate judged and applied")
    obj = get_plan(kube_api, namespace, "llama")
    planned = condition(obj, "Planned")["message"]
    told = (r"left out 2 key\(s\) \([0-9.]+ request\(s\)/s\) whose mean prompt is longer than the model's length "
            r"\(131,072 tokens; the longest mean 2,000,000\): a server refuses them")
    assert re.search(told, planned), planned
    assert not events(kube_api, namespace, "NoTraffic")
    # Of all the window's requests (6.5 a second, 1 of them refused), not only of those planned for.
    assert obj["status"]["coveredRequestShare"] < 0.8
    plan = published_plan(kube_api, namespace, "llama")
    assert plan is not None and len(plan) > 0
    assert not {affinity_key_hash(k.key) for k in refused} & set(plan.routes())
