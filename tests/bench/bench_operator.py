"""How fast the operator turns InferencePools into fleets, on the sandbox.

1. apply -> StatefulSet created: RUNS pools applied one after another; the time from the create
   call returning to the StatefulSet appearing in a watch (median, p99; target median <= 1 s).
   Baseline in the same run: the client creating the same StatefulSet itself, from the call to
   seeing it in the same watch (one API write at the server's current load).
2. BATCH pools applied at once -> all converged (Ready=True at their generation; target <= 30 s).
   Baseline in the same run: every object of BATCH pools created directly by the client (no
   operator), until every StatefulSet and router Deployment has a ready replica: what the API
   server, controllers, scheduler and kwok need for the same work.

The operator runs as in production: its own process, least-RBAC identity, one namespace. kwok plays
every pod (the sandbox's pod runtime is off), so the figures are the operator's and the control
plane's, not those of 50 emulated engines starting on this machine.
Writes bench-results/operator.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.config import EngineDefaults, OperatorConfig
from cacheroute.operator.fleet import names, statefulset
from cacheroute.operator.fleet.cluster import Cluster
from cacheroute.operator.fleet.memory import MemoryOutcome
from cacheroute.operator.fleet.profiling_job import plan_for_pool, resolve_architecture
from cacheroute.operator.fleet.reconcile import desired_objects
from cacheroute.sandbox.cluster import Sandbox, SandboxOptions
from tests.support.operator import TEST_CONFIG, OperatorProcess, Pools, install_crds, operator_identity

RUNS = 20
BATCH = 50
TARGET_APPLY_TO_STS_S = 1.0
TARGET_BATCH_CONVERGED_S = 30.0
NODES = 8  # 64 GPUs: BATCH single-GPU replicas plus room
SPEC: dict[str, Any] = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "replicas": 1, "router": {"replicas": 1}}


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))]


class StatefulSetWatch:
    """First-seen time of every StatefulSet (and its ready replicas) in a namespace, from one watch."""

    def __init__(self, api: Any, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.seen: dict[str, float] = {}
        self.ready: dict[str, int] = {}
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubernetes import client, watch

        apps = client.AppsV1Api(self.api)
        while not self._stop.is_set():
            for event in watch.Watch().stream(apps.list_namespaced_stateful_set, self.namespace, timeout_seconds=5):
                obj, now = event["object"], time.monotonic()
                with self.changed:
                    self.seen.setdefault(obj.metadata.name, now)
                    self.ready[obj.metadata.name] = (obj.status.ready_replicas or 0) if obj.status else 0
                    self.changed.notify_all()

    def wait(self, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not check():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("timed out")
                self.changed.wait(min(left, 0.5))

    def stop(self) -> None:
        self._stop.set()


def fresh_namespace(sandbox: Sandbox, name: str) -> str:
    from kubernetes import client

    core = client.CoreV1Api(sandbox.api_client())
    core.create_namespace({"metadata": {"name": name}})
    deadline = time.monotonic() + 60
    while not core.list_namespaced_service_account(name).items:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in {name}")
        time.sleep(0.1)
    return name


def apply_to_statefulset(sandbox: Sandbox, pools: Pools, watch: StatefulSetWatch) -> list[float]:
    out = []
    for i in range(RUNS):
        name = f"seq{i}"
        pools.create(name, SPEC)
        created = time.monotonic()
        watch.wait(lambda n=name: n in watch.seen, timeout=60)  # type: ignore[misc]
        out.append(max(0.0, watch.seen[name] - created))
    return out


def direct_statefulset(
    sandbox: Sandbox, namespace: str, watch: StatefulSetWatch, index: int
) -> tuple[float, dict[str, Any]]:
    """The floor: the client creates the StatefulSet the operator would (one API write, as loaded as
    the server is now) until it shows in the same watch."""
    from kubernetes import client

    spec = InferencePoolSpec.model_validate(SPEC)
    pool = names.PoolRef(f"direct{index}", namespace, "00000000-0000-0000-0000-000000000000")
    sts = statefulset.build_statefulset(pool, spec, plan_for_pool(spec, resolve_architecture(spec)), EngineDefaults())
    sts["metadata"].pop("ownerReferences")
    created = time.monotonic()
    client.AppsV1Api(sandbox.api_client()).create_namespaced_stateful_set(namespace, sts)
    watch.wait(lambda: pool.name in watch.seen, timeout=60)
    return max(0.0, watch.seen[pool.name] - created), sts


def converged(pools: Pools, name: str) -> bool:
    pool = pools.get(name) or {}
    status = pool.get("status") or {}
    ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    return ready.get("status") == "True" and status.get("observedGeneration") == pool["metadata"]["generation"]


def batch_converged(pools: Pools) -> tuple[float, float, StatefulSetWatch]:
    watch = StatefulSetWatch(pools.api.api_client, pools.namespace)
    started = time.monotonic()
    with ThreadPoolExecutor(8) as workers:
        list(workers.map(lambda i: pools.create(f"b{i}", SPEC), range(BATCH)))
    watch.wait(lambda: len(watch.seen) >= BATCH, timeout=300)
    all_sts = max(watch.seen.values()) - started
    pending = {f"b{i}" for i in range(BATCH)}
    deadline = time.monotonic() + 600
    while pending:
        pending = {n for n in pending if not converged(pools, n)}
        if time.monotonic() > deadline:
            raise TimeoutError(f"not converged: {sorted(pending)}")
        time.sleep(0.2)
    return time.monotonic() - started, all_sts, watch


def direct_batch(sandbox: Sandbox, namespace: str) -> float:
    """The floor of the batch: every object of BATCH pools created directly by the client (no operator),
    until every StatefulSet and router Deployment has a ready replica."""
    from kubernetes import client

    cluster = Cluster(sandbox.api_client())
    spec = InferencePoolSpec.model_validate(SPEC)
    memory = MemoryOutcome("Planned", "", plan=plan_for_pool(spec, resolve_architecture(spec)))
    objects = []
    for i in range(BATCH):
        # The operator's configuration in the bench: routers tolerate the sandbox nodes' GPU taint.
        config = OperatorConfig.model_validate(TEST_CONFIG)
        desired = desired_objects(names.PoolRef(f"d{i}", namespace, "x"), spec, memory, config)
        for obj in (*desired.engine, *desired.apply, *desired.create_only):
            obj["metadata"].pop("ownerReferences")
            objects.append(obj)
    apps = client.AppsV1Api(sandbox.api_client())
    started = time.monotonic()
    with ThreadPoolExecutor(8) as workers:
        list(workers.map(cluster.create, objects))

    def ready() -> int:
        sets = apps.list_namespaced_stateful_set(namespace).items
        deployments = apps.list_namespaced_deployment(namespace).items
        return sum(1 for x in sets if (x.status.ready_replicas or 0) >= 1) + sum(
            1 for x in deployments if (x.status.available_replicas or 0) >= 1
        )

    deadline = started + 600
    while ready() < 2 * BATCH:
        if time.monotonic() > deadline:
            raise TimeoutError("direct objects not ready")
        time.sleep(0.2)
    return time.monotonic() - started


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        work = Path(tmp)
        print(f"starting a sandbox with {NODES} nodes", flush=True)
        # kwok plays every pod (no pod runtime): what is measured is the operator and the control
        # plane, not 50 emulated engines starting on this machine.
        sandbox = Sandbox.up(SandboxOptions(name="bench-operator", state_dir=work / "sandbox", nodes=NODES,
                                            prometheus=False, detach=False, pod_runtime=None))
        try:
            results = run(sandbox, work)
        finally:
            sandbox.down()
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "operator.json").write_text(json.dumps(results, indent=2) + "\n")


def run(sandbox: Sandbox, work: Path) -> dict[str, Any]:
    install_crds(sandbox)
    kubeconfig = operator_identity(sandbox, work / "identity")

    # 1. apply -> StatefulSet, one pool at a time.
    namespace = fresh_namespace(sandbox, "bench-sequential")
    operator = OperatorProcess(namespace, kubeconfig, work, name="operator-seq", status=2.0, resync=120.0).start()
    pools = Pools(sandbox, namespace)
    watch = StatefulSetWatch(sandbox.api_client(), namespace)
    try:
        latencies = apply_to_statefulset(sandbox, pools, watch)
        floors = [direct_statefulset(sandbox, namespace, watch, i)[0] for i in range(5)]
    finally:
        watch.stop()
        pools.remove_all(timeout=120)
        operator.stop()
    median = statistics.median(latencies)
    floor = statistics.median(floors)
    print(
        f"apply -> StatefulSet over {RUNS} pools: median {median * 1e3:.0f} ms, p99 {p99(latencies) * 1e3:.0f} ms "
        f"(target median <= {TARGET_APPLY_TO_STS_S * 1e3:.0f} ms); direct create floor {floor * 1e3:.0f} ms",
        flush=True,
    )

    # 2. BATCH pools at once -> all converged; then the same pods without the operator.
    namespace = fresh_namespace(sandbox, "bench-batch")
    operator = OperatorProcess(namespace, kubeconfig, work, name="operator-batch", status=2.0, resync=120.0).start()
    pools = Pools(sandbox, namespace)
    try:
        total, all_sts, batch_watch = batch_converged(pools)
        batch_watch.stop()
    finally:
        pools.remove_all(timeout=300)
        operator.stop()
    floor_batch = direct_batch(sandbox, fresh_namespace(sandbox, "bench-direct"))
    print(f"{BATCH} pools at once: all StatefulSets after {all_sts:.1f} s, all converged after {total:.1f} s "
          f"(target <= {TARGET_BATCH_CONVERGED_S:.0f} s); the same objects created directly were ready after "
          f"{floor_batch:.1f} s", flush=True)
    ratios = {
        "apply_to_sts_median_vs_target": median / TARGET_APPLY_TO_STS_S,
        "apply_to_sts_median_vs_direct_create": median / floor if floor else float("inf"),
        "batch_converged_vs_target": total / TARGET_BATCH_CONVERGED_S,
        "batch_converged_vs_direct_objects_ready": total / floor_batch if floor_batch else float("inf"),
    }
    print("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in ratios.items()))
    return {
        "command": [sys.executable, "-m", "tests.bench.bench_operator"],
        "nodes": NODES,
        "apply_to_statefulset_s": {"runs": latencies, "median": median, "p99": p99(latencies),
                                   "target_median": TARGET_APPLY_TO_STS_S, "direct_create_median": floor},
        "batch": {"pools": BATCH, "all_statefulsets_s": all_sts, "all_converged_s": total,
                  "target_s": TARGET_BATCH_CONVERGED_S, "direct_objects_ready_s": floor_batch},
        "ratios": ratios,
    }


if __name__ == "__main__":
    main()
