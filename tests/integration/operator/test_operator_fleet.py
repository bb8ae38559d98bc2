"""An InferencePool becomes a running, routable vLLM fleet: the operator against the sandbox.

Real API server, scheduler, controller manager and kwok H100 nodes; the operator runs as its own
process under the least-RBAC identity of `cacheroute.operator.rbac`.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet.profiling_job import plan_for_pool, resolve_architecture
from cacheroute.planner.plan_format import decode_plan
from cacheroute.sandbox import nodes
from cacheroute.sandbox.cluster import Sandbox
from tests.integration.operator.conftest import Fleet
from tests.support.operator import LLAMA_70B_FP8_TP2, OperatorProcess, Pools, observe_until, sleep_observing, until

pytestmark = pytest.mark.integration

ENGINE = "app.kubernetes.io/component=engine"
H100 = "NVIDIA-H100-80GB-HBM3"


def engine_pods(core: client.CoreV1Api, namespace: str, pool: str) -> list[Any]:
    pods = core.list_namespaced_pod(namespace, label_selector=f"cacheroute.dev/pool={pool},{ENGINE}").items
    return sorted((p for p in pods if p.metadata.deletion_timestamp is None), key=lambda p: p.metadata.name)


def contains_in_order(haystack: list[str], needle: list[str]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def destination_ids(fleet: Fleet, name: str) -> list[str]:
    status = (fleet.pools.get(name) or {}).get("status") or {}
    return [d["id"] for d in status.get("destinations") or []]


def owned_objects(kube_api: Any, namespace: str, name: str) -> dict[str, Any]:
    """Every object the contract says a pool owns, None where missing."""
    core, apps = client.CoreV1Api(kube_api), client.AppsV1Api(kube_api)
    policy, rbac = client.PolicyV1Api(kube_api), client.RbacAuthorizationV1Api(kube_api)
    readers: dict[str, Callable[[], Any]] = {
        "StatefulSet": lambda: apps.read_namespaced_stateful_set(name, namespace),
        "Service": lambda: core.read_namespaced_service(name, namespace),
        "PodDisruptionBudget": lambda: policy.read_namespaced_pod_disruption_budget(name, namespace),
        "RouterPodDisruptionBudget": lambda: policy.read_namespaced_pod_disruption_budget(f"{name}-router", namespace),
        "Deployment": lambda: apps.read_namespaced_deployment(f"{name}-router", namespace),
        "RouterService": lambda: core.read_namespaced_service(f"{name}-router", namespace),
        "ServiceAccount": lambda: core.read_namespaced_service_account(f"{name}-router", namespace),
        "Role": lambda: rbac.read_namespaced_role(f"{name}-router", namespace),
        "RoleBinding": lambda: rbac.read_namespaced_role_binding(f"{name}-router", namespace),
        "ConfigMap": lambda: core.read_namespaced_config_map(f"{name}-plan", namespace),
    }
    out: dict[str, Any] = {}
    for kind, read in readers.items():
        try:
            out[kind] = read()
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            out[kind] = None
    return out


def test_pool_becomes_four_replicas_on_h100s_with_the_memory_plan_and_a_router(fleet: Fleet, kube_api: Any) -> None:
    created = fleet.pools.create("llama", LLAMA_70B_FP8_TP2)
    uid = created["metadata"]["uid"]
    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)

    spec = InferencePoolSpec.model_validate(LLAMA_70B_FP8_TP2)
    flags = plan_for_pool(spec, resolve_architecture(spec)).vllm_args()
    assert "--kv-cache-memory-bytes" in flags
    core = client.CoreV1Api(kube_api)
    pods = engine_pods(core, fleet.namespace, "llama")
    assert [p.metadata.name for p in pods] == ["llama-0", "llama-1", "llama-2", "llama-3"]
    for pod in pods:
        node = core.read_node(pod.spec.node_name)
        assert node.metadata.labels[nodes.GPU_PRODUCT_LABEL] == H100
        container = pod.spec.containers[0]
        assert container.resources.limits[nodes.GPU_RESOURCE] == "2"
        assert container.args[0] == "meta-llama/Llama-3.3-70B-Instruct"
        assert contains_in_order(container.args, ["--tensor-parallel-size", "2"])
        assert contains_in_order(container.args, flags), container.args

    objects = owned_objects(kube_api, fleet.namespace, "llama")
    missing = [kind for kind, obj in objects.items() if obj is None]
    assert not missing
    for kind, obj in objects.items():
        owners = obj.metadata.owner_references or []
        assert [(o.kind, o.uid, o.controller) for o in owners] == [("InferencePool", uid, True)], kind
    plan = decode_plan({k: base64.b64decode(v) for k, v in objects["ConfigMap"].binary_data.items()})
    assert plan.pool == "llama" and len(plan) == 0

    status = (fleet.pools.get("llama") or {})["status"]
    ips = {p.metadata.name: p.status.pod_ip for p in pods}
    assert [(d["id"], d["address"], d["ready"]) for d in status["destinations"]] == [
        (name, f"{ips[name]}:8000", True) for name in sorted(ips)
    ]
    assert status["memoryPlan"]["source"] == "Analytic"
    assert status["memoryPlan"]["kvCacheMemoryBytes"] == int(flags[flags.index("--kv-cache-memory-bytes") + 1])
    assert status["observedGeneration"] == 1

    exported = httpx.get(f"http://127.0.0.1:{fleet.operator.health_port}/metrics", timeout=5).text
    assert 'cacheroute_operator_reconcile_passes_total{kind="full",outcome="ok"}' in exported
    assert 'cacheroute_operator_events_total{reason="MemoryPlanned"} 1.0' in exported


def test_scaling_adds_the_next_ordinals_and_removes_the_highest(fleet: Fleet, kube_api: Any) -> None:
    fleet.pools.create("llama", LLAMA_70B_FP8_TP2)
    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)
    fleet.pools.patch_spec("llama", {"replicas": 6})
    until(lambda: destination_ids(fleet, "llama") == [f"llama-{i}" for i in range(6)], "six destinations")
    fleet.pools.await_condition("llama", "Ready", "True")

    fleet.pools.patch_spec("llama", {"replicas": 2})
    until(lambda: destination_ids(fleet, "llama") == ["llama-0", "llama-1"], "two destinations")
    core = client.CoreV1Api(kube_api)
    until(lambda: [p.metadata.name for p in engine_pods(core, fleet.namespace, "llama")] == ["llama-0", "llama-1"],
          "the highest ordinals gone", timeout=90)
    fleet.pools.await_condition("llama", "Ready", "True")

    # Zero: nothing to route to, so no router pod either, and the pool says so.
    fleet.pools.patch_spec("llama", {"replicas": 0})
    fleet.pools.await_condition("llama", "Ready", "False", "ScaledToZero")
    apps = client.AppsV1Api(kube_api)
    until(lambda: apps.read_namespaced_deployment("llama-router", fleet.namespace).spec.replicas == 0,
          "the router Deployment at 0")
    fleet.pools.patch_spec("llama", {"replicas": 1})
    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)


def whole_free_nodes(kube_api: Any, runtime_log: Path) -> tuple[int, int]:
    """Sandbox nodes whose 8 GPUs are all free, and the next unused node index. Pods of earlier
    tests that still terminate (an engine's preStop alone takes 30 s) are awaited first: counted
    as holding their GPUs, they made a node look taken that the next pool then got; counted as
    gone, one that stayed took a node the pool was counting on."""
    core = client.CoreV1Api(kube_api)

    def terminating() -> list[str]:
        return [f"{p.metadata.namespace}/{p.metadata.name}" for p in core.list_pod_for_all_namespaces().items
                if p.metadata.deletion_timestamp and p.spec.node_name]

    try:
        until(lambda: not terminating(), "the pods of earlier tests to finish terminating", timeout=180)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {terminating()}\n{scheduling_report(kube_api, '', runtime_log)}") from None
    sandbox_nodes = core.list_node(label_selector=f"{nodes.SANDBOX_NODE_LABEL}=true").items
    used: dict[str, int] = {}
    for pod in core.list_pod_for_all_namespaces().items:
        leaving = pod.metadata.deletion_timestamp or pod.status.phase in ("Succeeded", "Failed")
        if pod.spec.node_name and not leaving:
            for c in pod.spec.containers:
                limits = (c.resources.limits or {}) if c.resources else {}
                used[pod.spec.node_name] = used.get(pod.spec.node_name, 0) + int(limits.get(nodes.GPU_RESOURCE, 0))
    free = sum(1 for n in sandbox_nodes if used.get(n.metadata.name, 0) == 0)
    taken = {n.metadata.name for n in sandbox_nodes}
    index = next(i for i in range(nodes.MAX_NODES) if nodes.node_name(i) not in taken)
    return free, index


def pod_readiness(pod: Any) -> str:
    ready = next((c for c in pod.status.conditions or [] if c.type == "Ready"), None)
    states = [next((k for k, v in s.state.to_dict().items() if v), None) for s in pod.status.container_statuses or []]
    return f"Ready {ready.status if ready else None}, containers {states}"


def scheduling_report(kube_api: Any, namespace: str, runtime_log: Path) -> str:
    """Where the GPUs went and why the namespace's pending pods wait: nodes with their GPU
    allocatable, taints and pods, each pending pod's scheduler Events, and what the pod runtime
    last said of each pod still terminating (which holds its GPUs until it is gone)."""
    core = client.CoreV1Api(kube_api)
    pods = core.list_pod_for_all_namespaces().items
    said_by_runtime = runtime_log.read_text(errors="replace").splitlines() if runtime_log.exists() else []
    lines = []
    for node in core.list_node(label_selector=f"{nodes.SANDBOX_NODE_LABEL}=true").items:
        name = node.metadata.name
        on = [f"{p.metadata.namespace}/{p.metadata.name}({p.status.phase}, {pod_readiness(p)}"
              f"{', deleting' if p.metadata.deletion_timestamp else ''})" for p in pods if p.spec.node_name == name]
        gpus = (node.status.allocatable or {}).get(nodes.GPU_RESOURCE)
        taints = [f"{t.key}:{t.effect}" for t in node.spec.taints or []]
        lines.append(f"node {name}: {gpus} GPUs, taints {taints}, unschedulable {node.spec.unschedulable}, pods {on}")
    for pod in pods:
        if pod.metadata.namespace == namespace and not pod.spec.node_name:
            events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod.metadata.name}")
            said = [f"{e.reason}: {e.message}" for e in events.items]
            lines.append(f"pending {pod.metadata.name}: {said}")
        if pod.metadata.deletion_timestamp:
            who = f"{pod.metadata.namespace}/{pod.metadata.name}"
            lines.append(f"terminating {who}, the runtime: {[x for x in said_by_runtime if who in x][-3:]}")
    return "\n".join(lines)


@contextlib.contextmanager
def extra_node(kube_api: Any, index: int) -> Any:
    """A fake H100 node for the duration; its pods are gone before it goes (kwok would abandon them)."""
    core = client.CoreV1Api(kube_api)
    name = nodes.node_name(index)
    core.create_node(nodes.node_manifest(index))
    try:
        yield name
    finally:
        def on_node() -> list[Any]:
            return list(core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}").items)

        with contextlib.suppress(Exception):
            until(lambda: not on_node(), f"pods off {name}", timeout=60)
        for pod in on_node():
            with contextlib.suppress(client.ApiException):
                core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        with contextlib.suppress(client.ApiException):
            core.delete_node(name)


def test_a_gpu_product_no_node_carries_is_insufficient_gpus_naming_the_label(fleet: Fleet) -> None:
    spec = {**LLAMA_70B_FP8_TP2, "replicas": 1, "gpu": {"product": "NVIDIA-A100-SXM4-80GB"}}
    fleet.pools.create("elsewhere", spec)
    degraded = fleet.pools.await_condition("elsewhere", "Degraded", "True", "InsufficientGPUs", timeout=120)
    assert "node affinity/selector" in degraded["message"]
    assert "nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB" in degraded["message"]
    fleet.pools.await_condition("elsewhere", "Ready", "False", "InsufficientGPUs")
    fleet.pools.remove_all()


def test_more_gpus_than_the_nodes_have_is_insufficient_gpus_and_recovers_with_a_node(
    fleet: Fleet, kube_api: Any, sandbox: Sandbox
) -> None:
    # At TP 8 a replica takes a whole node: one replica more than there are free nodes.
    runtime_log = sandbox.state_dir / "logs" / "pod-runtime.log"
    free, next_index = whole_free_nodes(kube_api, runtime_log)
    spec = {**LLAMA_70B_FP8_TP2, "tensorParallelSize": 8, "replicas": free + 1}
    fleet.pools.create("wide", spec)
    ready = fleet.pools.await_condition("wide", "Ready", "False", "InsufficientGPUs", timeout=120)
    assert "nvidia.com/gpu" in ready["message"]
    degraded = fleet.pools.await_condition("wide", "Degraded", "True", "InsufficientGPUs")
    assert "8 x nvidia.com/gpu" in degraded["message"]
    # The Event's log record may land a moment after the status patch that carries the condition.
    until(lambda: bool(fleet.operator.events("InsufficientGPUs", "wide")), "the InsufficientGPUs Event", timeout=30)

    with extra_node(kube_api, next_index):
        try:
            fleet.pools.await_condition("wide", "Ready", "True", timeout=180)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{scheduling_report(kube_api, fleet.namespace, runtime_log)}") from None
        fleet.pools.await_condition("wide", "Degraded", "False")
        fleet.pools.remove_all()


def test_deleted_service_and_hand_edited_arguments_are_repaired_within_a_resync(
    fleet: Fleet, kube_api: Any
) -> None:
    fleet.pools.create("llama", LLAMA_70B_FP8_TP2)
    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)
    core, apps = client.CoreV1Api(kube_api), client.AppsV1Api(kube_api)
    resync = fleet.operator.resync + 10  # one resync period, and room for a loaded machine

    old_uid = core.read_namespaced_service("llama", fleet.namespace).metadata.uid
    core.delete_namespaced_service("llama", fleet.namespace)

    def service_back() -> bool:
        try:
            return bool(core.read_namespaced_service("llama", fleet.namespace).metadata.uid != old_uid)
        except client.ApiException:
            return False

    until(service_back, "the headless Service recreated", timeout=resync)

    sts = apps.read_namespaced_stateful_set("llama", fleet.namespace)
    good_args = list(sts.spec.template.spec.containers[0].args)
    edited = list(good_args)
    edited[edited.index("--max-num-seqs") + 1] = "7"
    apps.patch_namespaced_stateful_set(
        "llama", fleet.namespace,
        {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": edited}]}}}},
        field_manager="kubectl-edit",
    )
    assert apps.read_namespaced_stateful_set("llama", fleet.namespace).spec.template.spec.containers[0].args == edited
    until(
        lambda: apps.read_namespaced_stateful_set("llama", fleet.namespace).spec.template.spec.containers[0].args
        == good_args,
        "the StatefulSet's arguments restored",
        timeout=resync,
    )
    assert fleet.operator.events("Recreated", "llama")


def test_deleting_the_pool_removes_everything_it_owned(fleet: Fleet, kube_api: Any) -> None:
    fleet.pools.create("llama", {**LLAMA_70B_FP8_TP2, "replicas": 2})
    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)
    assert all(obj is not None for obj in owned_objects(kube_api, fleet.namespace, "llama").values())
    fleet.pools.delete("llama")
    until(
        lambda: all(obj is None for obj in owned_objects(kube_api, fleet.namespace, "llama").values()),
        "every owned object garbage-collected",
        timeout=90,
    )
    core = client.CoreV1Api(kube_api)
    until(lambda: not engine_pods(core, fleet.namespace, "llama"), "the engine pods gone", timeout=90)
    # The pool's status daemon ended when asked, not cancelled by kopf (a warning in every log).
    assert not [r for r in fleet.operator.records() if "Will escalate" in r.get("msg", "")]


def test_a_model_that_does_not_fit_is_degraded_with_the_arithmetic_and_starts_nothing(
    fleet: Fleet, kube_api: Any
) -> None:
    spec = {"model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "bf16"}, "tensorParallelSize": 1,
            "replicas": 2}
    fleet.pools.create("big", spec)
    degraded = fleet.pools.await_condition("big", "Degraded", "True", "DoesNotFit")
    assert "does not fit" in degraded["message"] and "GiB" in degraded["message"]
    assert "TP=4 fits" in degraded["message"]
    assert fleet.pools.await_condition("big", "Ready", "False", "DoesNotFit")
    assert fleet.pools.await_condition("big", "MemoryPlanned", "False", "DoesNotFit")

    apps, core = client.AppsV1Api(kube_api), client.CoreV1Api(kube_api)

    assert "no engine or router pod runs meanwhile" in degraded["message"]

    def nothing_started() -> None:
        assert not apps.list_namespaced_stateful_set(fleet.namespace).items
        assert not engine_pods(core, fleet.namespace, "big")
        # Nor a router: there is nothing to route to.
        assert apps.read_namespaced_deployment("big-router", fleet.namespace).spec.replicas == 0
        assert fleet.operator.alive()

    # Several status ticks and a resync pass: still nothing, no crash, no retry storm.
    sleep_observing(fleet.operator.resync + 2, nothing_started)
    failures = [r for r in fleet.operator.records() if "failed" in r.get("msg", "") and r.get("level") == "error"]
    assert not failures
    assert len(fleet.operator.events("DoesNotFit", "big")) == 1


def test_a_memory_input_change_rolls_one_replica_at_a_time(fleet: Fleet, kube_api: Any) -> None:
    fleet.pools.create("llama", LLAMA_70B_FP8_TP2)
    fleet.pools.await_condition("llama", "Ready", "True", timeout=120)
    apps, core = client.AppsV1Api(kube_api), client.CoreV1Api(kube_api)
    before = apps.read_namespaced_stateful_set("llama", fleet.namespace)
    assert before.spec.update_strategy.type == "RollingUpdate"

    fleet.pools.patch_spec("llama", {"memory": {"maxModelLen": 32768}})

    def at_most_one_down() -> None:
        ready = [p for p in engine_pods(core, fleet.namespace, "llama")
                 if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
        assert len(ready) >= 3, f"{len(ready)} replicas ready during the rollout"

    def rolled() -> bool:
        sts = apps.read_namespaced_stateful_set("llama", fleet.namespace)
        pods = engine_pods(core, fleet.namespace, "llama")
        return (
            sts.status.update_revision == sts.status.current_revision
            and sts.status.updated_replicas == 4
            and len(pods) == 4
            and all("32768" in p.spec.containers[0].args for p in pods)
        )

    observe_until(rolled, at_most_one_down, "every replica rolled to the new arguments", timeout=180)
    assert fleet.operator.events("RollingUpdate", "llama")
    fleet.pools.await_condition("llama", "Ready", "True")


def test_the_memory_plan_in_status_loses_the_inputs_the_spec_no_longer_gives(fleet: Fleet) -> None:
    fleet.pools.create("llama", {**LLAMA_70B_FP8_TP2, "replicas": 1, "gpu": {"nodeMemoryGib": 2048}})

    def plan() -> dict[str, Any]:
        return dict(((fleet.pools.get("llama") or {}).get("status") or {}).get("memoryPlan") or {})

    until(lambda: plan().get("inputs", {}).get("nodeMemoryBytes") == str(2048 << 30), "a plan with the node's memory")
    assert plan()["hostKvCacheBytes"] > 0
    # Without the node's memory, auto gives no host tier: the plan must not keep describing one.
    fleet.pools.patch_spec("llama", {"gpu": {"nodeMemoryGib": None}})
    until(lambda: plan().get("hostKvCacheBytes", 0) == 0, "the plan without a host tier", timeout=60)
    assert "nodeMemoryBytes" not in plan()["inputs"], plan()["inputs"]
    assert plan()["inputs"]["hostKvCache"] == "auto"


def test_a_deleted_workload_or_service_is_back_in_seconds_not_at_the_resync(
    operator_kubeconfig: Path, pools: Pools, namespace: str, tmp_path: Path, kube_api: Any
) -> None:
    # A resync far beyond the test: only the deletion itself can bring the objects back.
    operator = OperatorProcess(namespace=namespace, kubeconfig=operator_kubeconfig, workdir=tmp_path,
                               resync=600).start()
    try:
        pools.create("llama", {**LLAMA_70B_FP8_TP2, "replicas": 2})
        pools.await_condition("llama", "Ready", "True", timeout=120)
        apps, core = client.AppsV1Api(kube_api), client.CoreV1Api(kube_api)
        for read, delete, what in (
            (apps.read_namespaced_stateful_set, apps.delete_namespaced_stateful_set, "llama"),
            (apps.read_namespaced_deployment, apps.delete_namespaced_deployment, "llama-router"),
            # Clients reach the routers through the one, the routers find the engines through the other.
            (core.read_namespaced_service, core.delete_namespaced_service, "llama-router"),
            (core.read_namespaced_service, core.delete_namespaced_service, "llama"),
        ):
            old_uid = read(what, namespace).metadata.uid
            delete(what, namespace)

            def back(read: Any = read, what: str = what, old_uid: str = old_uid) -> bool:
                try:
                    return bool(read(what, namespace).metadata.uid != old_uid)
                except client.ApiException:
                    return False

            until(back, f"{what} recreated", timeout=20)
        pools.await_condition("llama", "Ready", "True", timeout=120)
        # The pass logs its Events once it has applied every object, a moment after the last one is back.
        until(lambda: len(operator.events("Recreated", "llama")) >= 4, "a Recreated Event for each", timeout=20)
    finally:
        pools.remove_all()
        operator.stop()
