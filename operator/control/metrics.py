"""The control loop's metrics, in prometheus_client's default registry (the operator process
serves it on its `/metrics`). Series are labelled by AffinityPlan (`namespace`, `affinityplan`)
and removed when the AffinityPlan goes away."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

PREFIX = "cacheroute_operator_plan"
STEPS = ("read", "query", "plan", "guard", "publish", "status")
VERDICTS = ("passed", "rejected", "skipped")
_LABELS = ("namespace", "affinityplan")

STEP_SECONDS = Histogram(
    f"{PREFIX}_step_seconds",
    "Duration of one step of a control period: read (pool, plan in effect), query (Prometheus), plan, "
    "guard (shadow replay), publish (ConfigMaps), status.",
    [*_LABELS, "step"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
PERIOD_SECONDS = Histogram(
    f"{PREFIX}_period_seconds",
    "Duration of a whole control period, from its start to the status update.",
    list(_LABELS),
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
PERIODS = Counter(
    f"{PREFIX}_periods",
    "Control periods by outcome: applied, unchanged, shadow, rejected, kept (nothing new to apply), "
    "failed (nothing applied because the period is Degraded: Prometheus away, a spec refused, an error).",
    [*_LABELS, "outcome"],
)
GUARD_VERDICTS = Counter(
    f"{PREFIX}_guard_verdicts",
    "Guard verdicts on candidate plans: passed, rejected, "
    "skipped (guard disabled, nothing new, or too little traffic to replay).",
    [*_LABELS, "verdict"],
)
PLAN_INFO = Gauge(
    f"{PREFIX}_info",
    "The plan in effect (1): pool and version.",
    [*_LABELS, "pool", "version"],
)
ROUTES = Gauge(f"{PREFIX}_routes", "Routes in the plan in effect.", list(_LABELS))
LAST_SUCCESS = Gauge(
    f"{PREFIX}_last_success_timestamp_seconds",
    "When a control period last completed without failure (unix seconds).",
    list(_LABELS),
)


class PlanMetrics:
    """The series of one AffinityPlan."""

    def __init__(self, namespace: str, name: str) -> None:
        self.labels = (namespace, name)
        self._info: tuple[str, str] | None = None

    def step(self, step: str, seconds: float) -> None:
        STEP_SECONDS.labels(*self.labels, step).observe(seconds)

    def period(self, seconds: float, outcome: str) -> None:
        PERIOD_SECONDS.labels(*self.labels).observe(seconds)
        PERIODS.labels(*self.labels, outcome).inc()

    def verdict(self, verdict: str) -> None:
        GUARD_VERDICTS.labels(*self.labels, verdict).inc()

    def in_effect(self, pool: str, version: str | None, routes: int | None) -> None:
        info = (pool, version) if version else None
        if info != self._info and self._info is not None:
            PLAN_INFO.remove(*self.labels, *self._info)
        if info is not None:
            PLAN_INFO.labels(*self.labels, *info).set(1)
        self._info = info
        if routes is not None:
            ROUTES.labels(*self.labels).set(routes)

    def succeeded(self, at: float) -> None:
        LAST_SUCCESS.labels(*self.labels).set(at)

    def forget(self) -> None:
        """Drop every series of this AffinityPlan."""
        for metric in (ROUTES, LAST_SUCCESS, PERIOD_SECONDS):
            _remove(metric, self.labels)
        for step in STEPS:
            _remove(STEP_SECONDS, (*self.labels, step))
        for outcome in ("applied", "unchanged", "shadow", "rejected", "kept", "failed"):
            _remove(PERIODS, (*self.labels, outcome))
        for verdict in VERDICTS:
            _remove(GUARD_VERDICTS, (*self.labels, verdict))
        if self._info is not None:
            _remove(PLAN_INFO, (*self.labels, *self._info))
            self._info = None


def _remove(metric: Counter | Gauge | Histogram, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)
