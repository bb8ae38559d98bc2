"""The chart on the sandbox: install, the examples, upgrade, uninstall, with the operator really running.

The sandbox's pod runtime runs the chart's operator pods (the local `cacheroute operator run`
with the chart's arguments, config volume and the ServiceAccount's token), and the pools' vLLM
emulators and routers. The tests of this module share one release and run in the order of an
installation's life: install, RBAC, examples, upgrade, uninstall.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client

from cacheroute.operator import runtime
from cacheroute.operator.api.peering import PEERING_FILE
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.fleet.cluster import Cluster
from cacheroute.planner.plan import affinity_key_hash
from cacheroute.sandbox.apierrors import api_message
from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.crds import adopt_crds, apply_crds, load_crds
from cacheroute.sandbox.process import StartError
from tests.support import sandbox as testing
from tests.support.chart import REPO, SANDBOX_VALUES, Helm, example_objects, server_side_apply
from tests.support.control import condition, get_plan, published_plan
from tests.support.gie import GROUP as GIE_GROUP
from tests.support.gie import gie_inferencepool_crd
from tests.support.operator import Pools, until

pytestmark = pytest.mark.integration

# Not `cacheroute`: the operator tests' own identity is the cluster-scoped ClusterRole
# `cacheroute-operator`, which a release of that name would collide with.
RELEASE = "chart-test"
OPERATOR = "chart-test-cacheroute-operator"  # <release>-<chart>-operator
OPERATOR_PODS = "app.kubernetes.io/instance=chart-test,app.kubernetes.io/component=operator"
OUR_CRDS = ("inferencepools.cacheroute.dev", "affinityplans.cacheroute.dev")
# The example plans re-plan every 5 minutes, the Auto one from 30 minutes of metrics. A plan applied
# with its pool finds no ready destination at its first period and tries again one period later;
# here every 10 s, the Auto one from the last 2 minutes, so that the test need not wait 5 minutes.
PLAN_TIMINGS = {"controlPeriod": "10s", "metricsWindow": "2m"}


@dataclass
class Installed:
    namespace: str
    values: dict[str, Any]
    helm: Helm
    uninstalled: bool = False
    notes: list[str] = field(default_factory=list)


def install_values(namespace: str, prometheus_url: str) -> dict[str, Any]:
    return {
        "operator.watch.allNamespaces": False,
        "operator.watch.namespaces": [namespace],
        "operator.statusIntervalSeconds": 1,
        "operator.readinessProbe": {"periodSeconds": 1},
        "prometheus.url": prometheus_url,
        # Short drains and probe periods: the pod runtime honours them as a kubelet would.
        "engine.probePeriodSeconds": 1,
        "engine.drainSeconds": 1,
        "engine.terminationGracePeriodSeconds": 5,
    }


@pytest.fixture(scope="module")
def installed(sandbox: Sandbox) -> Iterator[Installed]:
    api = sandbox.api_client()
    gie = gie_inferencepool_crd()
    # Another test may have just deleted it: a CRD being deleted cannot be created again yet.
    until(lambda: not _terminating_crd(api, gie["metadata"]["name"]), "the GIE CRD's earlier deletion", timeout=60)
    apply_crds(api, [gie])
    with testing.fresh_namespace(sandbox, "chart-install", pod_runtime=True) as namespace:
        # Earlier tests of the session may have applied crds/ by hand: the release adopts them.
        adopt_crds(api, RELEASE, namespace, OUR_CRDS)
        helm = Helm(sandbox, timeout=240)
        values = install_values(namespace, sandbox.prometheus.url)
        # The race a real install can lose: an operator replica starts before helm reaches the
        # peering object (custom resources come after Deployments) and creates it. The chart's
        # arguments make that object one helm adopts; without them the install fails on "exists".
        _create_peering_as_the_operator_would(api, helm, namespace, values)
        notes = helm.install(RELEASE, namespace, values, files=[SANDBOX_VALUES])
        state = Installed(namespace, values, helm, notes=[notes])
        try:
            yield state
        finally:
            pools = Pools(sandbox, namespace)
            plans = client.CustomObjectsApi(api)
            for plan in plans.list_namespaced_custom_object("cacheroute.dev", "v1alpha1", namespace,
                                                            "affinityplans")["items"]:
                with contextlib.suppress(client.ApiException):
                    plans.delete_namespaced_custom_object("cacheroute.dev", "v1alpha1", namespace, "affinityplans",
                                                          plan["metadata"]["name"])
            # With the operator still running, pools go through their finalizer; without, it is removed.
            pools.remove_all(timeout=5 if state.uninstalled else 120)
            if not state.uninstalled:
                with contextlib.suppress(Exception):
                    helm.uninstall(RELEASE, namespace)
            with contextlib.suppress(client.ApiException):
                client.ApiextensionsV1Api(api).delete_custom_resource_definition(gie["metadata"]["name"])


def _create_peering_as_the_operator_would(api: Any, helm: Helm, namespace: str, values: dict[str, Any]) -> None:
    deployment = next(o for o in helm.template(RELEASE, namespace, values, files=[SANDBOX_VALUES])
                      if o["kind"] == "Deployment" and o["metadata"]["name"] == OPERATOR)
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    def values_of(flag: str) -> list[str]:
        return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]

    options = runtime.RunOptions(
        namespaces=(namespace,), all_namespaces=False, peering=values_of("--peering")[0], standalone=False,
        priority=1, health_host="127.0.0.1", health_port=8080, config=OperatorConfig(),
        peering_labels=runtime.parse_pairs("peering-label", values_of("--peering-label")),
        peering_annotations=runtime.parse_pairs("peering-annotation", values_of("--peering-annotation")),
    )
    # As in a real install: helm puts the chart's crds/ (kopf's peering CRDs among them) first.
    apply_crds(api, load_crds([REPO / "crds" / PEERING_FILE]))
    runtime.ensure_peering(Cluster(api), options)


def _terminating_crd(api: Any, name: str) -> bool:
    try:
        crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(name)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return crd.metadata.deletion_timestamp is not None


def operator_pods(api: Any, namespace: str) -> list[Any]:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=OPERATOR_PODS).items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def test_install_runs_two_operators_under_the_charts_identity(installed: Installed, kube_api: Any) -> None:
    ns = installed.namespace
    assert f"kubectl -n {ns} rollout status deployment/{OPERATOR}" in installed.notes[0]
    deployment = client.AppsV1Api(kube_api).read_namespaced_deployment(OPERATOR, ns)
    assert deployment.status.ready_replicas == 2
    pods = operator_pods(kube_api, ns)
    assert len(pods) == 2 and all(is_ready(p) for p in pods)
    for pod in pods:
        assert pod.spec.service_account_name == OPERATOR
        # The real process answers on the pod IP (the chart's --health-address $(POD_IP):8080).
        base = f"http://{pod.status.pod_ip}:8080"
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        assert "cacheroute_operator_reconcile_passes_total" in httpx.get(f"{base}/metrics", timeout=5).text
    # Both replicas keep alive in the chart's KopfPeering, with distinct priorities: one acts.
    peering = client.CustomObjectsApi(kube_api).get_namespaced_custom_object(
        "kopf.dev", "v1", ns, "kopfpeerings", "cacheroute"
    )
    assert peering["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    until(lambda: {p.metadata.name for p in pods} <= set(_peering_status(kube_api, ns)), "both replicas peering")
    priorities = [entry["priority"] for entry in _peering_status(kube_api, ns).values()]
    assert len(set(priorities)) == len(priorities)


def _peering_status(api: Any, namespace: str) -> dict[str, Any]:
    body = client.CustomObjectsApi(api).get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings",
                                                                     "cacheroute")
    return dict(body.get("status") or {})


def _as_service_account(sandbox: Sandbox, namespace: str) -> Any:
    """An API client holding a token of the chart's ServiceAccount (what the operator pods mount)."""
    admin = sandbox.api_client()
    token = client.CoreV1Api(admin).create_namespaced_service_account_token(
        OPERATOR, namespace, {"spec": {"expirationSeconds": 600}}
    ).status.token
    configuration = client.Configuration()
    configuration.host = admin.configuration.host
    configuration.ssl_ca_cert = admin.configuration.ssl_ca_cert
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(configuration)


