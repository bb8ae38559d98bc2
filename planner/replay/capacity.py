"""Capacity: the largest QPS at which a policy keeps p99 TTFT within the SLO.

The trace is replayed time-scaled (`RequestTrace.time_scaled`): the same requests, arriving
faster or slower. The search brackets the capacity by doubling or halving from a start rate,
then bisects until the bracket is within `rel_tol`. Replays that cannot pass any more stop early
(`ReplayConfig.abort_above_p99_ttft_s`), which makes overloaded probes cheap. A trace too short to
load the fleet (every request arriving within the SLO still meets it) bounds nothing: the search
stops there and reports that rate as a lower bound (`bounded` False), not a capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cacheroute.planner.replay.metrics import ReplayMetrics, summarize
from cacheroute.planner.replay.policy import Policy
from cacheroute.planner.replay.run import ReplayConfig, replay_trace
from cacheroute.planner.trace import RequestTrace

DEFAULT_SLO_P99_TTFT_S = 3.5
DEFAULT_REL_TOL = 0.03


@dataclass(frozen=True)
class Probe:
    qps: float
    ttft_p99_s: float
    passed: bool
    metrics: ReplayMetrics


@dataclass(frozen=True)
class CapacityResult:
    """`qps` is the highest passing rate found (0 when even the lowest probe failed);
    `best` is the replay at that rate. `bounded` False: no rate failed, the trace being too short
    to load the fleet, so `qps` is only a lower bound of the capacity."""

    policy: str
    qps: float
    slo_p99_ttft_s: float
    probes: list[Probe] = field(default_factory=list)
    best: ReplayMetrics | None = None
    bounded: bool = True

    def to_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "capacity_qps": self.qps,
            "bounded": self.bounded,
            "slo_p99_ttft_s": self.slo_p99_ttft_s,
            "best": self.best.to_dict() if self.best is not None else None,
            "probes": [
                {"qps": p.qps, "ttft_p99_s": p.ttft_p99_s, "passed": p.passed,
                 "kv_hit": p.metrics.kv_hit, "aborted": p.metrics.aborted}
                for p in self.probes
            ],
        }


def base_qps(trace: RequestTrace) -> float:
    if len(trace) < 2 or trace.duration_s <= 0:
        raise ValueError(f"trace {trace.name!r} needs at least two requests over a positive duration")
    return len(trace) / trace.duration_s


def replay_at(trace: RequestTrace, qps: float, policy: Policy, config: ReplayConfig | None = None) -> ReplayMetrics:
    """Replay `trace` time-scaled to `qps` requests per second."""
    return summarize(replay_trace(trace.time_scaled(qps / base_qps(trace)), policy, config))


def find_capacity(
    trace: RequestTrace,
    make_policy: Callable[[], Policy],
    config: ReplayConfig | None = None,
    *,
    slo_p99_ttft_s: float = DEFAULT_SLO_P99_TTFT_S,
    start_qps: float | None = None,
    rel_tol: float = DEFAULT_REL_TOL,
    max_probes: int = 20,
    min_qps: float = 0.01,
    on_probe: Callable[[Probe], None] | None = None,
    name: str | None = None,
) -> CapacityResult:
    """Bisect the QPS at which p99 TTFT crosses `slo_p99_ttft_s` (see the module docstring);
    the result is reported under `name`, or the policy's own (variants of one policy share it)."""
    if not slo_p99_ttft_s > 0:
        raise ValueError("the p99 TTFT SLO must be positive")
    if not 0 < rel_tol < 1:
        raise ValueError("rel_tol must be in (0, 1)")
    cfg = replace(config or ReplayConfig(), abort_above_p99_ttft_s=slo_p99_ttft_s)
    probes: list[Probe] = []
    name = name or make_policy().name

    def probe(qps: float) -> Probe:
        m = replace(replay_at(trace, qps, make_policy(), cfg), policy=name)
        p = Probe(qps=qps, ttft_p99_s=m.ttft_p99_s, passed=(not m.aborted) and m.ttft_p99_s <= slo_p99_ttft_s,
                  metrics=m)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return p

    q = start_qps if start_qps is not None else base_qps(trace)
    first = probe(q)
    lo: Probe | None = first if first.passed else None
    hi: Probe | None = None if first.passed else first
    while len(probes) < max_probes and (lo is None or hi is None):
        if lo is None:
            q = (hi.qps if hi is not None else q) / 2
            if q < min_qps:
                break
            p = probe(q)
            if p.passed:
                lo = p
            else:
                hi = p
        else:
            if len(trace) / lo.qps <= slo_p99_ttft_s:
                break  # the whole trace arrives within the SLO and still meets it: faster bounds nothing
            p = probe(lo.qps * 2)
            if p.passed:
                lo = p
            else:
                hi = p
    while lo is not None and hi is not None and len(probes) < max_probes and hi.qps / lo.qps - 1 > rel_tol:
        p = probe((lo.qps + hi.qps) / 2)
        if p.passed:
            lo = p
        else:
            hi = p
    return CapacityResult(
        policy=name,
        qps=lo.qps if lo is not None else 0.0,
        slo_p99_ttft_s=slo_p99_ttft_s,
        probes=probes,
        best=lo.metrics if lo is not None else None,
        bounded=lo is None or hi is not None,
    )

