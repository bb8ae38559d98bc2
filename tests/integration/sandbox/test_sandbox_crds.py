"""The project's CRDs install into the sandbox and the API server enforces their CEL rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.crds import apply_crds, load_crds

pytestmark = pytest.mark.integration

CRD_DIR = Path(__file__).resolve().parents[3] / "crds"
GROUP, VERSION, PLURAL = "cacheroute.dev", "v1alpha1", "inferencepools"


def cel_message(crds: list[dict[str, Any]], kind: str, field: str) -> str:
    """The message of the CRD's spec-level CEL rule that mentions `field`."""
    for crd in crds:
        if crd["spec"]["names"]["kind"] != kind:
            continue
        for version in crd["spec"]["versions"]:
            spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
            for rule in spec.get("x-kubernetes-validations", []):
                if field in rule["rule"]:
                    return str(rule["message"])
    raise AssertionError(f"{kind} has no CEL rule on {field}")


def pool(name: str, tensor_parallel: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {"model": {"name": "meta-llama/Llama-3.3-70B-Instruct"}, "tensorParallelSize": tensor_parallel},
    }


@pytest.fixture(scope="module")
def crds(sandbox: Sandbox) -> list[dict[str, Any]]:
    loaded = load_crds(CRD_DIR.glob("*.yaml"))
    apply_crds(sandbox.api_client(), loaded)
    return loaded


def test_crds_are_established(crds: list[dict[str, Any]], kube_api: Any) -> None:
    api = client.ApiextensionsV1Api(kube_api)
    served = {crd.metadata.name for crd in api.list_custom_resource_definition().items}
    assert {crd["metadata"]["name"] for crd in crds} <= served
    assert "inferencepools.cacheroute.dev" in served


def test_valid_pool_is_accepted_with_defaults(crds: list[dict[str, Any]], kube_api: Any, namespace: str) -> None:
    api = client.CustomObjectsApi(kube_api)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, pool("llama", 2))
    stored = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llama")
    assert stored["spec"]["tensorParallelSize"] == 2
    # Structural-schema defaults are applied by the API server.
    assert stored["spec"]["gpu"]["countPerNode"] == 8


def test_pool_whose_tensor_parallelism_does_not_divide_the_node_is_rejected(
    crds: list[dict[str, Any]], kube_api: Any, namespace: str
) -> None:
    api = client.CustomObjectsApi(kube_api)
    with pytest.raises(client.ApiException) as rejected:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, pool("odd", 3))
    assert rejected.value.status == 422
    assert cel_message(crds, "InferencePool", "tensorParallelSize") in rejected.value.body
    assert api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"] == []


@pytest.mark.parametrize("value", ["lots", 100])
def test_an_int_or_word_field_out_of_its_rule_is_rejected_naming_the_value_given(
    crds: list[dict[str, Any]], kube_api: Any, namespace: str, value: int | str
) -> None:
    api = client.CustomObjectsApi(kube_api)
    body = pool(f"mnbt-{str(value).lower()}", 2)
    body["spec"]["memory"] = {"maxNumBatchedTokens": value}
    with pytest.raises(client.ApiException) as rejected:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    assert rejected.value.status == 422
    # The API server prints an int-or-string field's value as `""`: the message itself must say what was given.
    given = f'"{value}"' if isinstance(value, str) else str(value)
    message = json.loads(rejected.value.body)["message"]
    assert f"must be auto, or an integer from 256 to 1048576, not {given}" in message, message


