"""One pass of making a pool's objects match its spec, then its status match the cluster.

Level-triggered: every pass computes every owned object from the spec and server-side-applies it,
so an object deleted or edited by hand comes back as specified. Passes for the same pool never
overlap (the caller holds the pool's lock); `PoolMemory` is what a pass remembers for the next
one in this process (nothing in it is needed for correctness after a restart).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.fleet import gie, names, pdb, planmap, router, services, statefulset, status
from cacheroute.operator.fleet.cluster import Cluster, KubeError
from cacheroute.operator.fleet.memory import STOPPED_STATES, MemoryOutcome, decide
from cacheroute.operator.fleet.profiles import ClusterMemoryInputs

log = logging.getLogger("cacheroute.operator.fleet")

EventType = Literal["Normal", "Warning"]
# (type, reason, message): an Event on the pool.
EventSink = Callable[[EventType, str, str], None]


# Degraded reasons told by an Event when they start (the others have Events of their own).
_ANNOUNCED_FAILURES = frozenset({"InsufficientGPUs", "InsufficientMemory", "Unschedulable", "ReplicasFailing"})


@dataclass
class PoolMemory:
    """What one process remembers of a pool between passes."""

    memory: MemoryOutcome | None = None
    memory_generation: int = -1
    applied_generation: int = -1
    uids: dict[str, str] = field(default_factory=dict)
    template_digest: str = ""
    last_status: dict[str, Any] | None = None
    gie_checked_generation: int = -1
    # spec.gie.enabled, and no GIE InferencePool CRD was served at the last check.
    gie_missing: bool = False
    # The memory outcome (state, message) the pool's status already told when this process
    # first saw it: not announced again by a restarted operator.
    told_memory: tuple[str, str] | None = None
    # The generation of the StatefulSet as this process last applied it: facts read before that
    # (kopf's index lags the apply) describe the previous spec, not a rollout that is done.
    statefulset_generation: int = 0

    @classmethod
    def resumed(cls, status: Mapping[str, Any]) -> PoolMemory:
        """What a process first seeing a pool knows from its status: what earlier Events told."""
        conditions = {str(c.get("type")): c for c in status.get("conditions") or []}
        memory = conditions.get("MemoryPlanned") or {}
        degraded = conditions.get("Degraded") or {}
        return cls(
            told_memory=(str(memory["reason"]), str(memory.get("message", ""))) if memory.get("reason") else None,
            gie_missing=degraded.get("status") == "True" and degraded.get("reason") == "GIENotInstalled",
        )


@dataclass(frozen=True)
class DesiredObjects:
    """Everything a pool owns, as it should be.

    `engine` objects are applied first (the replicas take longest to come up), then `apply`;
    `create_only` objects are created when missing and never overwritten.
    """

    engine: list[dict[str, Any]]
    apply: list[dict[str, Any]]
    create_only: list[dict[str, Any]]
    gie: dict[str, Any] | None


def desired_objects(
    pool: names.PoolRef,
    spec: InferencePoolSpec,
    memory: MemoryOutcome,
    config: OperatorConfig,
    *,
    engine_exists: bool = True,
) -> DesiredObjects:
    """`engine_exists`: a StatefulSet of the pool is there (perhaps of an earlier spec)."""
    # A pool that cannot start and has no replicas left to serve runs no router either, nor does
    # one scaled to zero.
    idle = (memory.state in STOPPED_STATES and not engine_exists) or spec.replicas == 0
    engine: list[dict[str, Any]] = []
    if memory.planned and memory.plan is not None:
        engine.append(statefulset.build_statefulset(pool, spec, memory.plan, config.engine))
    engine.append(services.build_headless_service(pool, spec))
    return DesiredObjects(
        engine=engine,
        apply=[
            pdb.build_pdb(pool),
            pdb.build_router_pdb(pool),
            router.build_service_account(pool),
            router.build_role(pool),
            router.build_role_binding(pool),
            router.build_deployment(pool, spec, config, memory.plan if memory.planned else None, idle=idle),
            services.build_router_service(pool),
        ],
        create_only=planmap.build_plan_configmaps(pool, spec),
        gie=gie.build_gie_pool(pool, spec) if spec.gie.enabled else None,
    )


def _key(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class Reconciler:
    def __init__(self, cluster: Cluster, config: OperatorConfig, now: Callable[[], datetime] | None = None) -> None:
        self.cluster = cluster
        self.config = config
        self.now = now or (lambda: datetime.now(UTC))

    # --- memory plan -------------------------------------------------------------------------------

    def _memory(
        self,
        pool: names.PoolRef,
        spec: InferencePoolSpec,
        generation: int,
        mem: PoolMemory,
        emit: EventSink,
        *,
        full: bool,
    ) -> MemoryOutcome:
        """The memory outcome; decided again on full passes, spec changes and while profiling."""
        fresh = mem.memory is not None and mem.memory_generation == generation and mem.memory.state != "Profiling"
        if fresh and not full and mem.memory is not None:
            return mem.memory
        inputs = ClusterMemoryInputs(self.cluster, pool.namespace)
        outcome, job = decide(pool, spec, inputs, now=self.now(), profiling=self.config.profiling)
        if job is not None and self.cluster.create_if_missing(job):
            emit("Normal", "ProfilingStarted", f"profiling Job {job['metadata']['name']} boots vLLM once to measure")
        if outcome.new_profile is not None and outcome.profile_key:
            inputs.store_profile(outcome.profile_key, outcome.new_profile, {"pool": pool.name})
        before = mem.memory
        told = (before.state, before.message) if before is not None else mem.told_memory
        if told != (outcome.state, outcome.message):
            self._announce(outcome, before, emit)
        mem.memory, mem.memory_generation = outcome, generation
        return outcome

    @staticmethod
    def _announce(outcome: MemoryOutcome, before: MemoryOutcome | None, emit: EventSink) -> None:
        if outcome.state == "Planned":
            if before is None or before.state != "Planned" or before.message != outcome.message:
                emit("Normal", "MemoryPlanned", outcome.message)
        elif outcome.state in ("DoesNotFit", "ProfilingFailed", "InvalidModel"):
            emit("Warning", outcome.state, outcome.message)

    # --- objects -----------------------------------------------------------------------------------

    def _apply(self, objects: list[dict[str, Any]], mem: PoolMemory, emit: EventSink) -> None:
        for obj in objects:
            key = _key(obj)
            if obj["kind"] == "StatefulSet":
                digest = _digest(obj["spec"]["template"])
                if mem.template_digest and digest != mem.template_digest:
                    emit("Normal", "RollingUpdate", "engine pods change (image, model, arguments or memory plan); "
                         "replacing one replica at a time")
                mem.template_digest = digest
            result = self.cluster.apply(obj)
            if obj["kind"] == "StatefulSet":
                mem.statefulset_generation = int(result["metadata"].get("generation") or 0)
            uid = str(result["metadata"]["uid"])
            if key in mem.uids and mem.uids[key] != uid:
                emit("Warning", "Recreated", f"{key} had been deleted; created it again")
            mem.uids[key] = uid

    def _apply_rest(self, pool: names.PoolRef, spec: InferencePoolSpec, desired: DesiredObjects, mem: PoolMemory,
                    emit: EventSink) -> None:
        self._apply(desired.apply, mem, emit)
        for obj in desired.create_only:
            if self.cluster.create_if_missing(obj) and _key(obj) in mem.uids:
                emit("Warning", "Recreated", f"{_key(obj)} had been deleted; created it again, holding an empty plan")
            mem.uids.setdefault(_key(obj), "created")
        self._gie(pool, spec, desired.gie, mem, emit)

    def _gie(
        self,
        pool: names.PoolRef,
        spec: InferencePoolSpec,
        obj: dict[str, Any] | None,
        mem: PoolMemory,
        emit: EventSink,
    ) -> None:
        installed = self.cluster.serves(gie.GIE_GROUP, gie.GIE_VERSION, gie.GIE_PLURAL)
        was_missing, mem.gie_missing = mem.gie_missing, obj is not None and not installed
        if obj is not None:
            if installed:
                self.cluster.apply(obj)
            elif not was_missing:
                # Told when it starts; while it lasts the Degraded condition says it.
                emit("Warning", "GIENotInstalled",
                     "spec.gie.enabled but the inference.networking.k8s.io/v1 InferencePool CRD is not installed")
        elif installed and mem.gie_checked_generation != mem.applied_generation:
            api_version = f"{gie.GIE_GROUP}/{gie.GIE_VERSION}"
            existing = self.cluster.get(api_version, "InferencePool", pool.namespace, pool.name)
            owners = ((existing or {}).get("metadata") or {}).get("ownerReferences") or []
            if any(o.get("uid") == pool.uid for o in owners):
                self.cluster.delete(api_version, "InferencePool", pool.namespace, pool.name)
        mem.gie_checked_generation = mem.applied_generation

    # --- a pass ------------------------------------------------------------------------------------

    def engine_stage(
        self, pool: names.PoolRef, spec: InferencePoolSpec, generation: int, *, mem: PoolMemory, emit: EventSink,
        full: bool,
    ) -> MemoryOutcome:
        """The memory plan, and (when `full` or the spec changed) the StatefulSet and headless Service."""
        told: list[tuple[EventType, str, str]] = []
        memory = self._memory(pool, spec, generation, mem, lambda *event: told.append(event), full=full)
        try:
            if full or mem.applied_generation != generation:
                self._apply(desired_objects(pool, spec, memory, self.config).engine, mem, emit)
        finally:
            # The memory plan's Events once the engine objects are out: each is an API call, and
            # the pods wait for none of them; still before any status that records them.
            for event in told:
                emit(*event)
        return memory

    def rest_stage(
        self,
        pool: names.PoolRef,
        spec: InferencePoolSpec,
        generation: int,
        *,
        memory: MemoryOutcome,
        facts: status.FleetFacts,
        previous_status: Mapping[str, Any],
        mem: PoolMemory,
        emit: EventSink,
        full: bool,
    ) -> dict[str, Any]:
        """The other owned objects (when `full` or the spec changed), then the status if it changed."""
        if full or mem.applied_generation != generation:
            mem.applied_generation = generation
            desired = desired_objects(pool, spec, memory, self.config, engine_exists=facts.statefulset is not None)
            self._apply_rest(pool, spec, desired, mem, emit)
        return self.write_status(
            pool, spec, generation, memory=memory, facts=facts, previous_status=previous_status, mem=mem, emit=emit
        )

    def reconcile(
        self,
        pool: names.PoolRef,
        spec: InferencePoolSpec,
        generation: int,
        *,
        facts: status.FleetFacts,
        previous_status: Mapping[str, Any],
        mem: PoolMemory,
        emit: EventSink,
        full: bool,
    ) -> dict[str, Any]:
        """A whole pass: both stages in a row."""
        memory = self.engine_stage(pool, spec, generation, mem=mem, emit=emit, full=full)
        return self.rest_stage(
            pool, spec, generation, memory=memory, facts=facts, previous_status=previous_status, mem=mem, emit=emit,
            full=full,
        )

    def write_status(
        self,
        pool: names.PoolRef,
        spec: InferencePoolSpec,
        generation: int,
        *,
        memory: MemoryOutcome,
        facts: status.FleetFacts,
        previous_status: Mapping[str, Any],
        mem: PoolMemory,
        emit: EventSink,
    ) -> dict[str, Any]:
        previous = mem.last_status if mem.last_status is not None else dict(previous_status)
        facts = facts.applied(mem.statefulset_generation)
        new = status.build_status(
            spec, generation, memory=memory, facts=facts, previous=previous, now=self.now(), gie_missing=mem.gie_missing
        )
        if status.same_status(new, previous):
            return previous
        self._announce_conditions(previous, new, emit)
        try:
            self.cluster.patch_pool_status(pool.namespace, pool.name, status.status_patch(previous, new))
        except KubeError as exc:
            if exc.status == 404:  # the pool is being deleted
                return previous
            raise
        mem.last_status = new
        return new

    @staticmethod
    def _announce_conditions(before: Mapping[str, Any], after: Mapping[str, Any], emit: EventSink) -> None:
        old = {c["type"]: c for c in before.get("conditions") or []}
        turned_ready = False
        for cond in after.get("conditions") or []:
            prior = old.get(cond["type"])
            if prior and (prior.get("status"), prior.get("reason")) == (cond["status"], cond["reason"]):
                continue
            if cond["type"] == "Ready" and cond["status"] == "True":
                turned_ready = True
                emit("Normal", "Ready", cond["message"])
            elif cond["type"] == "Degraded" and cond["status"] == "True" and cond["reason"] in _ANNOUNCED_FAILURES:
                emit("Warning", cond["reason"], cond["message"])
            elif cond["type"] == "Degraded" and prior and prior.get("status") == "True" and not turned_ready:
                # A fault the pool served through (GIENotInstalled, a replica failing) is over:
                # its Warning gets an answer, which `Ready` turning True gives the others.
                emit("Normal", "Recovered", f"no longer {prior.get('reason')}: the pool is not degraded")
