"""A pool's Events reach the API server before the status that records them: a pass whose status
is never written (the operator dies, or the write fails) loses no Event, and the next pass tells it
again instead of never; once the status holds it, it is not told again."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from kubernetes import config

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.control.kube import EVENT_SOURCE, ControlApi
from cacheroute.operator.fleet import names
from cacheroute.operator.fleet.cluster import Cluster, KubeError
from cacheroute.operator.fleet.reconcile import PoolMemory, Reconciler
from cacheroute.operator.fleet.status import FleetFacts
from cacheroute.operator.handlers.events import poster
from tests.support.control import events
from tests.support.namespaces import first_refusal, terminating_namespace
from tests.support.operator import TEST_CONFIG, Pools

pytestmark = pytest.mark.integration

SPEC: dict[str, Any] = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "replicas": 1,
                        "memory": {"maxModelLen": 8192}}


class _StatusLost(Cluster):
    """The operator's API calls, except that every status write is lost (the process died right
    before it, as far as the API server can tell)."""

    def patch_pool_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        raise KubeError(0, f"updating the status of InferencePool {namespace}/{name} failed: connection lost")


def _pass(cluster: Cluster, pools: Pools, name: str) -> None:
    """One full pass over the pool, as a replica that first sees it runs it (its memory resumed
    from the status), with Events posted as the pool's handler posts them."""
    body = pools.get(name)
    assert body is not None
    meta = body["metadata"]
    status = body.get("status") or {}
    Reconciler(cluster, OperatorConfig.model_validate(TEST_CONFIG)).reconcile(
        names.PoolRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"]),
        InferencePoolSpec.model_validate(body["spec"]), int(meta["generation"]),
        facts=FleetFacts(pods=[], statefulset=None, router=None), previous_status=status,
        mem=PoolMemory.resumed(status), emit=poster(ControlApi(cluster.api), body), full=True,
    )


def test_a_pool_event_is_on_the_server_before_its_status_and_told_again_if_the_status_was_lost(
    pools: Pools, kube_api: Any, namespace: str, operator_kubeconfig: Path
) -> None:
    # The operator's own identity: posting Events and applying the pool's objects are within its ClusterRole.
    client = config.new_client_from_config(config_file=str(operator_kubeconfig))
    uid = pools.create("llama", SPEC)["metadata"]["uid"]

    with pytest.raises(KubeError, match="connection lost"):
        _pass(_StatusLost(client), pools, "llama")
    told = events(kube_api, namespace, "MemoryPlanned")
    assert [(e.type, e.involved_object.kind, e.involved_object.name, e.involved_object.uid) for e in told] == [
        ("Normal", "InferencePool", "llama", uid)
    ]
    assert told[0].source.component == EVENT_SOURCE
    assert not ((pools.get("llama") or {}).get("status") or {}).get("conditions")  # the status was lost

    # The next pass (this operator's, or the replica that took over) does not know it was told.
    _pass(Cluster(client), pools, "llama")
    assert len(events(kube_api, namespace, "MemoryPlanned")) == 2
    conditions = {c["type"]: c for c in (pools.get("llama") or {})["status"]["conditions"]}
    assert conditions["MemoryPlanned"]["status"] == "True"

    # Recorded in the status now: not told again.
    _pass(Cluster(client), pools, "llama")
    assert len(events(kube_api, namespace, "MemoryPlanned")) == 2


def test_a_write_refused_because_the_namespace_is_being_deleted_is_told_apart(
    kube_api: Any, operator_kubeconfig: Path
) -> None:
    cluster = Cluster(config.new_client_from_config(config_file=str(operator_kubeconfig)))
    with terminating_namespace(kube_api, "pool-going-away") as name:
        plan_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "llama-plan", "namespace": name}}
        refusal = first_refusal(lambda: cluster.apply(plan_map), KubeError,
                                undo=lambda: cluster.delete("v1", "ConfigMap", name, "llama-plan"))
        assert refusal.status == 403 and refusal.namespace_terminating
        # Another refusal is not taken for it: a namespace that does not exist at all.
        with pytest.raises(KubeError) as missing:
            cluster.apply({**plan_map, "metadata": {"name": "llama-plan", "namespace": "no-such-namespace"}})
        assert not missing.value.namespace_terminating
