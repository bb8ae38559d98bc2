"""Publishing sharded plans on the real API server: a reader watching the ConfigMaps never
assembles a mixed plan, the header lands after its shards, stale shards are emptied, and the plan
reads back as published."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from kubernetes import client, watch

from cacheroute.operator.control.kube import ControlApi
from cacheroute.operator.control.publish import VERSION_ANNOTATION, publish, read_current
from cacheroute.planner.plan import Destination, Plan, PlanError
from cacheroute.planner.plan_format import decode_plan, encode_plan
from cacheroute.router.kube import configmap_files
from tests.support.control import ControlEnv, create_pool
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration


def random_plan(routes: int, seed: int) -> Plan:
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**63, routes, dtype=np.int64).astype(np.uint64))
    dests = tuple(Destination(f"llama-{i}", f"10.0.0.{i}:8000", 1.0, 100_000) for i in range(4))
    return Plan(
        pool="llama",
        destinations=dests,
        route_keys=keys,
        route_offsets=np.arange(len(keys) + 1, dtype=np.int64),
        route_dests=rng.integers(0, 4, len(keys)).astype(np.uint16),
        generated_at=f"seed {seed}",
    )


class Observer:
    """Follows the namespace's ConfigMaps as a router watching them does, decoding every state."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.objects: dict[str, Any] = {}
        self.events: list[tuple[str, str | None, bool]] = []  # (ConfigMap, version annotation, has files)
        self.decoded: list[str] = []  # version of each state that decoded
        self.rejected = 0
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        listed = self.core.list_namespaced_config_map(self.namespace)
        w = watch.Watch(return_type="object")  # JSON objects, as the router's watch holds them
        self.ready.set()
        for event in w.stream(self.core.list_namespaced_config_map, self.namespace,
                              resource_version=listed.metadata.resource_version, timeout_seconds=60):
            cm = event["object"]
            name = cm["metadata"]["name"]
            if not name.startswith("llama-plan"):
                continue
            self.objects[name] = cm
            annotations = cm["metadata"].get("annotations") or {}
            self.events.append((name, annotations.get(VERSION_ANNOTATION), bool(cm.get("binaryData"))))
            try:
                self.decoded.append(decode_plan(configmap_files(self.objects)).generated_at)
            except PlanError:
                self.rejected += 1
            if self.stop.is_set():
                w.stop()


def test_sharded_plans_are_never_seen_half_written(env: ControlEnv) -> None:
    create_pool(env.api, env.namespace, "llama", [("10.0.0.1:8000", True)], 100_000)
    pool_obj = client.CustomObjectsApi(env.api).get_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", env.namespace, "inferencepools", "llama"
    )
    api = ControlApi(env.api)
    big, small = random_plan(250_000, 1), random_plan(20_000, 2)
    big_payload, small_payload = encode_plan(big), encode_plan(small)
    assert len(big_payload.configmaps) >= 3 and len(small_payload.configmaps) == 1

    observer = Observer(env.api, env.namespace)
    observer.thread.start()
    observer.ready.wait(10)
    publish(api, pool_obj, big_payload, writer="test")
    assert read_current(api, env.namespace, "llama").version == big_payload.version
    publish(api, pool_obj, small_payload, writer="test")
    current = read_current(api, env.namespace, "llama")
    assert current.version == small_payload.version
    assert current.plan is not None and current.plan.routes() == small.routes()

    def settled() -> bool:
        return bool(observer.decoded) and observer.decoded[-1] == "seed 2"

    wait_for(settled, timeout=60, what="the observer to see the second plan")
    observer.stop.set()
    # Every state the observer could assemble was one of the two plans, never a mix.
    assert set(observer.decoded) <= {"seed 1", "seed 2"} and "seed 1" in observer.decoded
    # For each plan, its header is written after all its shards.
    big_events = [(i, name) for i, (name, version, _) in enumerate(observer.events) if version == big_payload.version]
    header_at = max(i for i, name in big_events if name == "llama-plan")
    assert all(i < header_at for i, name in big_events if name != "llama-plan")
    # The shards the smaller plan does not use are emptied, not left with the old routes.
    cms = {cm.metadata.name: cm for cm in client.CoreV1Api(env.api).list_namespaced_config_map(env.namespace).items}
    for i in range(1, len(big_payload.configmaps)):
        assert not cms[f"llama-plan-{i}"].binary_data
    # Created here, so owned by the pool and labelled as the pool's plan.
    owner = cms["llama-plan"].metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("InferencePool", "llama", True)
    assert cms["llama-plan"].metadata.labels["app.kubernetes.io/component"] == "plan"
