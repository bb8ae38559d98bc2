"""The router reading plans and endpoints through the sandbox's real kube-apiserver."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import PlanPayload, encode_plan
from cacheroute.sandbox.cluster import Sandbox
from tests.support.router import (
    Engine,
    RouterStarter,
    await_condition,
    destination,
    exchange,
    headers_request,
    make_plan,
)

pytestmark = pytest.mark.integration


def apply_payload(core: Any, namespace: str, payload: PlanPayload) -> None:
    """Write the plan's ConfigMaps the way the operator does: shards first, header last."""
    for name in sorted(payload.configmaps, key=lambda n: (n.count("-plan-") == 0, n)):
        body = {
            "metadata": {"name": name},
            "binaryData": {f: base64.b64encode(payload.files[f]).decode() for f in payload.configmaps[name]},
        }
        try:
            core.replace_namespaced_config_map(name, namespace, body)
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise
            core.create_namespaced_config_map(namespace, body)


def test_plan_configmaps_are_followed_through_the_api(
    sandbox: Sandbox, kube_api: Any, namespace: str, engines: list[Engine], start_router: RouterStarter
) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    # Enough routes that the plan spans several ConfigMaps.
    routes: dict[str, list[int]] = {f"user-{i}": [i % 3] for i in range(200_000)}
    routes["alice"] = [1]
    first = encode_plan(make_plan(engines, routes), max_object_bytes=400_000)
    assert len(first.configmaps) > 1
    apply_payload(core, namespace, first)
    router = start_router(
        "--namespace", namespace, "--pool", "pool", "--kubeconfig", str(sandbox.kubeconfig),
    )
    assert f'version="{first.version}"' in router.metrics()
    assert router.sample("cacheroute_router_plan_routes") == 200_001

    routes["alice"] = [2]
    second = encode_plan(make_plan(engines, routes), max_object_bytes=400_000)
    apply_payload(core, namespace, second)
    await_condition(lambda: f'version="{second.version}"' in router.metrics(), "the updated plan", timeout=20)
    # Half-written states on the way (new shards, old header) were not counted as bad plans.
    assert router.sample("cacheroute_router_plan_loads_total", result="rejected") == 0

    assert destination(exchange(router, headers_request("alice")))[0] == engines[2].address

    # A new plan with a broken shard is rejected once it has had time to settle; the good one stays.
    routes["alice"] = [0]
    third = encode_plan(make_plan(engines, routes), max_object_bytes=400_000)
    broken = dict(third.files)
    victim = third.configmaps["pool-plan-1"][0]
    broken[victim] = broken[victim][:-40]
    apply_payload(core, namespace, PlanPayload(third.version, broken, third.configmaps))
    await_condition(lambda: router.sample("cacheroute_router_plan_loads_total", result="rejected") >= 1,
                    "the broken plan to be rejected", timeout=20)
    assert f'version="{second.version}"' in router.metrics()
    assert destination(exchange(router, headers_request("alice")))[0] == engines[2].address


def endpoint_slice(name: str, service: str, address: str, pod: str, *, ready: bool) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [host], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": pod}}
        ],
    }


def test_destinations_without_addresses_resolve_through_endpoint_slices(
    sandbox: Sandbox, kube_api: Any, namespace: str, start_router: RouterStarter
) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    discovery = client.DiscoveryV1Api(kube_api)
    # EndpointSlices refuse loopback addresses, so these pods are never contacted: scraping is
    # off and readiness comes from the slices alone.
    pods = {f"pool-{i}": f"10.77.0.{i + 1}:8000" for i in range(3)}
    plan = plan_from_routes("pool", [Destination(p) for p in pods], {affinity_key_hash("alice"): ["pool-1"]})
    apply_payload(core, namespace, encode_plan(plan))
    for pod, address in pods.items():
        discovery.create_namespaced_endpoint_slice(namespace, endpoint_slice(pod, "pool", address, pod, ready=True))
    router = start_router(
        "--namespace", namespace, "--pool", "pool", "--service", "pool", "--kubeconfig", str(sandbox.kubeconfig),
        "--scrape-interval", "0",
    )
    await_condition(lambda: router.sample("cacheroute_router_endpoint_ready") == 3, "three ready endpoints")
    assert destination(exchange(router, headers_request("alice")))[0] == pods["pool-1"]

    discovery.replace_namespaced_endpoint_slice(
        "pool-1", namespace, endpoint_slice("pool-1", "pool", pods["pool-1"], "pool-1", ready=False)
    )
    await_condition(
        lambda: router.sample("cacheroute_router_endpoint_ready", endpoint=pods["pool-1"]) == 0,
        "the unready pod to leave the ready set",
    )
    for _ in range(5):
        assert destination(exchange(router, headers_request("alice")))[0] in {pods["pool-0"], pods["pool-2"]}
    assert router.sample("cacheroute_router_decisions_total", outcome="spilled") == 5

    # The pool scaled to zero: the slices stay with no endpoints. The router learns that (it is a
    # pool with no destination, not a failed watch) and answers "no endpoint" rather than
    # routing to the pods that were there.
    for pod, address in pods.items():
        empty = {**endpoint_slice(pod, "pool", address, pod, ready=True), "endpoints": []}
        discovery.replace_namespaced_endpoint_slice(pod, namespace, empty, _preload_content=False)  # no model for it
    await_condition(lambda: not router.sample("cacheroute_router_endpoint_ready"), "no endpoint left")
    reply = exchange(router, headers_request("alice"))
    assert reply.WhichOneof("response") == "immediate_response"
    assert reply.immediate_response.status.code == 503
