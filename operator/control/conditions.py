"""The AffinityPlan's conditions, their reasons, and how a period's findings update them.

- `MetricsAvailable`: the last window was read from Prometheus and held traffic.
- `Planned`: the last period computed a candidate plan.
- `Applied`: the candidate is the plan in effect (Auto, Manual), or why not.
- `Degraded`: the last period could not do its job (the plan in effect stays meanwhile).
- `Ready`: a plan is in effect (Auto, Manual), or the last period reported one (Shadow).

A condition keeps its `lastTransitionTime` while its status does not change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

METRICS_AVAILABLE = "MetricsAvailable"
PLANNED = "Planned"
APPLIED = "Applied"
DEGRADED = "Degraded"
READY = "Ready"
ORDER = (READY, METRICS_AVAILABLE, PLANNED, APPLIED, DEGRADED)

# Reasons (CamelCase, as metav1.Condition requires).
METRICS_READ = "MetricsRead"
NO_TRAFFIC = "NoTraffic"
# Prometheus holds less than half of the routers' history in the window (it was down, or lost its
# data): a plan from what is left would drop every key not seen since.
INCOMPLETE_WINDOW = "IncompleteWindow"
PLAN_COMPUTED = "PlanComputed"
POOL_NOT_FOUND = "PoolNotFound"
POOL_NOT_READY = "PoolNotReady"
METRICS_UNAVAILABLE = "MetricsUnavailable"
INVALID_INPUT = "InvalidInput"
INVALID_PINNED = "InvalidPinned"
PINNED_ROUTES = "PinnedRoutes"
PLAN_APPLIED = "PlanApplied"
# The plan in effect became worse than no plan on recent traffic: only its pinned routes stay.
PLAN_WITHDRAWN = "PlanWithdrawn"
UNCHANGED = "Unchanged"
GUARD_REJECTED = "GuardRejected"
SHADOW_MODE = "ShadowMode"
EMPTY_PLAN = "EmptyPlan"
PUBLISH_FAILED = "PublishFailed"
POOL_CLAIMED = "PoolClaimed"
INVALID_PLAN = "InvalidPlan"
# An Event: the plan ConfigMaps in effect could not be read (edited by hand, or half-written).
PLAN_UNREADABLE = "PlanUnreadable"
AS_EXPECTED = "AsExpected"
PLAN_IN_EFFECT = "PlanInEffect"
NO_PLAN = "NoPlan"
REPORTING = "ShadowReporting"
# What a plan waits on rather than fails at: its pool's first replicas, its first traffic. Such a
# period is not Degraded and tells no Warning: every fresh `kubectl apply` would page someone.
WAITING = frozenset({POOL_NOT_READY, NO_TRAFFIC, INCOMPLETE_WINDOW})

Status = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Finding:
    """One condition as a period found it."""

    type: str
    status: bool
    reason: str
    message: str = ""

    @property
    def wire_status(self) -> Status:
        return "True" if self.status else "False"


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(
    existing: Sequence[Mapping[str, Any]], findings: Iterable[Finding], *, generation: int | None, now: datetime
) -> list[dict[str, Any]]:
    """The condition list after a period: findings replace their type, the rest stay as they were."""
    by_type: dict[str, dict[str, Any]] = {str(c.get("type")): dict(c) for c in existing if c.get("type")}
    for f in findings:
        old = by_type.get(f.type)
        changed = old is None or old.get("status") != f.wire_status
        entry: dict[str, Any] = {
            "type": f.type,
            "status": f.wire_status,
            "reason": f.reason,
            "message": f.message[:32768],
            "lastTransitionTime": _stamp(now) if changed or old is None else old.get("lastTransitionTime", _stamp(now)),
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        by_type[f.type] = entry
    ordered = [by_type.pop(t) for t in ORDER if t in by_type]
    return ordered + [by_type[t] for t in sorted(by_type)]


def current(existing: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    for c in existing:
        if c.get("type") == type_:
            return c
    return None


def is_true(existing: Sequence[Mapping[str, Any]], type_: str) -> bool | None:
    c = current(existing, type_)
    return None if c is None else c.get("status") == "True"
