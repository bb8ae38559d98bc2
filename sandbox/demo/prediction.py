"""The shadow replay's prediction of the same run: the same requests, fleet, KV and plan.

The replay gets the requests the load generator sent (both phases, with the pause between them
that the loop took to plan), the pool's destinations with the KV capacity of its memory plan, the
engine profile the emulators run, and the router's rule: every key by key-seeded p2c (an empty
plan) in the first phase, the plan the operator published in the second. Its served KV hit per
phase is what the loop should measure if emulators, router and replay agree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cacheroute.planner.plan import Plan
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE
from cacheroute.planner.replay.planned import Planned
from cacheroute.planner.replay.run import ReplayConfig, ReplayResult, replay_trace
from cacheroute.planner.trace import RequestTrace
from cacheroute.sandbox.demo.workload import DemoWorkload


class PhaseSwitch(Planned):
    """The router's rule with an empty plan until `switch_s`, then with `plan`."""

    name = "p2c-then-plan"

    def __init__(self, plan: Plan, switch_s: float) -> None:
        super().__init__(None)
        self._pending: Plan | None = plan
        self._switch_s = switch_s

    def route(self, i: int, now: float) -> int:
        if self._pending is not None and now >= self._switch_s:
            self.install(self._pending)
            self._pending = None
        return super().route(i, now)


@dataclass(frozen=True)
class PhasePrediction:
    served_kv_hit: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests_by_destination: dict[str, int]


def sent_trace(workload: DemoWorkload, pause_s: float) -> tuple[RequestTrace, float]:
    """The generated trace with the second phase moved `pause_s` later, and the switch instant."""
    trace = workload.trace
    switch = float(trace.arrival_s[0]) + workload.cut_s
    arrival = np.where(trace.arrival_s >= switch, trace.arrival_s + pause_s, trace.arrival_s)
    return replace(trace, arrival_s=arrival), switch + pause_s


def predict(
    workload: DemoWorkload, plan: Plan, *, kv_capacity_tokens: int, destination_ids: tuple[str, ...],
    pause_s: float,
) -> tuple[PhasePrediction, PhasePrediction]:
    """Replay both phases; the figures of each (p2c, planned)."""
    trace, switch = sent_trace(workload, pause_s)
    profile = DEFAULT_PROFILE.with_kv_capacity(kv_capacity_tokens)
    config = ReplayConfig(destinations=len(destination_ids), profile=profile, warmup_fraction=0.0,
                          destination_ids=destination_ids)
    result = replay_trace(trace, PhaseSwitch(plan, switch), config)
    sent = np.zeros(len(trace), dtype=bool)
    for phase in workload.phases:
        sent[[r.index for r in phase.requests]] = True
    in_second = trace.arrival_s >= switch
    return (_figures(result, sent & ~in_second, destination_ids),
            _figures(result, sent & in_second, destination_ids))


def _figures(result: ReplayResult, rows: np.ndarray, ids: tuple[str, ...]) -> PhasePrediction:
    prompt = int(result.input_tokens[rows].sum())
    ttft = result.ttft_s[rows]
    counts = np.bincount(result.dest[rows], minlength=len(ids))
    return PhasePrediction(
        served_kv_hit=float(result.hit_tokens[rows].sum()) / prompt if prompt else 0.0,
        ttft_p50_s=float(np.percentile(ttft, 50)) if len(ttft) else float("nan"),
        ttft_p99_s=float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
        requests_by_destination={d: int(c) for d, c in zip(ids, counts.tolist(), strict=True)},
    )
