"""The profiling Job and the profile-cache ConfigMap against a real API server, controller manager and scheduler."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet.profiling_job import (
    LABEL_PROFILE_KEY,
    ProfileCache,
    ProfileJobSpec,
    build_profile_job,
    plan_request_for_pool,
    profile_cache_configmap,
    profile_flags,
    profile_key,
    resolve_architecture,
)
from cacheroute.planner.memory import parse_vllm_log, plan_memory
from cacheroute.sandbox import nodes
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

H100_LABEL = "NVIDIA-H100-80GB-HBM3"
LOG = (
    "INFO Model loading took 33.85 GiB memory and 40.1 seconds\n"
    "INFO Free memory on device (77.70/79.11 GiB) on startup. Desired GPU memory utilization is (0.9, 71.2 GiB). "
    "Actual usage is 35.80 GiB for consumed memory (weights + non-torch), 1.25 GiB for peak activation, and "
    "0.41 GiB for CUDAGraph memory. Current kv cache memory in use is 32.10 GiB.\n"
)


def profiling_job(namespace: str) -> tuple[str, dict[str, Any]]:
    spec = InferencePoolSpec.model_validate(
        {"model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "fp8"}, "tensorParallelSize": 2}
    )
    plan = plan_memory(plan_request_for_pool(spec, resolve_architecture(spec)))
    key = profile_key(spec.model.name, spec.engine.image, H100_LABEL, 2, plan.max_num_batched_tokens)
    job = build_profile_job(
        ProfileJobSpec(
            pool="llama",
            namespace=namespace,
            model=spec.model.name,
            image=spec.engine.image,
            gpu_product=H100_LABEL,
            tp=2,
            flags=profile_flags(plan),
            key=key,
        )
    )
    return key, job


def test_profiling_job_is_accepted_and_its_pod_lands_on_an_h100_with_two_gpus(kube_api: Any, namespace: str) -> None:
    key, job = profiling_job(namespace)
    assert nodes.GPU_PRODUCT_LABEL in job["spec"]["template"]["spec"]["nodeSelector"]
    client.BatchV1Api(kube_api).create_namespaced_job(namespace, job)
    core = client.CoreV1Api(kube_api)
    selector = f"{LABEL_PROFILE_KEY}={key}"

    def scheduled() -> bool:
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
        return bool(pods) and bool(pods[0].spec.node_name)

    wait_for(scheduled, timeout=60, what="the profiling pod to be scheduled")
    pod = core.list_namespaced_pod(namespace, label_selector=selector).items[0]
    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels[nodes.GPU_PRODUCT_LABEL] == H100_LABEL
    container = pod.spec.containers[0]
    assert container.resources.limits[nodes.GPU_RESOURCE] == "2"
    assert any(m.mount_path == "/dev/shm" for m in container.volume_mounts)
    assert container.args[:2] == ["vllm", "serve"]


def test_profile_cache_survives_a_configmap_round_trip(kube_api: Any, namespace: str) -> None:
    cache = ProfileCache()
    profile = parse_vllm_log(LOG)
    cache.put("mp-0123456789abcdef0123", profile, datetime(2026, 1, 1, tzinfo=UTC), inputs={"tp": "2"})
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_config_map(namespace, profile_cache_configmap(namespace, cache))
    stored = core.read_namespaced_config_map("cacheroute-memory-profiles", namespace)
    restored, bad = ProfileCache.from_configmap_data(stored.data)
    assert bad == []
    assert restored.get("mp-0123456789abcdef0123") == profile
