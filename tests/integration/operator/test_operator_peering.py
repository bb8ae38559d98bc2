"""Several operator processes: only the highest-priority one acts; a killed one restarts cleanly."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from cacheroute.operator import runtime
from cacheroute.operator.api.peering import PEERING_FILE
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.fleet.cluster import Cluster
from cacheroute.sandbox.crds import apply_crds, load_crds
from tests.support.chart import REPO
from tests.support.operator import LLAMA_70B_FP8_TP2, OperatorProcess, Pools, sleep_observing, until

pytestmark = pytest.mark.integration

OWNED = "app.kubernetes.io/managed-by=cacheroute"


def handled(operator: OperatorProcess, pool: str) -> bool:
    """Whether this process ran a handler for the pool (kopf logs each run against the object)."""
    return any(r.get("object", "").endswith(f"/{pool}") and "Handler" in r.get("msg", "") for r in operator.records())


def owned_counts(kube_api: Any, namespace: str) -> Counter[str]:
    core, apps = client.CoreV1Api(kube_api), client.AppsV1Api(kube_api)
    policy, rbac = client.PolicyV1Api(kube_api), client.RbacAuthorizationV1Api(kube_api)
    listings = {
        "StatefulSet": apps.list_namespaced_stateful_set(namespace, label_selector=OWNED).items,
        "Deployment": apps.list_namespaced_deployment(namespace, label_selector=OWNED).items,
        "Service": core.list_namespaced_service(namespace, label_selector=OWNED).items,
        "ConfigMap": core.list_namespaced_config_map(namespace, label_selector=OWNED).items,
        "ServiceAccount": core.list_namespaced_service_account(namespace, label_selector=OWNED).items,
        "PodDisruptionBudget": policy.list_namespaced_pod_disruption_budget(namespace, label_selector=OWNED).items,
        "Role": rbac.list_namespaced_role(namespace, label_selector=OWNED).items,
        "RoleBinding": rbac.list_namespaced_role_binding(namespace, label_selector=OWNED).items,
    }
    return Counter({kind: len(items) for kind, items in listings.items()})


def per_pool(pools: int) -> Counter[str]:
    return Counter(
        StatefulSet=pools, Deployment=pools, Service=2 * pools, ConfigMap=pools, ServiceAccount=pools,
        PodDisruptionBudget=2 * pools, Role=pools, RoleBinding=pools,
    )


def test_two_operators_only_the_higher_priority_one_acts_and_the_other_takes_over(
    operator_kubeconfig: Path, pools: Pools, namespace: str, tmp_path: Path, kube_api: Any
) -> None:
    high = OperatorProcess(namespace, operator_kubeconfig, tmp_path, name="high", priority="200", identity="op-high")
    low = OperatorProcess(namespace, operator_kubeconfig, tmp_path, name="low", priority="100", identity="op-low")
    high.start()
    low.start()
    try:
        custom = client.CustomObjectsApi(kube_api)

        def peers() -> set[str]:
            peering = custom.get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", "cacheroute")
            return set((peering.get("status") or {}).keys())

        # Both keep alive in the namespace's peering object; the lower priority one stays paused.
        until(lambda: peers() >= {"op-high", "op-low"}, "both operators in the peering object", timeout=60)
        pools.create("llama", LLAMA_70B_FP8_TP2)
        pools.await_condition("llama", "Ready", "True", timeout=120)
        assert high.events("MemoryPlanned", "llama")
        assert not handled(low, "llama") and not low.events("MemoryPlanned")

        apps = client.AppsV1Api(kube_api)
        generation = apps.read_namespaced_stateful_set("llama", namespace).metadata.generation
        ready_since = pools.condition("llama", "Ready")

        def steady() -> None:
            assert owned_counts(kube_api, namespace) == per_pool(1)
            assert apps.read_namespaced_stateful_set("llama", namespace).metadata.generation == generation
            assert pools.condition("llama", "Ready") == ready_since
            assert not handled(low, "llama")

        # Several status ticks and a resync of the active operator: no duplicate, no flapping.
        sleep_observing(high.resync + 2, steady)

        high.stop()
        until(lambda: any("Resuming operations" in r.get("msg", "") for r in low.records()),
              "the standby to resume", timeout=90)
        core = client.CoreV1Api(kube_api)
        core.delete_namespaced_service("llama", namespace)
        until(lambda: bool(core.list_namespaced_service(namespace, field_selector="metadata.name=llama").items),
              "the standby to repair the deleted Service", timeout=low.resync + 30)
        assert handled(low, "llama")
        assert owned_counts(kube_api, namespace) == per_pool(1)
        # What the first operator told (the status holds it) is not told again by the second.
        assert not low.events("MemoryPlanned", "llama") and not low.events("Ready", "llama")
    finally:
        pools.remove_all()
        low.stop()
        high.stop()


def test_two_operators_started_at_once_never_both_act(
    operator_kubeconfig: Path, pools: Pools, namespace: str, tmp_path: Path, kube_api: Any
) -> None:
    # Pools already there: whichever replica resumes first has work at once, as after a reinstall.
    for name in ("a", "b", "c"):
        pools.create(name, {**LLAMA_70B_FP8_TP2, "replicas": 1})
    high = OperatorProcess(namespace, operator_kubeconfig, tmp_path, name="high", priority="200", identity="op-high")
    low = OperatorProcess(namespace, operator_kubeconfig, tmp_path, name="low", priority="100", identity="op-low")
    low.start(wait=False)
    high.start(wait=False)
    try:
        for name in ("a", "b", "c"):
            pools.await_condition(name, "Ready", "True", timeout=120)
        assert all(high.events("MemoryPlanned", name) for name in ("a", "b", "c"))
        assert not any(handled(low, name) for name in ("a", "b", "c")), "the standby acted"
        assert not low.events("MemoryPlanned")
    finally:
        pools.remove_all()
        low.stop()
        high.stop()


SMALL = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "replicas": 1, "router": {"replicas": 1}}


def test_sigkill_mid_reconcile_then_restart_converges_without_duplicates(
    operator_kubeconfig: Path, pools: Pools, namespace: str, tmp_path: Path, kube_api: Any
) -> None:
    count = 12
    first = OperatorProcess(namespace, operator_kubeconfig, tmp_path, name="first", identity="op-1").start()
    restarted: OperatorProcess | None = None
    try:
        for i in range(count):
            pools.create(f"p{i}", SMALL)
        apps = client.AppsV1Api(kube_api)
        until(lambda: bool(apps.list_namespaced_stateful_set(namespace, label_selector=OWNED).items),
              "the first StatefulSet", timeout=60, interval=0.02)
        first.kill()
        at_kill = owned_counts(kube_api, namespace)
        # The kill landed while pools were still being reconciled.
        assert at_kill != per_pool(count), at_kill

        # Same identity: a restarted container of the same pod takes over its own peering entry.
        restarted = OperatorProcess(namespace, operator_kubeconfig, tmp_path, name="restarted", identity="op-1").start()
        for i in range(count):
            pools.await_condition(f"p{i}", "Ready", "True", timeout=180)
        assert owned_counts(kube_api, namespace) == per_pool(count)
        core = client.CoreV1Api(kube_api)
        engines = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=engine").items
        assert sorted(p.metadata.name for p in engines) == sorted(f"p{i}-0" for i in range(count))
    finally:
        pools.remove_all()
        if restarted is not None:
            restarted.stop()
        if first.alive():
            first.stop()


def test_an_operator_waits_for_the_peering_object_its_chart_creates(namespace: str, kube_api: Any) -> None:
    """Helm creates the peering object after the operator's Deployment: a replica that starts first
    waits for it instead of creating it (which made `helm install` fail on "already exists"), and
    creates it itself only when nobody does within the wait."""
    # As a chart install does first: kopf's peering CRDs.
    apply_crds(kube_api, load_crds([REPO / "crds" / PEERING_FILE]))
    custom = client.CustomObjectsApi(kube_api)

    def options(peering: str, wait: float) -> runtime.RunOptions:
        return runtime.RunOptions(
            namespaces=(namespace,), all_namespaces=False, peering=peering, standalone=False, priority=1,
            health_host="127.0.0.1", health_port=8080, config=OperatorConfig(),
            peering_labels={"created-by": "operator"}, peering_wait_s=wait,
        )

    waiting = threading.Thread(target=runtime.ensure_peering, args=(Cluster(kube_api), options("from-helm", 30.0)))
    waiting.start()
    # Helm's turn, a moment later.
    until(waiting.is_alive, "the operator waiting", timeout=5)
    custom.create_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
        "metadata": {"name": "from-helm", "labels": {"created-by": "helm"}},
    })
    waiting.join(timeout=30)
    assert not waiting.is_alive()
    found = custom.get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", "from-helm")
    assert found["metadata"]["labels"] == {"created-by": "helm"}
    # Nobody creates it: the operator does, after its wait.
    runtime.ensure_peering(Cluster(kube_api), options("nobody", 1.0))
    made = custom.get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", "nobody")
    assert made["metadata"]["labels"] == {"created-by": "operator"}
