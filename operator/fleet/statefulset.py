"""The StatefulSet of vLLM replicas: stable destination ids `<pool>-<ordinal>` survive restarts."""

from __future__ import annotations

import math
from typing import Any

from cacheroute.operator.api.common import parse_duration
from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.config import EngineDefaults
from cacheroute.operator.fleet import names
from cacheroute.operator.fleet.engine_args import engine_args
from cacheroute.planner.memory import MemoryPlan

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_TAINT_KEY = "nvidia.com/gpu"
CONTAINER = "vllm"


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": names.ENGINE_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def startup_failures(startup_timeout: str, period: int) -> int:
    """Failures the startup probe allows so that loading may take `engine.startupTimeout`."""
    return max(1, math.ceil(parse_duration(startup_timeout) / period))


def memory_request(plan: MemoryPlan, defaults: EngineDefaults) -> str:
    """The engine's host memory request: the configured one, or what a host KV tier needs when
    that is more (the tier is pinned memory the scheduler must find on the node)."""
    if not plan.host.bytes:
        return defaults.memory_request
    need_gib = math.ceil(plan.host.pod_memory_bytes / 2**30)
    return f"{need_gib}Gi" if need_gib > _gib(defaults.memory_request) else defaults.memory_request


def _gib(quantity: str) -> float:
    """GiB of a Kubernetes memory quantity in Gi/Mi/G/M or bytes (what the config accepts)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    try:
        for suffix in sorted(units, key=len, reverse=True):
            if quantity.endswith(suffix):
                return float(quantity[: -len(suffix)]) * units[suffix] / 2**30
        return float(quantity) / 2**30
    except ValueError:
        return 0.0  # a form this does not read: the tier's need wins


def engine_container(spec: InferencePoolSpec, plan: MemoryPlan, defaults: EngineDefaults) -> dict[str, Any]:
    gpus = str(spec.tensor_parallel_size)
    period = defaults.probe_period_seconds
    return {
        "name": CONTAINER,
        "image": spec.engine.image,
        "imagePullPolicy": defaults.image_pull_policy,
        "args": engine_args(spec, plan),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *[{"name": e.name, "value": e.value} for e in spec.engine.env],
        ],
        "ports": [{"name": names.ENGINE_PORT_NAME, "containerPort": spec.engine.port, "protocol": "TCP"}],
        "resources": {
            "requests": {
                spec.gpu.resource_name: gpus, "cpu": defaults.cpu_request, "memory": memory_request(plan, defaults)
            },
            "limits": {spec.gpu.resource_name: gpus},
        },
        # Loading a large model takes minutes: liveness and readiness only start once this passes.
        "startupProbe": _probe(defaults.liveness_path, period, startup_failures(spec.engine.startup_timeout, period)),
        # /health answers before the model can serve; the model list only once it is served.
        # Readiness decides when routers may send to the pod: checked at least every 5 s.
        "readinessProbe": _probe(defaults.readiness_path, min(period, 5), 3),
        "livenessProbe": _probe(defaults.liveness_path, period, 3),
        # Routers see the pod leave its EndpointSlice before vLLM stops taking requests.
        "lifecycle": {"preStop": {"sleep": {"seconds": defaults.drain_seconds}}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def build_statefulset(
    pool: names.PoolRef, spec: InferencePoolSpec, plan: MemoryPlan, defaults: EngineDefaults
) -> dict[str, Any]:
    labels = names.labels(pool, "engine")
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": names.metadata(pool, pool.statefulset, "engine"),
        "spec": {
            "serviceName": pool.headless_service,
            "replicas": spec.replicas,
            # Replicas start together (a GPU replica takes minutes to load); scale-down still
            # removes the highest ordinals and updates still go one pod at a time.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": names.selector(pool, "engine")},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(spec.engine.port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    # A Service named like an engine setting (vllm -> VLLM_PORT) would break vLLM.
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": defaults.termination_grace_period_seconds,
                    "nodeSelector": {GPU_PRODUCT_LABEL: spec.gpu.product},
                    "tolerations": [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [engine_container(spec, plan, defaults)],
                    "volumes": [
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": defaults.shm_size_limit}}
                    ],
                },
            },
        },
    }
