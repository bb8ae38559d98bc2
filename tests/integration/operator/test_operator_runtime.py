"""The objects the operator builds, run for real by the sandbox's pod runtime: vLLM emulators with the
operator's arguments and probes, and a router pod (picker + Envoy) that serves HTTP for the pool.

The other operator tests leave pods to kwok; this one checks that what the operator writes is what
the real commands take: args, downward-API addresses, the projected plan volume, the probes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from tests.support.operator import TEST_CONFIG, OperatorProcess, Pools, until
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
          "router": {**TEST_CONFIG["router"], "scrapeIntervalSeconds": 0.2, "drainSeconds": 1}}


def stream_across_a_router_stop(url: str, stop: Callable[[], None]) -> tuple[list[str], int]:
    """Stream a long completion through the router, call `stop` once the first chunk is in, and
    read to the end: (every data line, how many came after `stop`)."""
    lines: list[str] = []
    after = -1
    body = {"model": MODEL, "prompt": "tell a long story " * 10, "max_tokens": 1500, "stream": True,
            "user": "streamer"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if after < 0:
                stop()
                after = 0
            else:
                after += 1
    return lines, after


def test_the_pool_runs_and_serves_http_through_its_router_which_finishes_its_streams_when_stopped(
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
        # With its Envoy's statistics, read through the admin socket both containers mount: the
        # six requests answered on the client listener.
        assert metric_value(metrics, "cacheroute_router_envoy_up") == 1
        assert metric_value(metrics, "envoy_http_downstream_rq_xx", envoy_http_conn_manager_prefix="ingress",
                            envoy_response_code_class="2") == 6

        # A router pod deleted mid-stream (a rollout, a drain) finishes the stream before it stops.
        name = router_pod.metadata.name
        lines, after = stream_across_a_router_stop(url, lambda: core.delete_namespaced_pod(name, ns))
        assert lines[-1] == "data: [DONE]" and after > 10, (after, lines[-3:])
        until(lambda: not any(p.metadata.name == name for p in core.list_namespaced_pod(ns).items),
              "the drained router pod gone", timeout=60)
    finally:
        pools.remove_all(timeout=120)
        operator.stop()
