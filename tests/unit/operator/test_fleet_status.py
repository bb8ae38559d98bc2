"""Status and conditions: what a person reading `kubectl get inferencepool -o yaml` can act on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet.memory import MemoryOutcome
from cacheroute.operator.fleet.profiling_job import plan_for_pool, resolve_architecture
from cacheroute.operator.fleet.reconcile import Reconciler
from cacheroute.operator.fleet.status import (
    FleetFacts,
    PodFacts,
    WorkloadFacts,
    build_status,
    pod_facts,
    same_status,
    verdicts,
)

SPEC = InferencePoolSpec.model_validate(
    {"model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "fp8"}, "tensorParallelSize": 2,
     "replicas": 3}
)
PLANNED = MemoryOutcome("Planned", "planned", plan=plan_for_pool(SPEC, resolve_architecture(SPEC)))
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def pod(i: int, *, ready: bool = True, unschedulable: str = "", terminating: bool = False) -> PodFacts:
    return PodFacts(name=f"llama-{i}", ordinal=i, ip="" if unschedulable else f"10.0.0.{i}", ready=ready,
                    terminating=terminating, phase="Pending" if unschedulable else "Running",
                    unschedulable=unschedulable)


def workload(replicas: int, ready: int, updated: int | None = None, *, revisions: tuple[str, str] = ("a", "a"),
             generation: int = 1, observed: int = 1) -> WorkloadFacts:
    return WorkloadFacts(generation=generation, observed_generation=observed, replicas=replicas, ready_replicas=ready,
                         updated_replicas=replicas if updated is None else updated, available_replicas=ready,
                         current_revision=revisions[0], update_revision=revisions[1])


ROUTER = workload(2, 2)


def test_all_replicas_ready_and_routable_is_ready() -> None:
    facts = FleetFacts([pod(0), pod(1), pod(2)], workload(3, 3), ROUTER)
    v = verdicts(SPEC, PLANNED, facts)
    assert (v["Ready"].status, v["Progressing"].status, v["Degraded"].status, v["MemoryPlanned"].status) == (
        "True", "False", "False", "True")


def test_a_replica_the_scheduler_cannot_place_is_insufficient_gpus_with_its_message() -> None:
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    facts = FleetFacts([pod(0), pod(1), pod(2, ready=False, unschedulable=message)], workload(3, 2), ROUTER)
    v = verdicts(SPEC, PLANNED, facts)
    assert (v["Ready"].status, v["Ready"].reason) == ("False", "InsufficientGPUs")
    assert (v["Degraded"].status, v["Degraded"].reason) == ("True", "InsufficientGPUs")
    assert message.rstrip(".") in v["Ready"].message and "llama-2" in v["Ready"].message
    assert "2 x nvidia.com/gpu" in v["Degraded"].message


def test_a_gpu_product_no_node_has_is_insufficient_gpus_naming_the_label() -> None:
    message = "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."
    spec = SPEC.model_copy(update={"gpu": SPEC.gpu.model_copy(update={"product": "NVIDIA-A100-SXM4-80GB"})})
    facts = FleetFacts([pod(0, ready=False, unschedulable=message), pod(1), pod(2)], workload(3, 2), ROUTER)
    v = verdicts(spec, PLANNED, facts)
    assert (v["Ready"].reason, v["Degraded"].status, v["Degraded"].reason) == (
        "InsufficientGPUs", "True", "InsufficientGPUs")
    assert "nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB" in v["Degraded"].message


def test_a_host_tier_no_node_can_hold_is_insufficient_memory_naming_the_tier() -> None:
    message = "0/4 nodes are available: 4 Insufficient memory."
    spec = SPEC.model_copy(update={"memory": SPEC.memory.model_copy(update={"host_kv_cache_gib": 60000})})
    tiered = MemoryOutcome("Planned", "planned", plan=plan_for_pool(spec, resolve_architecture(spec)))
    facts = FleetFacts([pod(0, ready=False, unschedulable=message), pod(1), pod(2)], workload(3, 2), ROUTER)
    v = verdicts(spec, tiered, facts)
    assert (v["Ready"].reason, v["Degraded"].reason) == ("InsufficientMemory", "InsufficientMemory")
    assert "host KV tier (60000 GiB)" in v["Degraded"].message and "memory.hostKvCacheGib" in v["Degraded"].message
    assert "nvidia.com/gpu" not in v["Degraded"].message
    # Without a tier the pod asks the configured memory.
    v = verdicts(SPEC, PLANNED, facts)
    assert v["Degraded"].reason == "InsufficientMemory" and "engine.memoryRequest" in v["Degraded"].message


def test_a_replica_unschedulable_for_another_reason_is_degraded_not_left_starting() -> None:
    message = "0/4 nodes are available: 4 node(s) had untolerated taint {maintenance: true}."
    facts = FleetFacts([pod(0), pod(1), pod(2, ready=False, unschedulable=message)], workload(3, 2), ROUTER)
    v = verdicts(SPEC, PLANNED, facts)
    assert (v["Ready"].status, v["Ready"].reason) == ("False", "Unschedulable")
    assert (v["Degraded"].status, v["Degraded"].reason) == ("True", "Unschedulable")
    assert "untolerated taint" in v["Degraded"].message and ".." not in v["Degraded"].message


def test_a_rollout_is_updating_and_a_slow_start_is_pods_not_ready() -> None:
    rolling = FleetFacts([pod(0), pod(1, ready=False), pod(2)], workload(3, 2, updated=1, revisions=("a", "b")), ROUTER)
    v = verdicts(SPEC, PLANNED, rolling)
    assert (v["Ready"].reason, v["Progressing"].status, v["Progressing"].reason) == ("Updating", "True", "Updating")
    starting = FleetFacts([pod(0), pod(1, ready=False), pod(2, ready=False)], workload(3, 1), ROUTER)
    v = verdicts(SPEC, PLANNED, starting)
    assert (v["Ready"].reason, v["Progressing"].reason, v["Degraded"].status) == ("PodsNotReady", "Starting", "False")


def test_a_deleted_pod_is_pods_not_ready_not_a_rollout() -> None:
    # The StatefulSet counts updated pods among those that exist: one fewer while llama-1 is gone.
    gone = FleetFacts([pod(0), pod(2)], workload(2, 2, updated=2), ROUTER)
    v = verdicts(SPEC, PLANNED, gone)
    assert (v["Ready"].reason, v["Progressing"].reason) == ("PodsNotReady", "ScalingUp")
    leaving = verdicts(SPEC, PLANNED, FleetFacts([pod(0), pod(1, terminating=True), pod(2)], workload(3, 2), ROUTER))
    assert leaving["Ready"].message == "2/3 replicas ready; llama-1 terminating (replaced once gone)"
    assert leaving["Progressing"].message == "2 of 3 replicas exist; llama-1 terminating (replaced once gone)"
    back = FleetFacts([pod(0), pod(1, ready=False), pod(2)], workload(3, 2, updated=3), ROUTER)
    v = verdicts(SPEC, PLANNED, back)
    assert (v["Ready"].reason, v["Progressing"].reason) == ("PodsNotReady", "Starting")
    # Without revisions in the StatefulSet's status, the updated count is all there is to go by.
    unknown = FleetFacts([pod(0), pod(1), pod(2)], workload(3, 3, updated=2, revisions=("", "")), ROUTER)
    assert verdicts(SPEC, PLANNED, unknown)["Progressing"].reason == "Updating"


def test_facts_read_before_the_new_spec_was_applied_do_not_say_the_rollout_is_complete() -> None:
    # kopf's index still holds the StatefulSet of the previous spec, settled, all replicas ready.
    before = FleetFacts([pod(0), pod(1), pod(2)], workload(3, 3, generation=4, observed=4), ROUTER)
    assert verdicts(SPEC, PLANNED, before)["Progressing"].reason == "Complete"
    # The operator applied the new spec as generation 5: nothing has rolled yet.
    v = verdicts(SPEC, PLANNED, before.applied(5))
    assert (v["Progressing"].status, v["Progressing"].reason) == ("True", "Updating")
    # Its updated count is the previous spec's: "3/3 updated" would say the rollout is done.
    assert "3/3" not in v["Progressing"].message and "has not taken it yet" in v["Progressing"].message
    # Once the index shows generation 5 (or later), the facts speak for themselves.
    assert before.applied(4) is before and before.applied(0) is before


def test_a_pool_scaled_to_zero_is_not_ready_and_says_why() -> None:
    zero = SPEC.model_copy(update={"replicas": 0})
    v = verdicts(zero, PLANNED, FleetFacts([], workload(0, 0), workload(0, 0)))
    assert (v["Ready"].status, v["Ready"].reason) == ("False", "ScaledToZero")
    assert (v["Degraded"].status, v["Progressing"].reason) == ("False", "Complete")


def test_no_available_router_is_not_ready() -> None:
    facts = FleetFacts([pod(0), pod(1), pod(2)], workload(3, 3), workload(2, 0))
    assert verdicts(SPEC, PLANNED, facts)["Ready"].reason == "RouterNotReady"


def test_a_pool_published_to_gie_without_its_crds_is_degraded_but_ready() -> None:
    facts = FleetFacts([pod(0), pod(1), pod(2)], workload(3, 3), ROUTER)
    v = verdicts(SPEC, PLANNED, facts, gie_missing=True)
    assert (v["Ready"].status, v["Degraded"].status, v["Degraded"].reason) == ("True", "True", "GIENotInstalled")
    assert "spec.gie.enabled to false" in v["Degraded"].message
    assert verdicts(SPEC, PLANNED, facts)["Degraded"].status == "False"


def test_a_pool_without_routers_is_ready_and_says_it_has_none() -> None:
    spec = SPEC.model_copy(update={"router": SPEC.router.model_copy(update={"replicas": 0})})
    v = verdicts(spec, PLANNED, FleetFacts([pod(0), pod(1), pod(2)], workload(3, 3), None))
    assert (v["Ready"].status, v["Ready"].reason) == ("True", "Ready")
    assert "no router" in v["Ready"].message and "routable through the router" not in v["Ready"].message


def test_a_pool_that_does_not_fit_is_degraded_and_not_progressing() -> None:
    outcome = MemoryOutcome("DoesNotFit", "llama-3.3-70b (bf16) at TP=1 does not fit on h100-80gb: 97.78 GiB missing")
    v = verdicts(SPEC, outcome, FleetFacts([], None, None))
    assert (v["MemoryPlanned"].status, v["MemoryPlanned"].reason) == ("False", "DoesNotFit")
    assert (v["Degraded"].status, v["Ready"].status, v["Progressing"].status) == ("True", "False", "False")
    assert "97.78 GiB missing" in v["Degraded"].message
    assert "no engine or router pod runs meanwhile" in v["Degraded"].message
    # A spec change that does not fit leaves the replicas of the earlier spec serving, and says so.
    earlier = verdicts(SPEC, outcome, FleetFacts([pod(0), pod(1)], workload(2, 2), ROUTER))
    assert "the running replicas are left as they are" in earlier["Degraded"].message


def test_an_ipv6_pod_address_is_written_in_brackets_as_routers_read_it() -> None:
    v6 = PodFacts(name="llama-0", ordinal=0, ip="fd00:10::7", ready=True, terminating=False, phase="Running",
                  unschedulable="")
    status = build_status(SPEC, 1, memory=PLANNED, facts=FleetFacts([v6], workload(1, 1), ROUTER), previous={},
                          now=NOW)
    assert status["destinations"][0]["address"] == "[fd00:10::7]:8000"


def test_profiling_is_unknown_then_failure_is_degraded() -> None:
    profiling = verdicts(SPEC, MemoryOutcome("Profiling", "Job running"), FleetFacts([], None, None))
    assert (profiling["MemoryPlanned"].status, profiling["Ready"].reason) == ("Unknown", "Profiling")
    failed = verdicts(SPEC, MemoryOutcome("ProfilingFailed", "vLLM failed (cuda_oom)"), FleetFacts([], None, None))
    assert (failed["Degraded"].status, failed["Degraded"].reason) == ("True", "ProfilingFailed")


def test_destinations_skip_terminating_and_surplus_replicas() -> None:
    facts = FleetFacts([pod(0), pod(1), pod(2), pod(3), pod(4, terminating=True)], workload(5, 5), ROUTER)
    status = build_status(SPEC, 4, memory=PLANNED, facts=facts, previous={}, now=NOW)
    assert [d["id"] for d in status["destinations"]] == ["llama-0", "llama-1", "llama-2"]
    assert status["destinations"][0] == {"id": "llama-0", "address": "10.0.0.0:8000", "ready": True}
    assert (status["replicas"], status["readyReplicas"], status["observedGeneration"]) == (3, 3, 4)
    assert status["memoryPlan"]["kvCapacityTokens"] > 0 and status["memoryPlan"]["source"] == "Analytic"
    assert [c["type"] for c in status["conditions"]] == ["Ready", "MemoryPlanned", "Progressing", "Degraded"]
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])


def test_transition_time_moves_only_when_the_status_changes() -> None:
    ready = FleetFacts([pod(0), pod(1), pod(2)], workload(3, 3), ROUTER)
    first = build_status(SPEC, 1, memory=PLANNED, facts=ready, previous={}, now=NOW)
    later = build_status(SPEC, 1, memory=PLANNED, facts=ready, previous=first, now=NOW + timedelta(minutes=5))
    assert later == first and same_status(first, later)
    broken = FleetFacts([pod(0), pod(1), pod(2, ready=False)], workload(3, 2), ROUTER)
    changed = build_status(SPEC, 1, memory=PLANNED, facts=broken, previous=first, now=NOW + timedelta(minutes=6))
    stamps = {c["type"]: c["lastTransitionTime"] for c in changed["conditions"]}
    assert stamps["Ready"] == "2026-11-30T12:06:00Z" and stamps["MemoryPlanned"] == "2026-11-30T12:00:00Z"
    assert not same_status(first, changed)


def test_pod_facts_read_the_scheduler_and_the_kubelet() -> None:
    pending = {
        "metadata": {"name": "llama-7"},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]},
    }
    facts = pod_facts(pending)
    assert facts is not None and facts.ordinal == 7 and "Insufficient" in facts.unschedulable and not facts.ready
    crashing = {"metadata": {"name": "llama-0"}, "status": {"phase": "Running", "podIP": "10.0.0.1",
                "containerStatuses": [{"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    assert (pod_facts(crashing) or pod(0)).failing == "CrashLoopBackOff"
    assert pod_facts({"metadata": {"name": "llama-memprofile-abc"}}) is None


def _conditions(**reasons: tuple[str, str]) -> dict[str, Any]:
    return {"conditions": [{"type": kind, "status": status, "reason": reason, "message": f"{kind} message"}
                           for kind, (status, reason) in reasons.items()]}


def test_a_fault_the_pool_served_through_is_answered_when_it_ends() -> None:
    told: list[tuple[str, str, str]] = []

    def emit(kind: str, reason: str, message: str) -> None:
        told.append((kind, reason, message))

    gie_missing = _conditions(Ready=("True", "Ready"), Degraded=("True", "GIENotInstalled"))
    published = _conditions(Ready=("True", "Ready"), Degraded=("False", "AsExpected"))
    Reconciler._announce_conditions(gie_missing, published, emit)
    assert told == [("Normal", "Recovered", "no longer GIENotInstalled: the pool is not degraded")]
    # A fault that took the pool down is answered by Ready turning True, once.
    told.clear()
    down = _conditions(Ready=("False", "InsufficientGPUs"), Degraded=("True", "InsufficientGPUs"))
    Reconciler._announce_conditions(down, published, emit)
    assert [(kind, reason) for kind, reason, _ in told] == [("Normal", "Ready")]
    # Nothing changed, nothing told.
    told.clear()
    Reconciler._announce_conditions(published, published, emit)
    assert told == []
