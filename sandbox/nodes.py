"""Fake GPU nodes, as NVIDIA GPU feature discovery and the device plugin would label them.

kwok gives each pod an address from its node's `spec.podCIDR`, the node's /24 of the sandbox's pod
network (`sandbox.network`): an address of this machine that a local process (a vLLM emulator, a
router) can listen on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cacheroute.sandbox.network import LOOPBACK_NETWORK, PodNetwork

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_TAINT_KEY = "nvidia.com/gpu"
# kwok manages only the nodes that carry this annotation.
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"
SANDBOX_NODE_LABEL = "cacheroute.dev/sandbox-node"
# Pods of nodes without their own podCIDR (none of ours) would get addresses from here.
KWOK_DEFAULT_POD_CIDR = "127.255.0.0/16"
MAX_NODES = 250


@dataclass(frozen=True)
class GpuNodeType:
    product: str = "NVIDIA-H100-80GB-HBM3"
    gpus: int = 8
    gpu_memory_mib: int = 81559
    cpu: str = "192"
    memory: str = "2Ti"
    pods: str = "110"
    ephemeral_storage: str = "30Ti"


H100 = GpuNodeType()


def node_name(index: int) -> str:
    return f"kwok-h100-{index}"


def pod_cidr(index: int, network: PodNetwork | None = None) -> str:
    return (network or PodNetwork(LOOPBACK_NETWORK, False)).node_cidr(index)


def node_ip(index: int) -> str:
    """Every fake node's kubelet is kwok, on 127.0.0.1: the API server reaches it there for logs.

    The address is outside every pod CIDR, so a node address never collides with a pod address.
    """
    return "127.0.0.1"


def node_manifest(index: int, node_type: GpuNodeType = H100, network: PodNetwork | None = None) -> dict[str, Any]:
    """The Node object for fake GPU node `index` (0-based), status included."""
    if not 0 <= index < MAX_NODES:
        raise ValueError(f"node index {index} is outside 0..{MAX_NODES - 1}")
    name = node_name(index)
    resources = {
        "cpu": node_type.cpu,
        "memory": node_type.memory,
        "pods": node_type.pods,
        "ephemeral-storage": node_type.ephemeral_storage,
        GPU_RESOURCE: str(node_type.gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                SANDBOX_NODE_LABEL: "true",
                GPU_PRODUCT_LABEL: node_type.product,
                GPU_COUNT_LABEL: str(node_type.gpus),
                GPU_MEMORY_LABEL: str(node_type.gpu_memory_mib),
                "nvidia.com/gpu.present": "true",
            },
        },
        "spec": {
            "podCIDR": pod_cidr(index, network),
            "podCIDRs": [pod_cidr(index, network)],
            "taints": [{"key": GPU_TAINT_KEY, "value": "present", "effect": "NoSchedule"}],
        },
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "addresses": [
                {"type": "InternalIP", "address": node_ip(index)},
                {"type": "Hostname", "address": name},
            ],
        },
    }


def gpu_scheduling(product: str = H100.product) -> dict[str, Any]:
    """Pod spec fields that place a pod on the fake GPU nodes: node selector and toleration."""
    return {
        "nodeSelector": {GPU_PRODUCT_LABEL: product},
        "tolerations": [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
    }


def kwok_configuration(
    *, server_port: int, tls: tuple[str, str] | None = None, enable_crds: tuple[str, ...] = ()
) -> dict[str, Any]:
    """kwok's own configuration: which nodes it manages and where its server listens.

    The server is the fake kubelets' endpoint (`daemonEndpoints` of every node): with `tls`
    (certificate, key) the API server can reach it for `kubectl logs`.
    """
    options: dict[str, Any] = {
        "manageAllNodes": False,
        "manageNodesWithAnnotationSelector": f"{KWOK_ANNOTATION}={KWOK_ANNOTATION_VALUE}",
        "cidr": KWOK_DEFAULT_POD_CIDR,
        "nodeIP": "127.0.0.1",
        "serverAddress": f"127.0.0.1:{server_port}",
        "nodePort": server_port,
        "nodeLeaseDurationSeconds": 40,
    }
    if tls is not None:
        options["tlsCertFile"], options["tlsPrivateKeyFile"] = tls
    if enable_crds:
        options["enableCRDs"] = list(enable_crds)
    return {"apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration", "options": options}
