"""The shadow replay's prediction of the same run: the same requests, fleet, KV and plan.

The replay gets the requests the load generator sent (both sendings of the slice, warm-ups
included, with the pauses the loop took between them to settle counters and to plan), the pool's
destinations with the KV capacity of its memory plan, the engine profile the emulators run, and
the router's rule as the router runs it (token-aware load, following routed prefixes when the pool
does): every key
by key-seeded p2c (an empty plan) until the planned sending, the plan the operator published from
then on. Its served KV hit per phase is what the loop should
measure if emulators, router and replay agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from cacheroute.planner.plan import Plan
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE
from cacheroute.planner.replay.planned import CACHEROUTE_ROUTING, Planned
from cacheroute.planner.replay.run import ReplayConfig, ReplayResult, replay_trace
from cacheroute.planner.trace import RequestTrace
from cacheroute.sandbox.loadgen.schedule import Schedule


class PhaseSwitch(Planned):
    """The router's rule with an empty plan until `switch_s`, then with `plan`."""

    name = "p2c-then-plan"

    def __init__(self, plan: Plan, switch_s: float, *, follow_prefixes: bool = True) -> None:
        super().__init__(None, routing=replace(CACHEROUTE_ROUTING, follow_prefixes=follow_prefixes))
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


def sent_trace(sends: Sequence[tuple[Schedule, float]]) -> tuple[RequestTrace, np.ndarray]:
    """One trace of every request sent, on the loop's clock (each schedule from its offset, in
    seconds after the first send began), and the send each request belongs to."""
    parts: list[RequestTrace] = []
    which: list[np.ndarray] = []
    for k, (schedule, offset) in enumerate(sends):
        rows = np.array([r.index for r in schedule.requests], dtype=np.int64)
        at = np.array([r.at_s + offset for r in schedule.requests], dtype=np.float64)
        parts.append(_take(schedule.trace, rows, at))
        which.append(np.full(len(rows), k, dtype=np.int64))
    trace = _concat(parts)
    send = np.concatenate(which)
    order = np.argsort(trace.arrival_s, kind="stable")
    return _take(trace, order, trace.arrival_s[order]), send[order]


def _take(trace: RequestTrace, rows: np.ndarray, arrival: np.ndarray) -> RequestTrace:
    """`trace`'s `rows`, in that order, arriving at `arrival` (one time per row)."""
    lengths = np.diff(trace.block_offsets)[rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    starts = trace.block_offsets[rows]
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
    return replace(trace, arrival_s=np.asarray(arrival, dtype=np.float64), key=trace.key[rows],
                   input_tokens=trace.input_tokens[rows], output_tokens=trace.output_tokens[rows],
                   block_offsets=offsets, block_ids=trace.block_ids[index])


def _concat(parts: Sequence[RequestTrace]) -> RequestTrace:
    """Traces of the same keys one after the other (arrival times as they are)."""
    first = parts[0]
    offsets = [parts[0].block_offsets]
    for part in parts[1:]:
        offsets.append(part.block_offsets[1:] + offsets[-1][-1])
    return replace(
        first,
        arrival_s=np.concatenate([p.arrival_s for p in parts]),
        key=np.concatenate([p.key for p in parts]),
        input_tokens=np.concatenate([p.input_tokens for p in parts]),
        output_tokens=np.concatenate([p.output_tokens for p in parts]),
        block_offsets=np.concatenate(offsets),
        block_ids=np.concatenate([p.block_ids for p in parts]),
    )


def predict(
    sends: Sequence[tuple[Schedule, float]], plan: Plan, *, kv_capacity_tokens: int,
    destination_ids: tuple[str, ...], measured: tuple[int, int], switch: int, follow_prefixes: bool = True,
) -> tuple[PhasePrediction, PhasePrediction]:
    """Replay every send (schedule, offset) in order, the plan from send `switch` on; the
    figures of the sends `measured` (the p2c phase, the planned phase)."""
    trace, send = sent_trace(sends)
    profile = DEFAULT_PROFILE.with_kv_capacity(kv_capacity_tokens)
    config = ReplayConfig(destinations=len(destination_ids), profile=profile, warmup_fraction=0.0,
                          destination_ids=destination_ids)
    switch_s = float(trace.arrival_s[send == switch].min())
    result = replay_trace(trace, PhaseSwitch(plan, switch_s, follow_prefixes=follow_prefixes), config)
    return (_figures(result, send == measured[0], destination_ids),
            _figures(result, send == measured[1], destination_ids))


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
