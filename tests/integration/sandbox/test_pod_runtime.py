"""The pod runtime runs pods of the CacheRoute and vLLM images as a kubelet would.

Every pod here is created through a real controller (Deployment, StatefulSet) or directly, and
everything is observed through the API server, the pods' own endpoints and Prometheus.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import encode_plan
from cacheroute.sandbox import nodes
from cacheroute.sandbox.cluster import Sandbox
from tests.support.router import metric_value
from tests.support.sandbox import ScopedPrometheus, fresh_namespace, wait_for

pytestmark = pytest.mark.integration

CACHEROUTE_IMAGE = "ghcr.io/cacheroute/cacheroute:0.1.0"
VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
POD_ENV = [
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
]
# Run inside a pod: the projected service-account token against the API server, as a client would.
WHOAMI = """
import json, os, ssl, time, urllib.error, urllib.request
base = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(base + "/token").read()
ns = open(base + "/namespace").read()
tls = ssl.create_default_context(cafile=base + "/ca.crt")
api = "https://%s:%s" % (os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
for kind in ("configmaps", "secrets"):
    request = urllib.request.Request(api + "/api/v1/namespaces/%s/%s" % (ns, kind),
                                     headers={"Authorization": "Bearer " + token})
    try:
        status = urllib.request.urlopen(request, context=tls).status
    except urllib.error.HTTPError as exc:
        status = exc.code
    print(kind, status, flush=True)
time.sleep(3600)
"""


def pod_template(labels: dict[str, str], containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"labels": labels}, "spec": {**nodes.gpu_scheduling(), "containers": containers, **spec}}


def deployment(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "metadata": {"name": name},
        "spec": {
            "replicas": 1, "selector": {"matchLabels": labels}, "template": pod_template(labels, containers, **spec)
        },
    }


def emulated_vllm() -> dict[str, Any]:
    """A vLLM container (the sandbox emulates it) of two GPUs, ready when /health answers."""
    return {
        "name": "vllm", "image": VLLM_IMAGE,
        "env": [*POD_ENV, {"name": "CACHEROUTE_EMULATOR_LOAD_SECONDS", "value": "1"}],
        "args": ["meta-llama/Llama-3.3-70B-Instruct", "--host", "$(POD_IP)", "--port", "8000",
                 "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "8G", "--max-model-len", "8192"],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
        "resources": {"limits": {nodes.GPU_RESOURCE: "2"}},
    }


def pods_of(core: Any, namespace: str, app: str) -> list[Any]:
    return [p for p in core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
            if p.metadata.deletion_timestamp is None]


def ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def the_ready_pod(core: Any, namespace: str, app: str, timeout: float = 90) -> Any:
    wait_for(lambda: any(ready(p) for p in pods_of(core, namespace, app)), timeout=timeout, what=f"a Ready {app} pod")
    return next(p for p in pods_of(core, namespace, app) if ready(p))


def processes_of(uid: str) -> list[int]:
    """Processes whose working directory is the pod's directory (the runtime starts them there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if uid in os.readlink(entry / "cwd"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def plan_configmaps(core: Any, namespace: str, routes: dict[str, list[str]]) -> str:
    plan = plan_from_routes(
        "pool",
        [Destination("pool-0", "198.18.0.1:8000"), Destination("pool-1", "198.18.0.2:8000")],
        {affinity_key_hash(k): v for k, v in routes.items()},
    )
    payload = encode_plan(plan)
    for name, files in payload.configmaps.items():
        body = {"metadata": {"name": name},
                "binaryData": {f: base64.b64encode(payload.files[f]).decode() for f in files}}
        try:
            core.replace_namespaced_config_map(name, namespace, body)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            core.create_namespaced_config_map(namespace, body)
    return payload.version


def router_metrics(pod: Any) -> str:
    return httpx.get(f"http://{pod.status.pod_ip}:9090/metrics", timeout=5).text


def serves_plan(pod: Any, version: str) -> bool:
    return f'version="{version}"' in router_metrics(pod)


def test_router_pods_get_mounts_tokens_probes_and_logs(sandbox: Sandbox, kube_api: Any, runtime_namespace: str) -> None:
    ns = runtime_namespace
    core, apps = client.CoreV1Api(kube_api), client.AppsV1Api(kube_api)
    rbac = client.RbacAuthorizationV1Api(kube_api)
    first = plan_configmaps(core, ns, {"alice": ["pool-0"]})
    core.create_namespaced_config_map(ns, {"metadata": {"name": "switch"}, "data": {"ready": "yes"}})
    core.create_namespaced_service_account(ns, {"metadata": {"name": "router"}})
    rbac.create_namespaced_role(ns, {"metadata": {"name": "plans"}, "rules": [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]})
    rbac.create_namespaced_role_binding(ns, {
        "metadata": {"name": "plans"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "plans"},
        "subjects": [{"kind": "ServiceAccount", "name": "router", "namespace": ns}]})
    serve = ["router", "serve", "--grpc-host=$(POD_IP)", "--metrics-host=$(POD_IP)", "--scrape-interval=0"]

    # Plans through the API with the pod's own service account; readiness from gRPC health.
    apps.create_namespaced_deployment(ns, deployment("router-api", [
        {"name": "router", "image": CACHEROUTE_IMAGE, "env": POD_ENV,
         "args": [*serve, "--namespace=$(NS)", "--pool=pool"],
         "readinessProbe": {"grpc": {"port": 9002}, "periodSeconds": 1}},
        {"name": "whoami", "image": CACHEROUTE_IMAGE, "command": ["python", "-c", WHOAMI]},
    ], serviceAccountName="router"))
    # Plans from a mounted ConfigMap; readiness from a file of another mounted ConfigMap.
    apps.create_namespaced_deployment(ns, deployment("router-dir", [
        {"name": "router", "image": CACHEROUTE_IMAGE, "env": POD_ENV,
         "args": [*serve, "--plan-dir=/etc/cacheroute/plan"],
         "volumeMounts": [{"name": "plan", "mountPath": "/etc/cacheroute/plan", "readOnly": True},
                          {"name": "switch", "mountPath": "/etc/cacheroute/switch"}],
         "readinessProbe": {"exec": {"command": ["test", "-e", "/etc/cacheroute/switch/ready"]},
                            "periodSeconds": 1, "failureThreshold": 1}},
    ], volumes=[{"name": "plan", "configMap": {"name": "pool-plan"}},
                {"name": "switch", "configMap": {"name": "switch"}}]))
    core.create_namespaced_service(ns, {"metadata": {"name": "router-dir"},
                                        "spec": {"selector": {"app": "router-dir"}, "ports": [{"port": 9090}]}})

    api_pod = the_ready_pod(core, ns, "router-api")
    dir_pod = the_ready_pod(core, ns, "router-dir")
    assert api_pod.status.pod_ip != dir_pod.status.pod_ip
    for pod in (api_pod, dir_pod):
        assert f'version="{first}"' in router_metrics(pod)
    # The token works against the API server, with exactly the pod's RBAC.
    wait_for(lambda: "secrets" in core.read_namespaced_pod_log(api_pod.metadata.name, ns, container="whoami"),
             timeout=30, what="the whoami container's output")
    assert core.read_namespaced_pod_log(api_pod.metadata.name, ns, container="whoami").split() == [
        "configmaps", "200", "secrets", "403"
    ]
    # Container logs are served through the API (kwok's log server reads the runtime's files).
    assert "router ready" in core.read_namespaced_pod_log(dir_pod.metadata.name, ns, container="router")

    # A new plan reaches both: through the watch, and through the mounted volume's swap.
    second = plan_configmaps(core, ns, {"alice": ["pool-1"], "bob": ["pool-0"]})
    for pod in (api_pod, dir_pod):
        wait_for(functools.partial(serves_plan, pod, second), timeout=20, what="the new plan")
        assert metric_value(router_metrics(pod), "cacheroute_router_plan_routes") == 2
        assert metric_value(router_metrics(pod), "cacheroute_router_plan_loads_total", result="rejected") == 0

    # Readiness follows the probe, and the EndpointSlice controller follows readiness.
    discovery = client.DiscoveryV1Api(kube_api)

    def slice_ready() -> list[bool]:
        slices = discovery.list_namespaced_endpoint_slice(ns, label_selector="kubernetes.io/service-name=router-dir")
        return [bool(e.conditions.ready) for s in slices.items for e in s.endpoints or []]

    wait_for(lambda: slice_ready() == [True], timeout=30, what="a ready endpoint")
    core.patch_namespaced_config_map("switch", ns, {"data": {"ready": None, "other": "x"}})
    wait_for(lambda: not ready(core.read_namespaced_pod(dir_pod.metadata.name, ns)), timeout=20, what="NotReady")
    wait_for(lambda: slice_ready() == [False], timeout=20, what="the endpoint to turn unready")
    core.patch_namespaced_config_map("switch", ns, {"data": {"ready": "again"}})
    wait_for(lambda: ready(core.read_namespaced_pod(dir_pod.metadata.name, ns)), timeout=20, what="Ready again")

    # Deleting the Deployment stops the router's process and removes the pod.
    uid = dir_pod.metadata.uid
    assert processes_of(uid)
    apps.delete_namespaced_deployment("router-dir", ns)
    wait_for(lambda: not pods_of(core, ns, "router-dir") and not core.list_namespaced_pod(
        ns, label_selector="app=router-dir").items, timeout=30, what="the router-dir pod to go")
    assert processes_of(uid) == []


def test_vllm_pods_of_a_statefulset_are_emulated_scraped_and_counted_ready(
    sandbox: Sandbox, kube_api: Any, runtime_namespace: str, prometheus: ScopedPrometheus
) -> None:
    ns = runtime_namespace
    core, apps = client.CoreV1Api(kube_api), client.AppsV1Api(kube_api)
    labels = {"app": "pool"}
    template = pod_template(labels, [emulated_vllm()])
    template["metadata"]["annotations"] = {
        "prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}
    core.create_namespaced_service(ns, {"metadata": {"name": "pool"}, "spec": {
        "clusterIP": "None", "selector": labels, "ports": [{"name": "http", "port": 8000}]}})
    client.PolicyV1Api(kube_api).create_namespaced_pod_disruption_budget(ns, {
        "metadata": {"name": "pool"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}}})
    apps.create_namespaced_stateful_set(ns, {"metadata": {"name": "pool"}, "spec": {
        "serviceName": "pool", "replicas": 2, "selector": {"matchLabels": labels}, "template": template}})

    def statefulset_ready() -> int:
        return int(apps.read_namespaced_stateful_set("pool", ns).status.ready_replicas or 0)

    wait_for(lambda: statefulset_ready() == 2, timeout=90, what="two ready replicas")
    pods = {p.metadata.name: p for p in pods_of(core, ns, "pool")}
    assert set(pods) == {"pool-0", "pool-1"}
    wait_for(lambda: client.PolicyV1Api(kube_api).read_namespaced_pod_disruption_budget("pool", ns)
             .status.current_healthy == 2, timeout=30, what="the PDB to count two healthy pods")
    slices = client.DiscoveryV1Api(kube_api).list_namespaced_endpoint_slice(
        ns, label_selector="kubernetes.io/service-name=pool")
    addresses = {a for s in slices.items for e in s.endpoints or [] if e.conditions.ready for a in e.addresses}
    assert addresses == {p.status.pod_ip for p in pods.values()}

    url = f"http://{pods['pool-1'].status.pod_ip}:8000"
    for _ in range(2):
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "x " * 100, "max_tokens": 4}, timeout=30)
        assert reply.status_code == 200
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    result = prometheus.wait_for(
        f'vllm:prefix_cache_hits_total{{namespace="{ns}",pod="pool-1"}} > 0', timeout=30
    )
    assert float(result[0]["value"][1]) == 96
    assert result[0]["metric"]["job"] == "kubernetes-pods"
    running = prometheus.wait_for(f'vllm:num_requests_running{{namespace="{ns}"}}',
                                  accept=lambda r: len(r) == 2, timeout=30)
    assert {r["metric"]["pod"] for r in running} == {"pool-0", "pool-1"}

    apps.patch_namespaced_stateful_set_scale("pool", ns, {"spec": {"replicas": 0}})
    wait_for(lambda: not core.list_namespaced_pod(ns, label_selector="app=pool").items, timeout=60,
             what="the pods to go")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_restarts_follow_the_restart_policy_and_deletion_honours_the_grace_period(
    kube_api: Any, runtime_namespace: str
) -> None:
    ns = runtime_namespace
    core = client.CoreV1Api(kube_api)
    containers = [
        {"name": "crasher", "image": CACHEROUTE_IMAGE, "command": ["sh", "-c", "echo run; exit 3"]},
        {"name": "unhealthy", "image": CACHEROUTE_IMAGE, "command": ["sleep", "3600"],
         "livenessProbe": {"tcpSocket": {"port": 1}, "periodSeconds": 1, "failureThreshold": 1}},
        {"name": "stubborn", "image": CACHEROUTE_IMAGE,
         "command": ["sh", "-c", "trap 'echo ignoring TERM' TERM; while true; do sleep 0.1; done"]},
    ]
    core.create_namespaced_pod(ns, {"metadata": {"name": "restarts"}, "spec": {
        **nodes.gpu_scheduling(), "containers": containers, "terminationGracePeriodSeconds": 3,
        "initContainers": [{"name": "init", "image": CACHEROUTE_IMAGE, "command": ["false"]}]}})

    def statuses() -> dict[str, Any]:
        pod = core.read_namespaced_pod("restarts", ns)
        return {s.name: s for s in pod.status.container_statuses or []}

    wait_for(lambda: statuses()["crasher"].restart_count >= 2 and statuses()["unhealthy"].restart_count >= 1,
             timeout=60, what="restarts")
    # Init containers are reported done, not run (this one would fail).
    init = core.read_namespaced_pod("restarts", ns).status.init_container_statuses
    assert [(i.name, i.state.terminated.reason) for i in init] == [("init", "Completed")]
    crasher = statuses()["crasher"]
    assert crasher.last_state.terminated.exit_code == 3
    assert crasher.last_state.terminated.reason == "Error"
    assert statuses()["stubborn"].restart_count == 0
    assert statuses()["stubborn"].state.running is not None
    events = core.list_namespaced_event(ns, field_selector="involvedObject.name=restarts").items
    reasons = {e.reason for e in events}
    assert {"Started", "Killing", "Unhealthy", "BackOff"} <= reasons
    previous = core.read_namespaced_pod_log("restarts", ns, container="crasher", previous=True)
    assert previous.strip() == "run"

    uid = core.read_namespaced_pod("restarts", ns).metadata.uid
    wait_for(lambda: bool(processes_of(uid)), timeout=30, what="the pod's processes")
    started = time.monotonic()
    core.delete_namespaced_pod("restarts", ns)
    wait_for(lambda: not core.list_namespaced_pod(ns, field_selector="metadata.name=restarts").items,
             timeout=30, what="the pod to go")
    # The stubborn container ignores SIGTERM: it goes only with SIGKILL at the end of the grace period.
    assert time.monotonic() - started >= 2.5
    assert processes_of(uid) == []


