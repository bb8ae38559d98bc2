"""From a period's record to the AffinityPlan's status and Events.

Status fields the period did not touch stay as they are (the status is merge-patched); `null`
clears a figure that no longer applies. Events tell what changed: a plan applied, a new
candidate judged (Shadow, rejected), a failure that starts (not every period it lasts), and
MetricsAvailable turning either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from cacheroute.operator.control import conditions as cond
from cacheroute.operator.control.conditions import Finding
from cacheroute.operator.control.period import Event, PeriodResult

SHADOW_PLANNED = "ShadowPlanned"


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready_finding(mode: str, result: PeriodResult, plan_version: str | None) -> Finding:
    if mode == "Shadow":
        planned = result.finding(cond.PLANNED)
        if planned is not None and planned.status:
            message = "the last period reported a candidate"
            if plan_version and plan_version != result.empty_in_effect:
                # Published before the switch to Shadow: it still routes, and Shadow changes nothing.
                message += f"; plan {plan_version} stays in effect (Shadow publishes nothing)"
            return Finding(cond.READY, True, cond.REPORTING, message)
        if planned is not None:
            return Finding(cond.READY, False, planned.reason, planned.message)
        return Finding(cond.READY, False, cond.NO_PLAN, "no period has reported yet")
    applied = result.finding(cond.APPLIED)
    if applied is not None and applied.reason in (cond.POOL_CLAIMED, cond.POOL_NOT_FOUND):
        return Finding(cond.READY, False, applied.reason, applied.message)
    if plan_version and plan_version == result.empty_in_effect:
        return Finding(cond.READY, True, cond.PLAN_IN_EFFECT,
                       f"plan {plan_version} is in effect, routing no key: every request goes as without a plan")
    if plan_version:
        return Finding(cond.READY, True, cond.PLAN_IN_EFFECT, f"plan {plan_version} is in effect")
    return Finding(cond.READY, False, cond.NO_PLAN, "no plan has been published yet")


def new_status(
    old_status: Mapping[str, Any], result: PeriodResult, *, mode: str, generation: int | None, now: float
) -> dict[str, Any]:
    """The status patch after `result`."""
    version = result.status.get("planVersion", old_status.get("planVersion"))
    findings = [*result.findings, ready_finding(mode, result, version)]
    status = dict(result.status)
    status["conditions"] = cond.merge(
        list(old_status.get("conditions") or []), findings, generation=generation,
        now=datetime.fromtimestamp(now, UTC),
    )
    status["lastPeriodTime"] = iso(result.evaluated_at)
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def events_to_post(
    old_status: Mapping[str, Any], result: PeriodResult, generation: int | None = None
) -> list[Event]:
    """The period's Events less repeats, plus MetricsAvailable transitions. `generation`: the
    spec's, this period; a failure is told again for a new spec (say, another bad pin)."""
    old_conditions = list(old_status.get("conditions") or [])
    same_candidate = result.status.get("candidateVersion") == old_status.get("candidateVersion")
    degraded = cond.current(old_conditions, cond.DEGRADED)
    same_spec = generation is None or old_status.get("observedGeneration") == generation
    # A failure, or a wait, is told when it starts, not every period it lasts.
    failing_for = (
        degraded.get("reason")
        if same_spec and degraded is not None
        and (degraded.get("status") == "True" or degraded.get("reason") in cond.WAITING)
        else None
    )
    out: list[Event] = []
    metrics = result.finding(cond.METRICS_AVAILABLE)
    old_metrics = cond.current(old_conditions, cond.METRICS_AVAILABLE) or {}
    # Told when its status or its reason changes: turning either way, or staying False for another
    # reason (Prometheus back, but holding too little of the window: a wait after a failure).
    if metrics is not None and (old_metrics.get("status"), old_metrics.get("reason")) != (
        "True" if metrics.status else "False", metrics.reason
    ):
        quiet = metrics.status or metrics.reason in cond.WAITING
        out.append(Event("Normal" if quiet else "Warning", metrics.reason, metrics.message))
    for event in result.events:
        if event.reason in (SHADOW_PLANNED, cond.GUARD_REJECTED) and same_candidate:
            continue
        if event.reason == failing_for and (event.kind == "Warning" or event.reason in cond.WAITING):
            continue
        if event in out:  # a failure that is also MetricsAvailable's transition is told once
            continue
        out.append(event)
    return out
