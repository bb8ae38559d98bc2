"""The operator's own Prometheus metrics, served on `--health-address` at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

PASSES = Counter(
    "cacheroute_operator_reconcile_passes_total",
    "Reconcile passes of pools: full (every owned object applied) or status-only, and how they ended.",
    ["kind", "outcome"],
)
PASS_SECONDS = Histogram(
    "cacheroute_operator_reconcile_seconds",
    "Duration of a reconcile pass.",
    ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
EVENTS = Counter("cacheroute_operator_events_total", "Events posted on pools, by reason.", ["reason"])