def write_over_as_a_stale_kwok_stage(core: Any, pod: Any) -> None:
    """What kwok's stage for the runtime's pods writes, played once more from a stale copy of the pod.

    kwok queues a pod from its pod watch and again from the sync of a node it has just begun to
    manage; the second play, from the copy without an address, undoes the runtime's report.
    """
    not_ready = {"status": "False", "reason": "ContainersNotReady"}
    status = {
        "conditions": [{"type": "Ready", **not_ready}, {"type": "ContainersReady", **not_ready}],
        "containerStatuses": [
            {"name": c.name, "image": c.image, "ready": False, "started": False, "restartCount": 0,
             "state": {"waiting": {"reason": "ContainerCreating"}}}
            for c in pod.spec.containers
        ],
    }
    written = core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": status})
    assert not ready(written)


def test_a_pod_the_runtime_only_marks_ready_is_ready_again_after_a_stale_stage(kube_api: Any, namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    client.AppsV1Api(kube_api).create_namespaced_deployment(
        namespace, deployment("outside", [{"name": "vllm", "image": VLLM_IMAGE}]))
    pod = the_ready_pod(core, namespace, "outside")
    write_over_as_a_stale_kwok_stage(core, pod)
    wait_for(lambda: ready(core.read_namespaced_pod(pod.metadata.name, namespace)), timeout=15, what="Ready again")


def test_a_pod_the_runtime_runs_is_reported_again_after_a_stale_stage(kube_api: Any, runtime_namespace: str) -> None:
    ns = runtime_namespace
    core = client.CoreV1Api(kube_api)
    client.AppsV1Api(kube_api).create_namespaced_deployment(ns, deployment("engine", [emulated_vllm()]))
    pod = the_ready_pod(core, ns, "engine")
    write_over_as_a_stale_kwok_stage(core, pod)

    def running_and_ready() -> bool:
        now = core.read_namespaced_pod(pod.metadata.name, ns)
        return ready(now) and now.status.container_statuses[0].state.running is not None

    wait_for(running_and_ready, timeout=15, what="the container reported running and ready again")


def test_a_pod_deleted_while_the_api_server_hangs_goes_once_it_answers(
    sandbox: Sandbox, kube_api: Any, runtime_namespace: str
) -> None:
    ns = runtime_namespace
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(ns, {"metadata": {"name": "outlived"}, "spec": {
        **nodes.gpu_scheduling(), "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "c", "image": CACHEROUTE_IMAGE, "command": ["sleep", "3600"]}]}})
    wait_for(lambda: ready(core.read_namespaced_pod("outlived", ns)), timeout=60, what="the pod ready")
    log = sandbox.state_dir / "logs" / "pod-runtime.log"
    start = len(log.read_text())

    def told_unreachable() -> bool:
        return any(f"{ns}/outlived: " in line and "the API server did not answer" in line
                   for line in log.read_text()[start:].splitlines())

    core.delete_namespaced_pod("outlived", ns)
    sandbox.pause("kube-apiserver")
    try:
        # The runtime stops the container, then cannot write the pod's last status or remove it.
        wait_for(told_unreachable, timeout=90, what="the runtime finding the API server away")
    finally:
        sandbox.resume("kube-apiserver")
    told = [line for line in log.read_text()[start:].splitlines() if "outlived" in line]
    wait_for(lambda: not core.list_namespaced_pod(ns, field_selector="metadata.name=outlived").items,
             timeout=60, what=f"the pod to go once the API server answers (runtime: {told[-5:]})")
    assert "outlived: the runtime failed" not in log.read_text()[start:]


def _sleeper(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {
        **nodes.gpu_scheduling(), "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "c", "image": CACHEROUTE_IMAGE, "command": ["sleep", "3600"]}]}}


def _refuse_the_runtimes_pod_deletes(namespace: str) -> dict[str, Any]:
    """A webhook that fails every pod deletion the runtime makes in `namespace` (nothing listens at
    its address): the real API server then answers the runtime 500, as when it cannot act."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"refuse-removal-{namespace}"},
        "webhooks": [{
            "name": "refuse-removal.sandbox.cacheroute.dev",
            "clientConfig": {"url": "https://127.0.0.1:1/refuse"},
            "rules": [{"operations": ["DELETE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "matchConditions": [{"name": "the-runtime",
                                 "expression": "request.userInfo.username == 'cacheroute-pod-runtime'"}],
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 1,
        }],
    }


def _refusing(sandbox: Sandbox, namespace: str) -> bool:
    """Whether the webhook already fails the runtime's deletions (a dry run, as the runtime)."""
    from kubernetes import config

    as_runtime = config.new_client_from_config(config_file=str(sandbox.kubeconfig))
    as_runtime.set_default_header("Impersonate-User", "cacheroute-pod-runtime")
    as_runtime.set_default_header("Impersonate-Group", "system:masters")
    try:
        client.CoreV1Api(as_runtime).delete_namespaced_pod("refused", namespace, dry_run="All")
    except client.ApiException as exc:
        return bool(exc.status == 500)
    finally:
        as_runtime.close()
    return False


@pytest.mark.parametrize("runs_it", [True, False], ids=["run", "marked-ready-only"])
def test_a_pod_whose_removal_the_api_server_fails_goes_once_it_takes_it(
    sandbox: Sandbox, kube_api: Any, runs_it: bool
) -> None:
    core = client.CoreV1Api(kube_api)
    admission = client.AdmissionregistrationV1Api(kube_api)
    with fresh_namespace(sandbox, f"refused-removal-{runs_it}", pod_runtime=runs_it) as ns:
        core.create_namespaced_pod(ns, _sleeper("refused"))
        wait_for(lambda: ready(core.read_namespaced_pod("refused", ns)), timeout=60, what="the pod ready")
        log = sandbox.state_dir / "logs" / "pod-runtime.log"
        start = len(log.read_text())

        def told() -> list[str]:
            return [line for line in log.read_text()[start:].splitlines() if f"{ns}/refused" in line]

        webhook = _refuse_the_runtimes_pod_deletes(ns)
        admission.create_validating_webhook_configuration(webhook)
        try:
            wait_for(lambda: _refusing(sandbox, ns), timeout=30, what="the webhook in effect")
            core.delete_namespaced_pod("refused", ns)
            wait_for(lambda: any("not removed" in line for line in told()), timeout=60,
                     what="the runtime's removal refused")
        finally:
            admission.delete_validating_webhook_configuration(webhook["metadata"]["name"])
        wait_for(lambda: not core.list_namespaced_pod(ns, field_selector="metadata.name=refused").items,
                 timeout=60, what=f"the pod to go once the API server takes its removal (runtime: {told()[-5:]})")
        assert any("could not take it (500" in line for line in told()), told()


def _pods_come_and_go_in_new_namespaces(sandbox: Sandbox, core: Any, batch: int, count: int) -> None:
    with contextlib.ExitStack() as stack:
        spaces = [stack.enter_context(fresh_namespace(sandbox, f"many-{batch}-{i}", pod_runtime=True))
                  for i in range(count)]
        for ns in spaces:
            core.create_namespaced_pod(ns, _sleeper("p"))
        wait_for(lambda: all(ready(core.read_namespaced_pod("p", ns)) for ns in spaces), timeout=60,
                 what=f"the pods of batch {batch} ready")
        for ns in spaces:
            core.delete_namespaced_pod("p", ns)
        wait_for(lambda: not any(core.list_namespaced_pod(ns).items for ns in spaces), timeout=60,
                 what=f"the pods of batch {batch} gone")


def test_the_runtime_serves_pods_after_many_namespaces_came_and_went(sandbox: Sandbox, kube_api: Any) -> None:
    # Each namespace the runtime serves pods in takes connections to the API server for its
    # watches (ConfigMaps, Secrets); they must be given back when its pods are gone, or a sandbox
    # reused by a few test runs can no longer start a pod.
    core = client.CoreV1Api(kube_api)
    for batch in range(5):
        _pods_come_and_go_in_new_namespaces(sandbox, core, batch, 8)
    with fresh_namespace(sandbox, "many-last", pod_runtime=True) as ns:
        core.create_namespaced_pod(ns, _sleeper("p"))
        wait_for(lambda: ready(core.read_namespaced_pod("p", ns)), timeout=30, what="a pod after 40 namespaces ready")
