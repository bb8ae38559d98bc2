"""The real scheduler places GPU pods on the fake H100 nodes; kwok runs them on local pod IPs."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest
from kubernetes import client

from cacheroute.sandbox import nodes
from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.pods import PodEndpoint, running_pods
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration


def gpu_deployment(name: str, gpus: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    **nodes.gpu_scheduling(),
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.11.0",
                            "resources": {"limits": {nodes.GPU_RESOURCE: str(gpus)}},
                        }
                    ],
                },
            },
        },
    }


def test_nodes_look_like_gpu_feature_discovery_labelled_h100s(sandbox: Sandbox, kube_api: Any) -> None:
    listed = client.CoreV1Api(kube_api).list_node(label_selector=f"{nodes.GPU_PRODUCT_LABEL}=NVIDIA-H100-80GB-HBM3")
    assert len(listed.items) == 4
    for node in listed.items:
        assert node.metadata.labels[nodes.GPU_COUNT_LABEL] == "8"
        assert node.metadata.labels[nodes.GPU_MEMORY_LABEL] == "81559"
        assert node.status.allocatable[nodes.GPU_RESOURCE] == "8"
        assert node.status.capacity[nodes.GPU_RESOURCE] == "8"
        assert [(t.key, t.value, t.effect) for t in node.spec.taints] == [("nvidia.com/gpu", "present", "NoSchedule")]
        assert ipaddress.IPv4Network(node.spec.pod_cidr).subnet_of(ipaddress.IPv4Network(sandbox.state.pod_network))


def test_gpu_pod_is_scheduled_and_runs_on_a_local_ip(sandbox: Sandbox, kube_api: Any, namespace: str) -> None:
    seen: list[PodEndpoint] = []
    gone: list[PodEndpoint] = []
    apps = client.AppsV1Api(kube_api)
    with sandbox.watch_pods(seen.append, gone.append, namespace=namespace) as watcher:
        apps.create_namespaced_deployment(namespace, gpu_deployment("two-gpus", 2))
        wait_for(lambda: len(seen) == 1, timeout=60, what="the pod to run")
        endpoint = seen[0]
        # Sockets bound to the pod IP; a local process can serve on it, which is the point.
        with socket.create_server((endpoint.ip, 0)) as server:
            port = server.getsockname()[1]
            with socket.create_connection((endpoint.ip, port), timeout=5):
                pass
        assert sandbox.running_pods(namespace=namespace) == [endpoint]
        apps.delete_namespaced_deployment("two-gpus", namespace)
        wait_for(lambda: gone == [endpoint], timeout=60, what="the watcher to see the pod go")
    assert watcher.error is None
    assert endpoint.labels["app"] == "two-gpus"
    assert endpoint.node.startswith("kwok-h100-")
    node = client.CoreV1Api(kube_api).read_node(endpoint.node)
    assert ipaddress.ip_address(endpoint.ip) in ipaddress.ip_network(node.spec.pod_cidr)
    assert running_pods(kube_api, namespace=namespace) == []


def test_pod_asking_for_more_gpus_than_a_node_has_stays_pending(kube_api: Any, namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    client.AppsV1Api(kube_api).create_namespaced_deployment(namespace, gpu_deployment("nine-gpus", 9))

    def unschedulable_message() -> str:
        for pod in core.list_namespaced_pod(namespace, label_selector="app=nine-gpus").items:
            for condition in pod.status.conditions or []:
                if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                    return str(condition.message)
        return ""

    wait_for(lambda: bool(unschedulable_message()), timeout=60, what="the scheduler to give up on the pod")
    assert "Insufficient nvidia.com/gpu" in unschedulable_message()
    wait_for(
        lambda: bool(core.list_namespaced_event(namespace, field_selector="reason=FailedScheduling").items),
        timeout=30,
        what="a FailedScheduling event",
    )
    events = core.list_namespaced_event(namespace, field_selector="reason=FailedScheduling").items
    assert any("Insufficient nvidia.com/gpu" in e.message for e in events)
    pods = core.list_namespaced_pod(namespace, label_selector="app=nine-gpus").items
    assert [p.status.phase for p in pods] == ["Pending"]
    assert not pods[0].spec.node_name