def test_the_charts_identity_is_refused_outside_the_operators_list(installed: Installed, sandbox: Sandbox) -> None:
    ns = installed.namespace
    api = _as_service_account(sandbox, ns)
    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    # Within the list: it works (so the token is good and a refusal below is RBAC's).
    core.list_namespaced_pod(ns)
    apps.list_namespaced_stateful_set(ns)
    refused: dict[str, Callable[[], Any]] = {
        "read Secrets": lambda: core.list_namespaced_secret(ns),
        "create a Secret": lambda: core.create_namespaced_secret(ns, {"metadata": {"name": "x"}}),
        "delete a StatefulSet": lambda: apps.delete_namespaced_stateful_set("llama", ns),
        "create a pod": lambda: core.create_namespaced_pod(
            ns, {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}),
        "edit its own ClusterRole": lambda: rbac.patch_cluster_role(OPERATOR, {"rules": []}),
    }
    for what, call in refused.items():
        with pytest.raises(client.ApiException) as denied:
            call()
        assert denied.value.status == 403, what
        assert f"system:serviceaccount:{ns}:{OPERATOR}" in api_message(denied.value), what


def _router_pods(api: Any, namespace: str, pool: str) -> list[Any]:
    pods = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"cacheroute.dev/pool={pool},app.kubernetes.io/component=router").items
    return [p for p in pods if p.metadata.deletion_timestamp is None and is_ready(p)]


