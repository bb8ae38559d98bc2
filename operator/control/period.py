"""What one control period found and did: the record the loop fills and reports from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from cacheroute.operator.control.conditions import Finding
from cacheroute.operator.control.prometheus import WindowMetrics
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.plan import Plan
from cacheroute.planner.plan_format import PlanPayload
from cacheroute.planner.planning import PlanResult
from cacheroute.planner.replay.guard import GuardVerdict, left_out_text

Outcome = Literal["applied", "unchanged", "shadow", "rejected", "kept", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("applied", "unchanged", "shadow", "rejected", "kept", "failed")
EventKind = Literal["Normal", "Warning"]


@dataclass(frozen=True)
class Event:
    kind: EventKind
    reason: str
    message: str


@dataclass
class PeriodResult:
    """The outcome, the findings (conditions), status fields, Events, step durations, and the
    intermediate results (statistics, candidate, verdict) that tests and benchmarks inspect."""

    outcome: Outcome
    evaluated_at: int  # unix seconds: the window's end, the plan's generation time
    findings: list[Finding] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    window: WindowMetrics | None = None
    stats: KeyStats | None = None
    result: PlanResult | None = None
    candidate: Plan | None = None
    payload: PlanPayload | None = None
    verdict: GuardVerdict | None = None
    # The version of the plan in effect when the period began, if that plan routes no key (the
    # empty plan a pool starts with, or one that was withdrawn down to nothing).
    empty_in_effect: str | None = None

    def finding(self, type_: str) -> Finding | None:
        """The last finding of `type_`: the one its condition ends up with (`conditions.merge`)."""
        return next((f for f in reversed(self.findings) if f.type == type_), None)

    def add(self, *findings: Finding) -> None:
        self.findings.extend(findings)

    def tell(self, kind: EventKind, reason: str, message: str) -> None:
        self.events.append(Event(kind, reason, message))

    @property
    def degraded(self) -> bool:
        found = self.finding("Degraded")
        return self.outcome == "failed" or (found is not None and found.status)


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def verdict_text(verdict: GuardVerdict | None) -> str:
    if verdict is None:
        return "guard off"
    c, p = verdict.candidate, verdict.baseline
    text = (
        f"guard {'passed' if verdict.passed else 'rejected'}: predicted KV hit {pct(c.kv_hit)} "
        f"(without a plan {pct(p.kv_hit)}), p99 TTFT {c.ttft_p99_s:.2f}s (without a plan {p.ttft_p99_s:.2f}s)"
    )
    return f"{text}; {left_out_text(verdict.left_out)}" if verdict.left_out else text


def seconds_text(seconds: dict[str, float]) -> str:
    return ", ".join(f"{step} {value:.2f}s" for step, value in seconds.items())
