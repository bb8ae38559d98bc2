"""InferencePool status: replicas, destinations, memory plan and conditions a person can act on.

Pure: facts about the pool's objects in (gathered from the operator's watch caches), the status
document out. Conditions follow metav1.Condition; a condition keeps its lastTransitionTime while
its status stays the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet.memory import MemoryOutcome
from cacheroute.operator.fleet.profiling_job import memory_plan_status
from cacheroute.operator.fleet.statefulset import GPU_PRODUCT_LABEL
from cacheroute.planner.plan import host_port

ConditionStatus = Literal["True", "False", "Unknown"]
CONDITION_TYPES = ("Ready", "MemoryPlanned", "Progressing", "Degraded")


@dataclass(frozen=True)
class PodFacts:
    """One engine pod as the status needs it."""

    name: str
    ordinal: int
    ip: str
    ready: bool
    terminating: bool
    phase: str
    # The scheduler's message when the pod cannot be placed (PodScheduled=False, Unschedulable).
    unschedulable: str = ""
    # A container stuck restarting (CrashLoopBackOff and the like): its reason.
    failing: str = ""


@dataclass(frozen=True)
class WorkloadFacts:
    """A StatefulSet or Deployment: what its controller reports."""

    generation: int
    observed_generation: int
    replicas: int
    ready_replicas: int
    updated_replicas: int
    available_replicas: int
    current_revision: str = ""
    update_revision: str = ""

    @property
    def settled(self) -> bool:
        return self.observed_generation >= self.generation


@dataclass(frozen=True)
class FleetFacts:
    pods: Sequence[PodFacts]
    statefulset: WorkloadFacts | None
    router: WorkloadFacts | None

    def applied(self, statefulset_generation: int) -> FleetFacts:
        """These facts, knowing the StatefulSet was applied at `statefulset_generation`: if they
        show an older one, its controller has not seen the new spec yet (not settled)."""
        sts = self.statefulset
        if sts is None or sts.generation >= statefulset_generation:
            return self
        return replace(self, statefulset=replace(sts, generation=statefulset_generation))


def pod_facts(pod: Mapping[str, Any]) -> PodFacts | None:
    """Facts of an engine pod from its API object (None for a pod that is not a replica)."""
    meta = pod.get("metadata") or {}
    name = str(meta.get("name", ""))
    _, _, suffix = name.rpartition("-")
    if not suffix.isdigit():
        return None
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = str(scheduled.get("message") or "unschedulable")
    failing = ""
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerError"):
            failing = str(waiting["reason"])
    return PodFacts(
        name=name,
        ordinal=int(suffix),
        ip=str(status.get("podIP") or ""),
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        phase=str(status.get("phase") or ""),
        unschedulable=unschedulable,
        failing=failing,
    )


def workload_facts(obj: Mapping[str, Any]) -> WorkloadFacts:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    return WorkloadFacts(
        generation=int(meta.get("generation") or 0),
        observed_generation=int(status.get("observedGeneration") or 0),
        replicas=int(status.get("replicas") or 0),
        ready_replicas=int(status.get("readyReplicas") or 0),
        updated_replicas=int(status.get("updatedReplicas") or 0),
        available_replicas=int(status.get("availableReplicas") or 0),
        current_revision=str(status.get("currentRevision") or ""),
        update_revision=str(status.get("updateRevision") or ""),
    )


@dataclass(frozen=True)
class Verdict:
    status: ConditionStatus
    reason: str
    message: str


def destinations(pods: Iterable[PodFacts], replicas: int, port: int) -> list[dict[str, Any]]:
    """The replicas that exist and are meant to (ordinal below spec.replicas, not terminating)."""
    out = []
    for pod in sorted(pods, key=lambda p: p.ordinal):
        if pod.ordinal >= replicas or pod.terminating:
            continue
        out.append({"id": pod.name, "address": host_port(pod.ip, port) if pod.ip else "", "ready": pod.ready})
    return out


# The scheduler's words for "no node has the GPUs": too few free, or no node of the pool's
# product at all (the replicas' node selector on `gpu.product` matches none).
_GPU_SHORTFALL_MARKS = ("Insufficient", "node affinity/selector")


def _shortfall_reason(pod: PodFacts, spec: InferencePoolSpec) -> str:
    message = pod.unschedulable
    if "Insufficient memory" in message and spec.gpu.resource_name not in message:
        return "InsufficientMemory"
    if spec.gpu.resource_name in message or any(mark in message for mark in _GPU_SHORTFALL_MARKS):
        return "InsufficientGPUs"
    return "Unschedulable"


def _needs(reason: str, spec: InferencePoolSpec, memory: MemoryOutcome) -> str:
    """What one replica asks of a node, for the shortfall `reason`."""
    if reason != "InsufficientMemory":
        return (f"Each needs {spec.tensor_parallel_size} x {spec.gpu.resource_name} on one node labelled "
                f"{GPU_PRODUCT_LABEL}={spec.gpu.product}.")
    host = memory.plan.host if memory.plan is not None else None
    if host is None or not host.bytes:
        return "Each needs the operator's engine.memoryRequest of host memory on one node."
    return (
        f"Each needs {host.pod_memory_bytes / 2**30:,.0f} GiB of host memory on one node: its host KV tier "
        f"({host.gib:g} GiB) and the reserve of its GPUs. Lower memory.hostKvCacheGib, or give gpu.nodeMemoryGib "
        "so that auto sizes the tier to the node."
    )


def verdicts(
    spec: InferencePoolSpec, memory: MemoryOutcome, facts: FleetFacts, *, gie_missing: bool = False
) -> dict[str, Verdict]:
    """The four conditions, most actionable reason first. `gie_missing`: `spec.gie.enabled`, and
    the cluster serves no GIE InferencePool to publish the pool as."""
    pods = [p for p in facts.pods if p.ordinal < spec.replicas and not p.terminating]
    ready = sum(1 for p in pods if p.ready)
    # A replica the StatefulSet replaces only once its pod is gone: named, so that one stuck
    # terminating (its node or kubelet not answering) is found from the pool.
    leaving = [p.name for p in facts.pods if p.ordinal < spec.replicas and p.terminating]
    still = f"; {', '.join(leaving)} terminating (replaced once gone)" if leaving else ""
    sts = facts.statefulset
    out: dict[str, Verdict] = {}

    if memory.state == "Planned":
        out["MemoryPlanned"] = Verdict("True", "Planned", memory.message)
    elif memory.state == "Profiling":
        out["MemoryPlanned"] = Verdict("Unknown", "Profiling", memory.message)
    else:
        out["MemoryPlanned"] = Verdict("False", memory.state, memory.message)

    if not memory.planned:
        if memory.state == "Profiling":
            out["Ready"] = Verdict("False", "Profiling", "waiting for the profiling Job: " + memory.message)
            out["Progressing"] = Verdict("True", "Profiling", memory.message)
            out["Degraded"] = Verdict("False", "AsExpected", "")
        else:
            message = memory.message + (
                " (the running replicas are left as they are)" if sts else " (no engine or router pod runs meanwhile)"
            )
            out["Ready"] = Verdict("False", memory.state, message)
            out["Progressing"] = Verdict("False", memory.state, "nothing to do until the spec changes")
            out["Degraded"] = Verdict("True", memory.state, message)
        return out

    short = [p for p in pods if p.unschedulable]
    failing = [p for p in pods if p.failing]
    # A rollout is the StatefulSet's revisions differing: its updated count also drops when a pod
    # is deleted (the count is of existing pods), which is no rollout; it is read only when the
    # controller reports no revisions.
    updating = sts is not None and (
        not sts.settled
        or (
            sts.current_revision != sts.update_revision
            if sts.update_revision
            else sts.updated_replicas < spec.replicas
        )
    )
    router_ok = spec.router.replicas == 0 or (facts.router is not None and facts.router.available_replicas > 0)
    if short:
        names = ", ".join(p.name for p in short)
        detail = short[0].unschedulable.rstrip(". ")
        reason = _shortfall_reason(short[0], spec)
        out["Degraded"] = Verdict(
            "True", reason,
            f"{len(short)} replica(s) cannot be scheduled ({names}): {detail}. {_needs(reason, spec, memory)}",
        )
    elif failing:
        out["Degraded"] = Verdict(
            "True", "ReplicasFailing", ", ".join(f"{p.name}: {p.failing}" for p in failing)
        )
    elif gie_missing:
        out["Degraded"] = Verdict(
            "True", "GIENotInstalled",
            "spec.gie.enabled, but the cluster serves no inference.networking.k8s.io/v1 InferencePool: install "
            "the Gateway API Inference Extension's CRDs, or set spec.gie.enabled to false. The pool's own "
            "routers serve it meanwhile.",
        )
    else:
        out["Degraded"] = Verdict("False", "AsExpected", "")

    if sts is None:
        out["Progressing"] = Verdict("True", "Creating", "creating the StatefulSet")
    elif updating and not sts.settled:
        # Its counts are of the previous spec until its controller takes the new one.
        out["Progressing"] = Verdict(
            "True", "Updating", "applying the new spec: the StatefulSet's controller has not taken it yet"
        )
    elif updating:
        out["Progressing"] = Verdict(
            "True", "Updating", f"rolling out one replica at a time: {sts.updated_replicas}/{spec.replicas} updated"
        )
    elif len(pods) < spec.replicas or sts.replicas > spec.replicas:
        reason = "ScalingUp" if sts.replicas <= spec.replicas else "ScalingDown"
        out["Progressing"] = Verdict("True", reason, f"{len(pods)} of {spec.replicas} replicas exist{still}")
    elif ready < spec.replicas:
        out["Progressing"] = Verdict("True", "Starting", f"{ready}/{spec.replicas} replicas ready")
    else:
        out["Progressing"] = Verdict("False", "Complete", f"{spec.replicas} replicas up to date")

    if spec.replicas == 0:
        out["Ready"] = Verdict("False", "ScaledToZero", "spec.replicas is 0: no engine serves, and no router pod runs")
    elif short:
        out["Ready"] = Verdict("False", out["Degraded"].reason, out["Degraded"].message)
    elif ready < spec.replicas:
        reason = "Updating" if updating else "PodsNotReady"
        out["Ready"] = Verdict("False", reason, f"{ready}/{spec.replicas} replicas ready{still}")
    elif not router_ok:
        out["Ready"] = Verdict("False", "RouterNotReady", f"no router replica of {spec.router.replicas} is available")
    elif spec.router.replicas == 0:
        out["Ready"] = Verdict(
            "True", "Ready", f"{ready}/{spec.replicas} replicas ready; no router of its own (router.replicas is 0): "
            "routers run elsewhere, or clients reach the engines directly"
        )
    else:
        out["Ready"] = Verdict("True", "Ready", f"{ready}/{spec.replicas} replicas ready, routable through the router")
    return out


def conditions(
    verdict: Mapping[str, Verdict],
    previous: Iterable[Mapping[str, Any]],
    generation: int,
    now: datetime,
) -> list[dict[str, Any]]:
    """metav1.Conditions; lastTransitionTime moves only when the status changes."""
    before = {c.get("type"): c for c in previous}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    out = []
    for kind in CONDITION_TYPES:
        v = verdict[kind]
        old = before.get(kind)
        changed = old is None or old.get("status") != v.status
        out.append(
            {
                "type": kind,
                "status": v.status,
                "observedGeneration": generation,
                "lastTransitionTime": stamp if changed or not old else old.get("lastTransitionTime", stamp),
                "reason": v.reason,
                "message": v.message[:32768],
            }
        )
    return out


def build_status(
    spec: InferencePoolSpec,
    generation: int,
    *,
    memory: MemoryOutcome,
    facts: FleetFacts,
    previous: Mapping[str, Any],
    now: datetime,
    gie_missing: bool = False,
) -> dict[str, Any]:
    """The whole status document, in wire (camelCase) form."""
    dests = destinations(facts.pods, spec.replicas, spec.engine.port)
    out: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": len(dests),
        "readyReplicas": sum(1 for d in dests if d["ready"]),
        "destinations": dests,
        "conditions": conditions(
            verdicts(spec, memory, facts, gie_missing=gie_missing), previous.get("conditions") or [], generation, now
        ),
    }
    if memory.plan is not None:
        plan_status = memory_plan_status(memory.plan).wire()
        if memory.profile_key:
            plan_status.setdefault("inputs", {})["profileKey"] = memory.profile_key
        out["memoryPlan"] = plan_status
    elif previous.get("memoryPlan") and memory.state in ("Profiling", "DoesNotFit", "ProfilingFailed"):
        # The replicas still run the last plan; keep saying which.
        out["memoryPlan"] = previous["memoryPlan"]
    return out


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that makes `previous` into `new`: a merge patch keeps the keys it does not
    name, so those of the memory plan (and its inputs) that the new plan lacks are named null."""
    patch = dict(new)
    old_plan, new_plan = previous.get("memoryPlan"), new.get("memoryPlan")
    if isinstance(old_plan, Mapping) and isinstance(new_plan, Mapping):
        plan: dict[str, Any] = {k: None for k in old_plan if k not in new_plan} | dict(new_plan)
        old_inputs, new_inputs = old_plan.get("inputs"), new_plan.get("inputs")
        if isinstance(old_inputs, Mapping) and isinstance(new_inputs, Mapping):
            plan["inputs"] = {k: None for k in old_inputs if k not in new_inputs} | dict(new_inputs)
        patch["memoryPlan"] = plan
    return patch


def same_status(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal apart from condition timestamps (which only move with a status change anyway)."""

    def strip(s: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(s)
        out["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or []
        ]
        return out

    return strip(a) == strip(b)