def _ready_routers(api: Any, namespace: str, pool: str, count: int) -> list[Any]:
    """The pool's `count` router pods once all are ready: a plan, or the pool's Ready condition,
    can come before the last router replica is."""
    until(lambda: len(_router_pods(api, namespace, pool)) == count, f"{count} ready router pods of {pool}",
          timeout=120)
    return _router_pods(api, namespace, pool)


def _router_metrics(pod: Any) -> str:
    return httpx.get(f"http://{pod.status.pod_ip}:9090/metrics", timeout=10).text


def _await_ready_endpoints(pod: Any, count: int) -> None:
    """Until the router may pick `count` vLLM pods: a router pod is ready as soon as it knows its
    endpoints, and picks one only once it has scraped it (a request before that gets a 503)."""
    def ready() -> bool:
        return len(re.findall(r"^cacheroute_router_endpoint_ready\{[^}]*\} 1\.0$", _router_metrics(pod),
                              re.MULTILINE)) == count
    until(ready, f"router {pod.metadata.name} with {count} ready endpoints", timeout=60)


def examples(namespace: str) -> list[dict[str, Any]]:
    """examples/ as `kubectl apply -n NAMESPACE -f examples/` sends them, plan timings shortened."""
    objects = example_objects(namespace)
    plans = {o["metadata"]["name"]: o for o in objects if o["kind"] == "AffinityPlan"}
    assert {name: plan["spec"]["mode"] for name, plan in plans.items()} == {"llama-70b": "Auto", "llama-8b": "Manual"}
    for plan in plans.values():
        plan["spec"].update(PLAN_TIMINGS)
    return objects


def test_the_examples_give_running_pools(installed: Installed, sandbox: Sandbox, kube_api: Any) -> None:
    ns = installed.namespace
    assert server_side_apply(kube_api, examples(ns), dry_run=False) == []
    pools = Pools(sandbox, ns)
    for name in ("llama-70b", "llama-8b"):
        pools.await_condition(name, "Ready", "True", timeout=300)
        status = (pools.get(name) or {})["status"]
        assert [d["ready"] for d in status["destinations"]] == [True] * 4
        assert status["memoryPlan"]["kvCapacityTokens"] > 0
    # The router serves the pool: an OpenAI request through Envoy and the picker to an emulated vLLM.
    [router, *_] = _ready_routers(kube_api, ns, "llama-8b", 2)
    _await_ready_endpoints(router, 4)
    reply = httpx.post(f"http://{router.status.pod_ip}:8080/v1/completions", timeout=60, json={
        "model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hello " * 8, "max_tokens": 2, "user": "tenant-1"})
    assert reply.status_code == 200, reply.text
    # The picker runs the compiled request path, as from the image (the sandbox's copy stands for it).
    assert 'cacheroute_router_build_info{request_path="compiled"} 1.0' in _router_metrics(router)
    # The GIE pool is published for gateways: the vLLM pods, our picker's ext_proc port.
    gie = client.CustomObjectsApi(kube_api).get_namespaced_custom_object(GIE_GROUP, "v1", ns, "inferencepools",
                                                                         "llama-8b")
    assert gie["spec"]["endpointPickerRef"]["name"] == "llama-8b-router"
    assert gie["spec"]["endpointPickerRef"]["port"] == {"number": 9002}


def _plan_version_served(pod: Any) -> str | None:
    """The plan version a router pod follows (its `cacheroute_router_plan_info`)."""
    match = re.search(r'^cacheroute_router_plan_info\{[^}]*version="([0-9a-f]+)"', _router_metrics(pod), re.MULTILINE)
    return match.group(1) if match else None


