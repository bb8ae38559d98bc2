"""A candidate that loses in the guard is not applied: the plan in effect stays."""

from __future__ import annotations

import pytest

from tests.support.control import (
    ControlEnv,
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
    kube_api, namespace = env.api, env.namespace
    good = zipf_traffic(40, 5.0, prompt=2000, prefix_share=0.9, exponent=1.0)
    fleet = env.fleet("llama")
    fleet.set_traffic(good)
    env.operator(prometheus_url=env.prometheus_url)
    env.pool("llama")
    wait_for_window(env.prometheus_url, namespace, len(good.keys) + 2, WINDOW)
    # The guard asks a plan to buy at least half a point of KV hit over no plan: pinning keys that
    # cannot reuse anything then never pays, whatever load balance the replay predicts.
    create_plan(kube_api, namespace, plan_manifest("llama", "llama", controlPeriod="2s", metricsWindow=f"{WINDOW}s",
                                                   guard={"minKvHitGain": 0.005}))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "PlanApplied",
             timeout=90, what="a first plan applied")

    # New keys with a 100-token reusable prefix: less than a KV block, so no hit to gain.
    fleet.set_traffic(zipf_traffic(40, 8.0, prompt=2000, prefix_share=0.05, exponent=0.0, name="low"))
    wait_for_quiet_keys(env.prometheus_url, namespace, [k.key for k in good.keys], WINDOW)
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("reason") == "GuardRejected",
             timeout=90, what="Applied=False GuardRejected")
    obj = get_plan(kube_api, namespace, "llama")
    in_effect = obj["status"]["planVersion"]
    published = published_plan(kube_api, namespace, "llama")
    assert published is not None
    # Two more periods: rejected again, and the ConfigMap still holds the plan in effect.
    for _ in range(2):
        obj = wait_for_period_after(kube_api, namespace, "llama", obj["status"]["lastPeriodTime"])
        applied = condition(obj, "Applied")
        assert (applied["status"], applied["reason"]) == ("False", "GuardRejected")
        assert "KV hit 0.0% does not beat 0.0% without a plan" in applied["message"] and in_effect in applied["message"]
    assert obj["status"]["planVersion"] == in_effect
    assert obj["status"]["candidateVersion"] != in_effect
    after = published_plan(kube_api, namespace, "llama")
    assert after is not None and after.routes() == published.routes()
    assert condition(obj, "Degraded")["status"] == "False"
    assert condition(obj, "Ready")["status"] == "True"
    assert events(kube_api, namespace, "GuardRejected")
