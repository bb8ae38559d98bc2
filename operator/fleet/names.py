"""Names and labels of everything the operator creates for a pool (the contract other components read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cacheroute.operator.api.common import API_VERSION
from cacheroute.planner.plan_format import configmap_name

MANAGED_BY = "app.kubernetes.io/managed-by"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
NAME = "app.kubernetes.io/name"
POOL = "cacheroute.dev/pool"
MANAGER = "cacheroute"
# The field manager of every server-side apply: one name for all operator replicas, so a standby
# that takes over owns the same fields.
FIELD_MANAGER = "cacheroute-operator"

Component = Literal["engine", "router", "plan"]

ENGINE_PORT_NAME = "http"
ROUTER_HTTP_PORT = 8080
ROUTER_HEALTH_PORT = 8081
ROUTER_GRPC_PORT = 9002
ROUTER_METRICS_PORT = 9090
# The router reads the header ConfigMap and up to this many shard ConfigMaps, mounted optional.
MAX_PLAN_SHARDS = 16


@dataclass(frozen=True)
class PoolRef:
    """The InferencePool an object belongs to: enough to name, label and own it."""

    name: str
    namespace: str
    uid: str

    @property
    def statefulset(self) -> str:
        return self.name

    @property
    def headless_service(self) -> str:
        return self.name

    @property
    def pdb(self) -> str:
        return self.name

    @property
    def router(self) -> str:
        return f"{self.name}-router"

    def plan_configmap(self, shard: int = 0) -> str:
        return configmap_name(self.name, shard)

    def destination(self, ordinal: int) -> str:
        return f"{self.name}-{ordinal}"

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": "InferencePool",
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def labels(pool: PoolRef, component: Component) -> dict[str, str]:
    """The labels every owned object carries."""
    return {
        MANAGED_BY: MANAGER,
        NAME: "cacheroute",
        INSTANCE: pool.name,
        COMPONENT: component,
        POOL: pool.name,
    }


def selector(pool: PoolRef, component: Component) -> dict[str, str]:
    """The immutable part of the labels, used as selector (a StatefulSet's selector cannot change)."""
    return {POOL: pool.name, COMPONENT: component}


def metadata(
    pool: PoolRef,
    name: str,
    component: Component,
    *,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "namespace": pool.namespace,
        "labels": labels(pool, component),
        "ownerReferences": [pool.owner_reference()],
    }
    if annotations:
        out["annotations"] = dict(annotations)
    return out


def selector_string(values: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(values.items()))
