"""Profiled memory mode through the production path: the Job runs on an H100 node, the operator
reads vLLM's log through the API (here the container's termination message, written as the kubelet
does it), pins the parsed result and caches it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet.profiling_job import (
    LABEL_PROFILE_KEY,
    PROFILE_CACHE_CONFIGMAP,
    plan_request_for_pool,
    resolve_architecture,
)
from cacheroute.planner.memory import parse_vllm_log, plan_from_profile, plan_memory
from cacheroute.sandbox import nodes
from tests.integration.operator.conftest import Fleet
from tests.support.operator import LLAMA_70B_FP8_TP2, until

pytestmark = pytest.mark.integration

# What vLLM prints at startup for Llama-3.3-70B FP8 at TP 2 on an H100 (both ranks), in the
# wording of current releases.
LOG = """\
(EngineCore_DP0 pid=212) INFO Chunked prefill is enabled with max_num_batched_tokens=2048.
(Worker_TP0 pid=301) INFO Model loading took 33.85 GiB memory and 40.1 seconds
(Worker_TP1 pid=302) INFO Model loading took 33.85 GiB memory and 40.3 seconds
(Worker_TP0 pid=301) INFO Available KV cache memory: 38.02 GiB
(Worker_TP1 pid=302) INFO Available KV cache memory: 38.04 GiB
(EngineCore_DP0 pid=212) INFO GPU KV cache size: 249,167 tokens
(EngineCore_DP0 pid=212) INFO Maximum concurrency for 131,072 tokens per request: 1.90x
(Worker_TP0 pid=301) INFO Graph capturing finished in 12 secs, took 0.41 GiB
(Worker_TP0 pid=301) INFO Free memory on device (78.61/79.11 GiB) on startup. Desired GPU memory utilization is (0.9, 71.2 GiB). Actual usage is 35.80 GiB for consumed memory (weights + non-torch), 1.25 GiB for peak activation, and 0.41 GiB for CUDAGraph memory. Current kv cache memory in use is 38.02 GiB.
(Worker_TP1 pid=302) INFO Free memory on device (78.61/79.11 GiB) on startup. Desired GPU memory utilization is (0.9, 71.2 GiB). Actual usage is 35.78 GiB for consumed memory (weights + non-torch), 1.25 GiB for peak activation, and 0.41 GiB for CUDAGraph memory. Current kv cache memory in use is 38.04 GiB.
"""  # noqa: E501 - vLLM's lines, verbatim

SPEC = {**LLAMA_70B_FP8_TP2, "replicas": 2, "memory": {"mode": "Profiled"}}


def write_termination_message(core: client.CoreV1Api, pod: Any, message: str) -> None:
    """What the kubelet does when the container ends: its termination message goes into the pod status."""
    statuses = []
    for cs in pod.status.container_statuses:
        item = client.ApiClient().sanitize_for_serialization(cs)
        item["state"]["terminated"]["message"] = message
        statuses.append(item)
    body = {"status": {"containerStatuses": statuses}}
    core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)


def test_profiled_pool_runs_its_job_on_an_h100_and_pins_the_parsed_plan(fleet: Fleet, kube_api: Any) -> None:
    core, batch, apps = client.CoreV1Api(kube_api), client.BatchV1Api(kube_api), client.AppsV1Api(kube_api)
    created = fleet.pools.create("llama", SPEC)
    fleet.pools.await_condition("llama", "MemoryPlanned", "Unknown", "Profiling")

    jobs: list[Any] = []
    until(lambda: bool(jobs.__setitem__(slice(None), batch.list_namespaced_job(fleet.namespace).items) or jobs),
          "the profiling Job")
    job = jobs[0]
    assert [o.uid for o in job.metadata.owner_references] == [created["metadata"]["uid"]]
    key = job.metadata.labels[LABEL_PROFILE_KEY]
    selector = f"{LABEL_PROFILE_KEY}={key}"
    # No replica starts before the plan is measured.
    assert not apps.list_namespaced_stateful_set(fleet.namespace).items

    def finished_pod() -> Any:
        pods = core.list_namespaced_pod(fleet.namespace, label_selector=selector).items
        return next((p for p in pods if p.spec.node_name and p.status.phase == "Succeeded"), None)

    until(lambda: finished_pod() is not None, "the profiling pod to run and finish on a node", timeout=90)
    pod = finished_pod()
    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels[nodes.GPU_PRODUCT_LABEL] == "NVIDIA-H100-80GB-HBM3"
    assert pod.spec.containers[0].resources.limits[nodes.GPU_RESOURCE] == "2"
    write_termination_message(core, pod, LOG)

    fleet.pools.await_condition("llama", "MemoryPlanned", "True", "Planned", timeout=120)
    status = (fleet.pools.get("llama") or {})["status"]
    spec = InferencePoolSpec.model_validate(SPEC)
    request = plan_request_for_pool(spec, resolve_architecture(spec))
    expected = plan_from_profile(request, parse_vllm_log(LOG), plan_memory(request).max_num_batched_tokens)
    assert status["memoryPlan"]["source"] == "Profiled"
    assert status["memoryPlan"]["kvCacheMemoryBytes"] == expected.kv_cache_memory_bytes
    assert status["memoryPlan"]["inputs"]["profileKey"] == key

    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)
    sts = apps.read_namespaced_stateful_set("llama", fleet.namespace)
    args = sts.spec.template.spec.containers[0].args
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(expected.kv_cache_memory_bytes)

    cache = core.read_namespaced_config_map(PROFILE_CACHE_CONFIGMAP, fleet.namespace)
    entry = json.loads(cache.data[f"{key}.json"])
    assert entry["profile"]["weights_gib"] == 33.85
    assert fleet.operator.events("ProfilingStarted", "llama")

    # Scaling is not an input of the memory plan: the cached profile serves, no new boot.
    fleet.pools.patch_spec("llama", {"replicas": 3})
    until(lambda: len((fleet.pools.get("llama") or {})["status"]["destinations"]) == 3, "a third destination")
    assert len(batch.list_namespaced_job(fleet.namespace).items) == 1
    # A longer context is: the plan is measured again, with its own Job.
    fleet.pools.patch_spec("llama", {"memory": {"mode": "Profiled", "maxModelLen": 32768}})
    until(lambda: len(batch.list_namespaced_job(fleet.namespace).items) == 2, "a second profiling Job")
