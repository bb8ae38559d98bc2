"""With the GIE InferencePool CRD installed and `spec.gie.enabled`, the pool is published to GIE gateways."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.crds import apply_crds
from tests.integration.operator.conftest import Fleet
from tests.support.gie import GROUP, gie_inferencepool_crd
from tests.support.operator import LLAMA_70B_FP8_TP2, sleep_observing, until

pytestmark = pytest.mark.integration


@pytest.fixture
def gie_crd(sandbox: Sandbox) -> Iterator[None]:
    crd = gie_inferencepool_crd()
    apply_crds(sandbox.api_client(), [crd])
    yield
    with contextlib.suppress(client.ApiException):
        client.ApiextensionsV1Api(sandbox.api_client()).delete_custom_resource_definition(crd["metadata"]["name"])


def gie_pool(kube_api: Any, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        out: dict[str, Any] = client.CustomObjectsApi(kube_api).get_namespaced_custom_object(
            GROUP, "v1", namespace, "inferencepools", name
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return out


def serves_gie(kube_api: Any) -> bool:
    try:
        found = client.CustomObjectsApi(kube_api).get_api_resources(GROUP, "v1")
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return any(r.name == "inferencepools" for r in found.resources)


def _told_once(fleet: Fleet, reason: str) -> None:
    told = fleet.operator.events(reason, "llama")
    assert len(told) == 1, [r.get("message") for r in told]


def test_a_pool_published_to_gie_without_its_crds_is_degraded_until_they_come(
    sandbox: Sandbox, fleet: Fleet, kube_api: Any
) -> None:
    until(lambda: not serves_gie(kube_api), "no GIE InferencePool served (an earlier test's CRD gone)", timeout=60)
    fleet.pools.create("llama", {**LLAMA_70B_FP8_TP2, "gie": {"enabled": True}})
    degraded = fleet.pools.await_condition("llama", "Degraded", "True", "GIENotInstalled", timeout=120)
    assert "spec.gie.enabled to false" in degraded["message"]
    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)  # its own routers serve it
    # A spec change while the CRD is still missing is applied, and the Event is not told again.
    fleet.pools.patch_spec("llama", {"replicas": 3})
    fleet.pools.await_status("llama", lambda s: s.get("observedGeneration") == 2, "the new spec observed")
    # The pass logs its Events just after it writes the status: watch a moment longer.
    sleep_observing(2.0, lambda: _told_once(fleet, "GIENotInstalled"))
    # Once the CRDs are there (the operator rediscovers them within its 30 s cache), the pool is published.
    crd = gie_inferencepool_crd()
    apply_crds(sandbox.api_client(), [crd])
    try:
        until(lambda: gie_pool(kube_api, fleet.namespace, "llama") is not None, "the GIE InferencePool", timeout=90)
        fleet.pools.await_condition("llama", "Degraded", "False", "AsExpected", timeout=60)
        # The Warning gets its answer: the pool served all along, so Ready did not turn to give it.
        until(lambda: bool(fleet.operator.events("Recovered", "llama")), "the Recovered Event", timeout=30)
    finally:
        with contextlib.suppress(client.ApiException):
            client.ApiextensionsV1Api(sandbox.api_client()).delete_custom_resource_definition(crd["metadata"]["name"])


def test_gie_pool_points_at_the_router_and_goes_when_disabled(gie_crd: None, fleet: Fleet, kube_api: Any) -> None:
    created = fleet.pools.create("llama", {**LLAMA_70B_FP8_TP2, "gie": {"enabled": True, "failureMode": "FailClose"}})
    until(lambda: gie_pool(kube_api, fleet.namespace, "llama") is not None, "the GIE InferencePool", timeout=60)
    published = gie_pool(kube_api, fleet.namespace, "llama") or {}
    assert published["spec"] == {
        "selector": {"matchLabels": {"cacheroute.dev/pool": "llama", "app.kubernetes.io/component": "engine"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {
            "group": "", "kind": "Service", "name": "llama-router", "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    assert [o["uid"] for o in published["metadata"]["ownerReferences"]] == [created["metadata"]["uid"]]
    # The selector picks exactly the pool's engine pods.
    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)
    selector = ",".join(f"{k}={v}" for k, v in published["spec"]["selector"]["matchLabels"].items())
    picked = client.CoreV1Api(kube_api).list_namespaced_pod(fleet.namespace, label_selector=selector).items
    assert sorted(p.metadata.name for p in picked) == [f"llama-{i}" for i in range(4)]

    fleet.pools.patch_spec("llama", {"gie": {"enabled": False}})
    until(lambda: gie_pool(kube_api, fleet.namespace, "llama") is None, "the GIE InferencePool removed", timeout=60)