def _decisions(pod: Any, outcome: str) -> float:
    match = re.search(rf'^cacheroute_router_decisions_total\{{outcome="{outcome}"\}} (\S+)$', _router_metrics(pod),
                      re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _await_applied(api: Any, namespace: str, name: str, timeout: float) -> dict[str, Any]:
    """The AffinityPlan once its condition Applied is True; on timeout, the conditions it had."""
    seen: dict[str, Any] = {}

    def applied() -> bool:
        seen.update(get_plan(api, namespace, name))
        return condition(seen, "Applied").get("status") == "True"

    try:
        until(applied, f"AffinityPlan {name} Applied", timeout=timeout)
    except StartError as exc:
        conditions = [(c["type"], c["status"], c.get("reason"), c.get("message"))
                      for c in (seen.get("status") or {}).get("conditions") or []]
        raise AssertionError(f"{exc}; its conditions: {conditions}") from None
    return seen


def _chat(pod: Any, model: str, key: str, turn: int, context: str | None = None) -> httpx.Response:
    """One chat turn of conversation `key`: a long system prompt the key's turns share (about
    `context`, by default the key), then a question."""
    about = context or key
    messages = [{"role": "system", "content": f"You answer for {about}. " + f"Context of {about}: lorem ipsum. " * 60},
                {"role": "user", "content": f"question {turn}"}]
    return httpx.post(f"http://{pod.status.pod_ip}:8080/v1/chat/completions", timeout=60,
                      headers={"x-affinity-key": key}, json={"model": model, "messages": messages, "max_tokens": 2})


def test_the_manual_example_plan_reaches_the_routers(installed: Installed, kube_api: Any) -> None:
    ns = installed.namespace
    plan = _await_applied(kube_api, ns, "llama-8b", timeout=120)
    assert condition(plan, "Planned")["reason"] == "PinnedRoutes"
    assert plan["status"]["admittedKeys"] == len(plan["spec"]["pinned"])
    published = published_plan(kube_api, ns, "llama-8b")
    assert published is not None
    # Exactly the reviewed routes, keys hashed.
    assert published.routes() == {affinity_key_hash(r["key"]): tuple(r["destinations"]) for r in plan["spec"]["pinned"]}
    version = plan["status"]["planVersion"]
    routers = _ready_routers(kube_api, ns, "llama-8b", 2)
    until(lambda: all(_plan_version_served(p) == version for p in routers), f"both routers on plan {version}",
          timeout=120)
    # A pinned key is routed by the plan, not by p2c.
    _await_ready_endpoints(routers[0], 4)
    before = _decisions(routers[0], "planned")
    reply = _chat(routers[0], "meta-llama/Llama-3.1-8B-Instruct", plan["spec"]["pinned"][0]["key"], 0)
    assert reply.status_code == 200, reply.text
    assert _decisions(routers[0], "planned") == before + 1


def test_the_auto_example_plan_plans_from_real_traffic(installed: Installed, sandbox: Sandbox, kube_api: Any) -> None:
    """Requests through the pool's router, their metrics in the sandbox Prometheus, the operator's
    control loop plans from them, publishes, and the routers follow the plan."""
    ns = installed.namespace
    routers = _ready_routers(kube_api, ns, "llama-70b", 2)
    for router in routers:
        _await_ready_endpoints(router, 4)
    keys = [f"tenant-{i}" for i in range(6)]
    turns = [(routers[(i + t) % 2], key, t) for t in range(4) for i, key in enumerate(keys)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda a: _chat(a[0], "meta-llama/Llama-3.3-70B-Instruct", a[1], a[2]), turns))
    assert [r.status_code for r in replies] == [200] * len(turns), [r.text for r in replies if r.status_code != 200]
    plan = _await_applied(kube_api, ns, "llama-70b", timeout=240)
    status = plan["status"]
    assert condition(plan, "MetricsAvailable")["status"] == "True"
    assert condition(plan, "Planned")["reason"] == "PlanComputed"
    published = published_plan(kube_api, ns, "llama-70b")
    assert published is not None and len(published) > 0
    # The plan routes the keys that were sent (hashed), to the pool's destinations.
    assert set(published.routes()) <= {affinity_key_hash(k) for k in keys}
    assert {d.id for d in published.destinations} == {f"llama-70b-{i}" for i in range(4)}
    assert status["admittedKeys"] == len(published) and 0 < status["coveredRequestShare"] <= 1
    assert 0 <= status["predictedKvHit"] <= 1
    assert status["observedKvHit"] is not None
    # The routers follow the version in status (a later period may have published a newer one).
    until(lambda: all(_plan_version_served(p) == get_plan(kube_api, ns, "llama-70b")["status"]["planVersion"]
                      for p in routers), "both routers on the published plan", timeout=120)
    planned_key = next(k for k in keys if published.destinations_of(affinity_key_hash(k)))
    before = _decisions(routers[0], "planned")
    # A new conversation of the key: an earlier one's prompt would be followed to wherever the
    # router sent it before the plan (outcome "followed"), which is not what this checks.
    reply = _chat(routers[0], "meta-llama/Llama-3.3-70B-Instruct", planned_key, 9, context=f"{planned_key}, anew")
    assert reply.status_code == 200, reply.text
    assert _decisions(routers[0], "planned") == before + 1


