"""An AffinityPlan's Events reach the API server before the status that records them: a period
whose status is never written (the operator dies, or the write fails) loses no Event, and the next
period tells it again instead of never; once the status holds it, it is not told again."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from kubernetes import config

from cacheroute.operator.control.kube import EVENT_SOURCE, ApiError, ControlApi
from cacheroute.operator.control.loop import PlanLoop
from cacheroute.operator.control.settings import ControlSettings
from cacheroute.operator.fleet.cluster import namespace_terminating
from tests.support.control import condition, create_plan, events, get_plan, plan_manifest
from tests.support.namespaces import first_refusal, terminating_namespace

pytestmark = pytest.mark.integration


class _StatusLost(ControlApi):
    """The operator's API calls, except that every status write is lost (the process died
    right before it, as far as the API server can tell)."""

    def patch_plan_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        raise ApiError(f"updating the status of AffinityPlan {namespace}/{name} failed: connection lost")


def _period(api: ControlApi, namespace: str, kube_api: Any) -> None:
    body = get_plan(kube_api, namespace, "orphan")
    loop = PlanLoop(api, ControlSettings(), namespace=namespace, name="orphan",
                    events=lambda kind, reason, message: api.post_event(body, kind, reason, message))
    asyncio.run(loop.run_period(body))


def test_an_event_is_on_the_server_before_its_status_and_told_again_if_the_status_was_lost(
    kube_api: Any, namespace: str, operator_kubeconfig: Path
) -> None:
    # The operator's own identity: posting Events is within its ClusterRole.
    client = config.new_client_from_config(config_file=str(operator_kubeconfig))
    create_plan(kube_api, namespace, plan_manifest("orphan", "no-such-pool"))
    uid = get_plan(kube_api, namespace, "orphan")["metadata"]["uid"]

    _period(_StatusLost(client), namespace, kube_api)
    told = events(kube_api, namespace, "PoolNotFound")
    assert [(e.type, e.involved_object.kind, e.involved_object.name, e.involved_object.uid) for e in told] == [
        ("Warning", "AffinityPlan", "orphan", uid)
    ]
    assert "no-such-pool does not exist" in told[0].message
    assert told[0].source.component == EVENT_SOURCE
    assert not condition(get_plan(kube_api, namespace, "orphan"), "Ready")  # the status was lost

    # The next period (this operator's, or the replica that took over) does not know it was told.
    _period(ControlApi(client), namespace, kube_api)
    assert len(events(kube_api, namespace, "PoolNotFound")) == 2
    assert condition(get_plan(kube_api, namespace, "orphan"), "Ready")["reason"] == "PoolNotFound"

    # Recorded in the status now: a failure that lasts is told once.
    _period(ControlApi(client), namespace, kube_api)
    assert len(events(kube_api, namespace, "PoolNotFound")) == 2


def test_an_event_refused_by_a_namespace_being_deleted_is_no_warning(
    kube_api: Any, operator_kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kubernetes import client as k8s

    api = ControlApi(config.new_client_from_config(config_file=str(operator_kubeconfig)))
    with terminating_namespace(kube_api, "going-away") as name:
        involved = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "held", "namespace": name}}
        event = {"metadata": {"generateName": "x.", "namespace": name},
                 "involvedObject": {"kind": "ConfigMap", "name": "held"}}
        refusal = first_refusal(lambda: api.core.create_namespaced_event(name, event), k8s.ApiException,
                                undo=lambda: None)
        assert namespace_terminating(refusal)  # the real API server's answer, as told apart
        with caplog.at_level("INFO", logger="cacheroute.operator.control.kube"):
            api.post_event(involved, "Normal", "PoolNotReady", "no ready destination")
        assert [r.levelname for r in caplog.records] == ["INFO"]
        assert f"namespace {name} is being deleted" in caplog.records[0].getMessage()


def test_an_event_repeated_within_minutes_is_one_event_counted_again(
    kube_api: Any, namespace: str, operator_kubeconfig: Path
) -> None:
    # The operator's own identity: counting again (a patch) is within its ClusterRole too.
    client = config.new_client_from_config(config_file=str(operator_kubeconfig))
    api = ControlApi(client)
    create_plan(kube_api, namespace, plan_manifest("often", "no-such-pool"))
    body = get_plan(kube_api, namespace, "often")
    api.post_event(body, "Warning", "GuardRejected", "KV hit 81.21% is below 81.22% without a plan")
    api.post_event(body, "Normal", "PlanApplied", "plan 1 applied")
    api.post_event(body, "Warning", "GuardRejected", "KV hit 80.10% is below 80.50% without a plan")
    api.post_event(body, "Warning", "GuardRejected", "KV hit 79.90% is below 80.00% without a plan")
    told = events(kube_api, namespace, "GuardRejected")
    assert [(e.count, e.message) for e in told] == [(3, "KV hit 79.90% is below 80.00% without a plan")]
    assert len(events(kube_api, namespace, "PlanApplied")) == 1
    # Another operator replica (or this one restarted) knows of no series: it tells afresh.
    ControlApi(client).post_event(body, "Warning", "GuardRejected", "KV hit 1% is below 2% without a plan")
    assert sorted(e.count for e in events(kube_api, namespace, "GuardRejected")) == [1, 3]