@pytest.mark.parametrize(
    ("pinned", "field"),
    [
        ([{"key": "a", "destinations": ["llama-0"]}, {"key": "a", "destinations": ["llama-1"]}], "spec.pinned[1]"),
        ([{"key": "a", "destinations": ["llama-0", "llama-0"]}], "spec.pinned[0].destinations[1]"),
    ],
    ids=["key twice", "destination twice"],
)
def test_a_key_or_destination_pinned_twice_is_refused_by_the_api_server(
    crds: list[dict[str, Any]], kube_api: Any, namespace: str, pinned: list[dict[str, Any]], field: str
) -> None:
    api = client.CustomObjectsApi(kube_api)
    body = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "AffinityPlan", "metadata": {"name": "twice"},
        "spec": {"poolRef": {"name": "llama"}, "mode": "Manual", "pinned": pinned},
    }
    with pytest.raises(client.ApiException) as rejected:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, "affinityplans", body)
    assert rejected.value.status == 422
    message = json.loads(rejected.value.body)["message"]
    assert f"{field}: Duplicate value" in message, message


@pytest.mark.parametrize(("period", "accepted"), [("500ms", False), ("0s", False), ("1s", True), ("1h30m", True)])
def test_a_control_period_under_a_second_is_refused_by_the_api_server(
    crds: list[dict[str, Any]], kube_api: Any, namespace: str, period: str, accepted: bool
) -> None:
    api = client.CustomObjectsApi(kube_api)
    name = "period-" + period.replace(".", "-")
    body = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "AffinityPlan", "metadata": {"name": name},
        "spec": {"poolRef": {"name": "llama"}, "controlPeriod": period},
    }
    if accepted:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, "affinityplans", body, dry_run="All")
        return
    with pytest.raises(client.ApiException) as rejected:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, "affinityplans", body, dry_run="All")
    assert rejected.value.status == 422
    assert cel_message(crds, "AffinityPlan", "controlPeriod") in rejected.value.body


def test_kubectl_get_shows_a_plans_readiness_and_what_degrades_it(
    crds: list[dict[str, Any]], kube_api: Any, namespace: str
) -> None:
    api = client.CustomObjectsApi(kube_api)
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "AffinityPlan", "metadata": {"name": "shown"},
            "spec": {"poolRef": {"name": "llama"}}}
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "affinityplans", body)
    stamp = "2026-12-05T10:00:00Z"
    conditions = [
        {"type": kind, "status": status, "reason": reason, "message": "", "lastTransitionTime": stamp}
        for kind, status, reason in (("Ready", "True", "PlanInEffect"), ("Degraded", "True", "PrometheusUnreachable"))
    ]
    api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "affinityplans", "shown",
        {"status": {"conditions": conditions, "planVersion": "0123456789abcdef", "observedKvHit": 0.6612}},
    )
    row = table_row(kube_api, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/affinityplans/shown")
    assert (row["Ready"], row["Degraded"], row["Plan"], row["KV hit"]) == (
        "True", "PrometheusUnreachable", "0123456789abcdef", 0.6612
    )


def test_kubectl_get_shows_a_pool_that_serves_and_what_degrades_it(
    crds: list[dict[str, Any]], kube_api: Any, namespace: str
) -> None:
    api = client.CustomObjectsApi(kube_api)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, pool("served", 2))
    stamp = "2026-12-05T10:00:00Z"
    conditions = [
        {"type": kind, "status": status, "reason": reason, "message": "", "lastTransitionTime": stamp}
        for kind, status, reason in (("Ready", "True", "Ready"), ("Degraded", "True", "GIENotInstalled"))
    ]
    api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "served", {"status": {"conditions": conditions, "readyReplicas": 1}},
    )
    row = table_row(kube_api, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/served")
    assert (row["Ready"], row["Reason"], row["Degraded"], row["Available"]) == ("True", "Ready", "GIENotInstalled", 1)


def table_row(kube_api: Any, path: str) -> dict[str, Any]:
    """What `kubectl get` prints for one object: the API server's Table rendering of the CRD's columns."""
    answer = kube_api.call_api(
        path, "GET", header_params={"Accept": "application/json;as=Table;g=meta.k8s.io;v=v1"},
        response_type="object", _return_http_data_only=True,
    )
    columns = [c["name"] for c in answer["columnDefinitions"]]
    return dict(zip(columns, answer["rows"][0]["cells"], strict=True))
