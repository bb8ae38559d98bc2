"""The chart on the sandbox: install, the examples, upgrade, uninstall, with the operator really running.

The sandbox's pod runtime runs the chart's operator pods (the local `cacheroute operator run`
with the chart's arguments, config volume and the ServiceAccount's token), and the pools' vLLM
emulators and routers. The tests of this module share one release and run in the order of an
installation's life: install, RBAC, examples, upgrade, uninstall.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client

from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.crds import apply_crds
from tests.support import sandbox as testing
from tests.support.chart import SANDBOX_VALUES, Helm, adopt_crds, api_message, example_objects, server_side_apply
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


def test_the_examples_give_running_pools(installed: Installed, sandbox: Sandbox, kube_api: Any) -> None:
    ns = installed.namespace
    assert server_side_apply(kube_api, example_objects(ns), dry_run=False) == []
    pools = Pools(sandbox, ns)
    for name in ("llama-70b", "llama-8b"):
        pools.await_condition(name, "Ready", "True", timeout=300)
        status = (pools.get(name) or {})["status"]
        assert [d["ready"] for d in status["destinations"]] == [True] * 4
        assert status["memoryPlan"]["kvCapacityTokens"] > 0
    # The router serves the pool: an OpenAI request through Envoy and the picker to an emulated vLLM.
    [router, *_] = [p for p in client.CoreV1Api(kube_api).list_namespaced_pod(
        ns, label_selector="cacheroute.dev/pool=llama-8b,app.kubernetes.io/component=router").items if is_ready(p)]
    reply = httpx.post(f"http://{router.status.pod_ip}:8080/v1/completions", timeout=60, json={
        "model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hello " * 8, "max_tokens": 2, "user": "tenant-1"})
    assert reply.status_code == 200, reply.text
    # The GIE pool is published for gateways: the vLLM pods, our picker's ext_proc port.
    gie = client.CustomObjectsApi(kube_api).get_namespaced_custom_object(GIE_GROUP, "v1", ns, "inferencepools",
                                                                         "llama-8b")
    assert gie["spec"]["endpointPickerRef"]["name"] == "llama-8b-router"
    assert gie["spec"]["endpointPickerRef"]["port"] == {"number": 9002}


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