def _picker_args(api: Any, namespace: str, pool: str) -> list[str]:
    deployment = client.AppsV1Api(api).read_namespaced_deployment(f"{pool}-router", namespace)
    [picker] = [c for c in deployment.spec.template.spec.containers if c.name == "picker"]
    return list(picker.args)


def test_upgrade_with_a_changed_value_rolls_the_operator(installed: Installed, kube_api: Any) -> None:
    ns = installed.namespace
    before = {p.metadata.name for p in operator_pods(kube_api, ns)}
    assert "--log-level" in _picker_args(kube_api, ns, "llama-8b")
    installed.helm.upgrade(RELEASE, ns, {**installed.values, "router.logLevel": "debug"}, files=[SANDBOX_VALUES])
    until(lambda: len(operator_pods(kube_api, ns)) == 2 and all(is_ready(p) for p in operator_pods(kube_api, ns))
          and not before & {p.metadata.name for p in operator_pods(kube_api, ns)},
          "two new operator pods, ready", timeout=180)
    configmap = client.CoreV1Api(kube_api).read_namespaced_config_map(OPERATOR, ns)
    assert yaml.safe_load(configmap.data["operator.yaml"])["router"]["logLevel"] == "debug"
    # The new operator applies the new default to the pools' routers.
    until(lambda: _after(_picker_args(kube_api, ns, "llama-8b"), "--log-level") == "debug",
          "the routers' picker at --log-level debug", timeout=120)


def _after(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_uninstall_keeps_the_crds_and_the_users_resources(installed: Installed, kube_api: Any) -> None:
    ns = installed.namespace
    installed.helm.uninstall(RELEASE, ns)
    installed.uninstalled = True
    core, apps = client.CoreV1Api(kube_api), client.AppsV1Api(kube_api)
    rbac, custom = client.RbacAuthorizationV1Api(kube_api), client.CustomObjectsApi(kube_api)
    gone: dict[str, Callable[[], Any]] = {
        "Deployment": lambda: apps.read_namespaced_deployment(OPERATOR, ns),
        "ConfigMap": lambda: core.read_namespaced_config_map(OPERATOR, ns),
        "ServiceAccount": lambda: core.read_namespaced_service_account(OPERATOR, ns),
        "ClusterRole": lambda: rbac.read_cluster_role(OPERATOR),
        "ClusterRoleBinding": lambda: rbac.read_cluster_role_binding(OPERATOR),
        "PodDisruptionBudget": lambda: client.PolicyV1Api(kube_api).read_namespaced_pod_disruption_budget(OPERATOR, ns),
        "KopfPeering": lambda: custom.get_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings", "cacheroute"),
    }
    for kind, read in gone.items():
        with pytest.raises(client.ApiException) as missing:
            read()
        assert missing.value.status == 404, kind
    until(lambda: not operator_pods(kube_api, ns), "the operator's pods gone", timeout=120)
    # Kept: the CRDs, the user's pools and plans, and what the pools own.
    crds = client.ApiextensionsV1Api(kube_api)
    for name in (*OUR_CRDS, "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
        crds.read_custom_resource_definition(name)
    pools = custom.list_namespaced_custom_object("cacheroute.dev", "v1alpha1", ns, "inferencepools")["items"]
    assert sorted(p["metadata"]["name"] for p in pools) == ["llama-70b", "llama-8b"]
    plans = custom.list_namespaced_custom_object("cacheroute.dev", "v1alpha1", ns, "affinityplans")["items"]
    assert sorted(p["metadata"]["name"] for p in plans) == ["llama-70b", "llama-8b"]
    assert apps.read_namespaced_stateful_set("llama-70b", ns).status.ready_replicas == 4
