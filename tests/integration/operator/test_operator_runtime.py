"""The objects the operator builds, run for real by the sandbox's pod runtime: vLLM emulators with the
operator's arguments and probes, and a router pod (picker + Envoy) that serves HTTP for the pool.

The other operator tests leave pods to kwok; this one checks that what the operator writes is what
the real commands take: args, downward-API addresses, the projected plan volume, the probes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from tests.support.operator import TEST_CONFIG, OperatorProcess, Pools
from tests.support.router import metric_value

pytestmark = pytest.mark.integration

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SPEC: dict[str, Any] = {
    "model": {"name": MODEL},
    "replicas": 2,
    "memory": {"maxModelLen": 8192},
    "router": {"replicas": 1},
    "engine": {"env": [{"name": "CACHEROUTE_EMULATOR_LOAD_SECONDS", "value": "1"}]},
}
# Short drains: the runtime honours preStop and grace periods.
CONFIG = {**TEST_CONFIG, "engine": {"drainSeconds": 1, "terminationGracePeriodSeconds": 5},
          "router": {**TEST_CONFIG["router"], "scrapeIntervalSeconds": 0.2}}


def test_the_pool_runs_and_serves_http_through_its_router(
    operator_kubeconfig: Path, sandbox: Any, kube_api: Any, runtime_namespace: str, tmp_path: Path
) -> None:
    ns = runtime_namespace
    operator = OperatorProcess(ns, operator_kubeconfig, tmp_path, config=CONFIG).start()
    pools = Pools(sandbox, ns)
    try:
        pools.create("llama", SPEC)
        pools.await_condition("llama", "Ready", "True", timeout=240)
        status = (pools.get("llama") or {})["status"]
        engines = {d["address"]: d["id"] for d in status["destinations"]}
        assert len(engines) == 2 and all(d["ready"] for d in status["destinations"])

        core = client.CoreV1Api(kube_api)
        [router_pod] = core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=router").items
        url = f"http://{router_pod.status.pod_ip}:8080"
        for user in ("alice", "bob", "carol", "dave", "erin", "frank"):
            reply = httpx.post(f"{url}/v1/completions",
                               json={"model": MODEL, "prompt": "hello " * 20, "max_tokens": 2, "user": user},
                               timeout=30)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == MODEL
        # The engines (emulated vLLM, run with the operator's arguments) served them.
        served = sum(
            metric_value(httpx.get(f"http://{address}/metrics", timeout=5).text, "vllm:request_success_total")
            for address in engines
        )
        assert served == 6
        # Envoy's health listener answers the probes; the picker reports the plan it loaded.
        assert httpx.get(f"http://{router_pod.status.pod_ip}:8081/ready", timeout=5).status_code == 200
        metrics = httpx.get(f"http://{router_pod.status.pod_ip}:9090/metrics", timeout=5).text
        assert "cacheroute_router_plan_info" in metrics
    finally:
        pools.remove_all(timeout=120)
        operator.stop()
