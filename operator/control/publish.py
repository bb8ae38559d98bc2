"""The plan ConfigMaps: reading the plan in effect back, and publishing a new one.

A plan is `<pool>-plan` (the header, which names every shard with its sha256, plus shard 0) and
`<pool>-plan-<i>` (shard i). A router, whether it watches the ConfigMaps or reads them from a
volume, only applies a payload whose shards match the header (`decode_plan`), so publishing
writes the shards first and the header last: until the header lands, readers see the old header
with shards that do not match it and keep the plan they have. Shard ConfigMaps the new plan no
longer needs are emptied afterwards (not deleted: a volume may list them).

The ConfigMaps belong to the pool (its reconciler creates them); when one is missing it is
created here with the pool as controlling owner. Writes are merge patches of `binaryData` and
two annotations, so labels and owners set by the reconciler stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cacheroute.operator.api.common import API_VERSION
from cacheroute.operator.control.kube import ControlApi
from cacheroute.operator.fleet.names import MAX_PLAN_SHARDS
from cacheroute.planner.plan import Plan, PlanError
from cacheroute.planner.plan_format import PlanPayload, configmap_name, decode_plan, read_header

VERSION_ANNOTATION = "cacheroute.dev/plan-version"
WRITER_ANNOTATION = "cacheroute.dev/affinity-plan"
# Shard ConfigMaps looked at past the ones a plan uses, to empty those a larger plan left.
_MAX_STALE_PROBE = 64


@dataclass(frozen=True)
class CurrentPlan:
    """The plan in effect as the ConfigMaps hold it."""

    plan: Plan | None
    version: str | None = None
    writer: str | None = None
    error: str | None = None  # set when the ConfigMaps hold something that is not a valid plan


def read_writer(api: ControlApi, namespace: str, pool: str) -> str | None:
    """The AffinityPlan that last published the pool's plan, as the header ConfigMap says now."""
    annotations = api.configmap_annotations(namespace, configmap_name(pool, 0))
    return None if annotations is None else annotations.get(WRITER_ANNOTATION)


def release_writer(api: ControlApi, namespace: str, pool: str, writer: str) -> bool:
    """Stop naming `writer` as the pool's publisher (it is being deleted); the plan it published
    stays in effect. False when another AffinityPlan, or none, is named."""
    if read_writer(api, namespace, pool) != writer:
        return False
    api.set_configmap_annotation(namespace, configmap_name(pool, 0), WRITER_ANNOTATION, None)
    return True


def claim_writer(api: ControlApi, namespace: str, pool: str, writer: str) -> None:
    """Name `writer` as the pool's publisher of the plan in effect, which it would publish
    unchanged (it takes over a pool whose plan already routes as its own would)."""
    api.set_configmap_annotation(namespace, configmap_name(pool, 0), WRITER_ANNOTATION, writer)


def read_current(api: ControlApi, namespace: str, pool: str) -> CurrentPlan:
    head = api.read_configmap_files(namespace, configmap_name(pool, 0))
    if head is None or not head[0]:
        return CurrentPlan(None)
    files, annotations = head
    writer = annotations.get(WRITER_ANNOTATION)
    try:
        header = read_header(files)
        version = str(header.get("version", "")) or None
        everything = dict(files)
        for shard in header.get("shards", []):
            cm = str(shard.get("configMap", ""))
            if cm and cm != configmap_name(pool, 0):
                found = api.read_configmap_files(namespace, cm)
                if found is not None:
                    everything.update(found[0])
        plan = decode_plan(everything)
    except PlanError as exc:
        return CurrentPlan(None, writer=writer, error=str(exc))
    if plan.pool != pool:
        return CurrentPlan(None, version, writer, f"the plan in {configmap_name(pool, 0)} is for pool {plan.pool!r}")
    return CurrentPlan(plan, version, writer)


def owned_metadata(pool: Mapping[str, Any]) -> dict[str, Any]:
    """Labels and owner of a plan ConfigMap created here (the pool's reconciler sets the same)."""
    meta = pool["metadata"]
    name = meta["name"]
    return {
        "labels": {
            "app.kubernetes.io/managed-by": "cacheroute",
            "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": "plan",
            "cacheroute.dev/pool": name,
        },
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": "InferencePool",
                "name": name,
                "uid": meta["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def publish(api: ControlApi, pool: Mapping[str, Any], payload: PlanPayload, *, writer: str) -> None:
    """Write `payload` into the pool's plan ConfigMaps: shards first, header last, then tidy."""
    namespace = pool["metadata"]["namespace"]
    pool_name = pool["metadata"]["name"]
    head_name = configmap_name(pool_name, 0)
    if head_name not in payload.configmaps:
        raise PlanError(f"payload has no {head_name} ConfigMap")
    if len(payload.configmaps) > MAX_PLAN_SHARDS:
        raise PlanError(
            f"plan {payload.version} needs {len(payload.configmaps)} ConfigMaps; the pool's routers mount at most "
            f"{MAX_PLAN_SHARDS} (lower the budget or the router's sketch size)"
        )
    annotations = {VERSION_ANNOTATION: payload.version, WRITER_ANNOTATION: writer}
    meta = owned_metadata(pool)
    for name, names in payload.configmaps.items():
        if name != head_name:
            files = {n: payload.files[n] for n in names}
            api.write_configmap_files(namespace, name, files, annotations=annotations, create_metadata=meta)
    head_files = {n: payload.files[n] for n in payload.configmaps[head_name]}
    api.write_configmap_files(namespace, head_name, head_files, annotations=annotations, create_metadata=meta)
    _empty_stale_shards(api, namespace, pool_name, used=len(payload.configmaps), annotations=annotations)


def _empty_stale_shards(
    api: ControlApi, namespace: str, pool: str, *, used: int, annotations: Mapping[str, str]
) -> None:
    for index in range(used, used + _MAX_STALE_PROBE):
        name = configmap_name(pool, index)
        found = api.read_configmap_files(namespace, name)
        if found is None:
            return
        if found[0]:
            gone: dict[str, bytes | None] = dict.fromkeys(found[0])
            api.write_configmap_files(namespace, name, gone, annotations=annotations, create_metadata={})
