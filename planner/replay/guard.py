"""The operator's guard: replay a window under a candidate plan, the current plan and no plan.

    verdict = guard(window_trace, candidate_plan, current_plan)
    if verdict.passed: apply(candidate_plan)

or, from the per-key statistics the operator reads from Prometheus:

    verdict = guard_from_stats(key_stats, candidate_plan, current_plan, duration_s=300)

and, inside a replay, `CacheRoute(guard=ReplayGuard())` judges every candidate plan on the
traffic of the last `window_s` (more while that is thin) before routing by it.

The baseline is what the router does without a plan: key-seeded p2c for every key (following
routed prefixes when the routing does), the best per-request behaviour the router has. The
candidate passes when its predicted p99 TTFT meets the SLO (or at least does not miss it by more
than the baseline does), is not worse than the baseline's by more than the tolerance, and its
served KV hit is at least the baseline's plus `min_kv_hit_gain`; so a plan whose foresight does not
pay (keys that do not repeat, where pinning costs p2c's balance) is not applied, and the router
degrades to its per-request routing rather than below it. The plan in effect is judged by the
looser rules (`current_holds`, `worse_than_no_plan`): one that has become clearly worse than no
plan (the traffic changed since it was applied) is withdrawn rather than kept. Caches start cold: the
first `warmup_fraction` of the window only warms them.

A window synthesised from statistics is one draw of the traffic they describe, and a p99 over a few
hundred requests is set by a handful of them: on a small pool, one draw passed a plan and the next
rejected it. So `guard_from_stats` lengthens a thin window until its measured part holds
`min_measured_requests`, and a verdict within `close_margin` of any of its limits is taken again on
the median figures of `close_replays` draws (`close_to_a_limit`) when the window is thin enough for
a draw to matter and for three replays to cost little.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.plan import Plan
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE, EngineProfile
from cacheroute.planner.replay.metrics import ReplayMetrics, summarize
from cacheroute.planner.replay.planned import CACHEROUTE_ROUTING, Planned, RoutingSettings
from cacheroute.planner.replay.run import ReplayConfig, fitting, replay_trace
from cacheroute.planner.replay.window import fitting_window
from cacheroute.planner.trace import RequestTrace


@dataclass(frozen=True)
class GuardSettings:
    slo_p99_ttft_s: float = 3.5
    tolerance: float = 0.05  # relative slack on p99 TTFT against the baseline
    tolerance_s: float = 0.05  # absolute slack, so near-zero latencies do not flip the verdict
    min_kv_hit_gain: float = 0.0
    # The plan in effect is withdrawn only when clearly worse than no plan: a served KV hit lower by
    # more than this (a point: the replay of a synthesised window moves by tenths of one between
    # seeds), or a p99 TTFT missing the SLO that no plan meets.
    withdraw_kv_margin: float = 0.01
    warmup_fraction: float = 0.5
    # How much recent traffic a replay-time guard (the `cacheroute-guard` policy) replays.
    window_s: float = 120.0
    # A synthesised window (`guard_from_stats`) is lengthened until its measured part holds this
    # many requests (its p99 then rests on the 20 slowest), up to `max_duration_s`.
    min_measured_requests: int = 2000
    max_duration_s: float = 1800.0
    # A verdict whose p99 TTFT lies within this share of a limit, or whose KV hit lies within
    # `close_kv_hit` of one, is judged again on the median of `close_replays` synthesised windows.
    # Windows measuring more requests than `close_max_measured` are judged once: their figures
    # move little between draws, and three replays of 128,824 keys would cost a control period
    # seconds (one took 4.2 CPU-s, 1.5 s on a faster machine).
    close_margin: float = 0.15
    close_kv_hit: float = 0.01
    close_replays: int = 3
    close_max_measured: int = 5000

    def __post_init__(self) -> None:
        if not self.slo_p99_ttft_s > 0:
            raise ValueError("guard SLO must be positive")
        if self.tolerance < 0 or self.tolerance_s < 0 or self.withdraw_kv_margin < 0:
            raise ValueError("guard tolerances must not be negative")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("guard warmup_fraction must be in [0, 1)")
        if not self.window_s > 0:
            raise ValueError("guard window must be positive")
        if self.min_measured_requests < 0 or not self.max_duration_s > 0:
            raise ValueError("guard min_measured_requests must not be negative, max_duration_s must be positive")
        if self.close_margin < 0 or self.close_kv_hit < 0 or self.close_replays < 1 or self.close_max_measured < 0:
            raise ValueError("guard close margins must not be negative, close_replays must be at least 1")


@dataclass(frozen=True)
class GuardVerdict:
    passed: bool
    reason: str
    candidate: ReplayMetrics
    # The router without a plan (module docstring).
    baseline: ReplayMetrics
    current: ReplayMetrics | None
    better_than_current: bool
    # The plan in effect is no worse than no plan (True when there is none); what it falls short by.
    current_holds: bool = True
    current_reason: str = ""
    # Requests of the window no destination could hold (a server refuses them), not replayed.
    left_out: int = 0

    def to_dict(self) -> dict[str, object]:
        return {
            "passed": self.passed,
            "reason": self.reason,
            "better_than_current": self.better_than_current,
            "current_holds": self.current_holds,
            "current_reason": self.current_reason,
            "left_out": self.left_out,
            "candidate": self.candidate.to_dict(),
            "baseline": self.baseline.to_dict(),
            "current": self.current.to_dict() if self.current is not None else None,
        }


def guard(
    window: RequestTrace,
    candidate: Plan,
    current: Plan | None = None,
    *,
    profile: EngineProfile = DEFAULT_PROFILE,
    settings: GuardSettings | None = None,
    seed: int = 0,
    routing: RoutingSettings = CACHEROUTE_ROUTING,
) -> GuardVerdict:
    """Predict the candidate plan's KV hit and p99 TTFT on `window` and judge it (module docs).

    The replay has one destination per destination of the candidate plan, with `profile`'s
    timing and KV capacity; the plans are routed as the router routes (`routing`). Requests
    longer than one destination's KV capacity are left out and counted (`GuardVerdict.left_out`):
    a server refuses them, so they would be served by no plan.
    """
    s = settings or GuardSettings()
    if len(window) == 0:
        raise ValueError("guard window holds no request")
    window, left_out = fitting(window, profile.kv_capacity_tokens)
    if len(window) == 0:
        raise ValueError(f"every one of the guard window's {left_out:,} request(s) needs more KV than one "
                         f"destination holds ({profile.kv_capacity_tokens:,} tokens): a server refuses them")
    ids = tuple(d.id for d in candidate.destinations)
    if not ids:
        raise ValueError("candidate plan has no destinations")
    cfg = ReplayConfig(destinations=len(ids), profile=profile, warmup_fraction=s.warmup_fraction,
                    seed=seed, destination_ids=ids)
    cand = summarize(replay_trace(window, Planned(candidate, routing=routing), cfg))
    base = summarize(replay_trace(window, Planned(None, routing=routing), cfg))
    cur = summarize(replay_trace(window, Planned(current, routing=routing), cfg)) if current is not None else None
    return with_left_out(judge(cand, base, cur, s), left_out)


def with_left_out(verdict: GuardVerdict, left_out: int) -> GuardVerdict:
    """`verdict` (of a window with none) counting `left_out` requests too long to hold, its reason saying so."""
    if not left_out:
        return verdict
    return replace(verdict, left_out=left_out, reason=f"{verdict.reason}; {left_out_text(left_out)}")


def left_out_text(left_out: int) -> str:
    return f"left out {left_out:,} request(s) longer than one destination's KV cache holds (a server refuses them)"


def judge(cand: ReplayMetrics, base: ReplayMetrics, cur: ReplayMetrics | None, s: GuardSettings) -> GuardVerdict:
    """The verdict on replayed figures: the candidate's, no plan's and the plan in effect's."""
    reasons = shortfalls(cand, base, s, s.min_kv_hit_gain)
    current_reasons = worse_than_no_plan(cur, base, s) if cur is not None else []
    better = cur is None or cand.ttft_p99_s <= p99_limit(cur, s)
    passed = not reasons
    reason = "; ".join(reasons) if reasons else (
        f"predicted KV hit {cand.kv_hit:.1%} (without a plan {base.kv_hit:.1%}), p99 TTFT "
        f"{cand.ttft_p99_s:.2f}s (without a plan {base.ttft_p99_s:.2f}s)"
    )
    return GuardVerdict(passed=passed, reason=reason, candidate=cand, baseline=base, current=cur,
                        better_than_current=better, current_holds=not current_reasons,
                        current_reason="; ".join(current_reasons))


def worse_than_no_plan(plan: ReplayMetrics, base: ReplayMetrics, s: GuardSettings) -> list[str]:
    """Why the plan in effect should be withdrawn (none: it holds; module docstring)."""
    reasons = []
    if plan.ttft_p99_s > s.slo_p99_ttft_s >= base.ttft_p99_s:
        reasons.append(f"p99 TTFT {plan.ttft_p99_s:.2f}s misses the SLO {s.slo_p99_ttft_s:.2f}s, met without a "
                       f"plan ({base.ttft_p99_s:.2f}s)")
    if plan.kv_hit < base.kv_hit - s.withdraw_kv_margin:
        reasons.append(f"KV hit {plan.kv_hit:.1%} below {base.kv_hit:.1%} without a plan")
    return reasons


def p99_limit(other: ReplayMetrics, s: GuardSettings) -> float:
    """The highest p99 TTFT that is not worse than `other`'s: the tolerances on top of it."""
    return other.ttft_p99_s * (1 + s.tolerance) + s.tolerance_s


def shortfalls(plan: ReplayMetrics, base: ReplayMetrics, s: GuardSettings, min_kv_hit_gain: float) -> list[str]:
    """What a plan's predicted figures fall short by against no plan's (module docstring)."""
    limit = p99_limit(base, s)
    reasons = []
    if plan.ttft_p99_s > s.slo_p99_ttft_s and plan.ttft_p99_s > base.ttft_p99_s:
        reasons.append(f"p99 TTFT {plan.ttft_p99_s:.2f}s misses the SLO {s.slo_p99_ttft_s:.2f}s")
    if plan.ttft_p99_s > limit:
        reasons.append(f"p99 TTFT {plan.ttft_p99_s:.2f}s worse than without a plan ({base.ttft_p99_s:.2f}s)")
    if plan.kv_hit < base.kv_hit + min_kv_hit_gain:
        # Two decimals: a loss by a few hundredths of a point must not read as a rejected tie.
        if min_kv_hit_gain > 0:
            reasons.append(f"KV hit {plan.kv_hit:.2%} does not beat {base.kv_hit:.2%} without a plan by "
                           f"{min_kv_hit_gain:.1%}")
        else:
            reasons.append(f"KV hit {plan.kv_hit:.2%} is below {base.kv_hit:.2%} without a plan")
    return reasons


def guard_from_stats(
    stats: KeyStats,
    candidate: Plan,
    current: Plan | None = None,
    *,
    duration_s: float = 300.0,
    profile: EngineProfile = DEFAULT_PROFILE,
    settings: GuardSettings | None = None,
    seed: int = 0,
    routing: RoutingSettings = CACHEROUTE_ROUTING,
) -> GuardVerdict:
    """`guard` on at least `duration_s` of traffic synthesised from per-key statistics
    (`window.window_from_stats`): what the operator can run from Prometheus data alone. A thin
    window is lengthened and a close verdict taken again on more windows (module docstring)."""
    s = settings or GuardSettings()
    duration = replay_duration(stats, duration_s, s)

    def verdict(draw: int) -> GuardVerdict:
        drawn = fitting_window(stats, duration_s=duration, kv_capacity_tokens=profile.kv_capacity_tokens,
                               seed=seed + draw)
        v = guard(drawn.trace, candidate, current, profile=profile, settings=s, seed=seed + draw, routing=routing)
        return with_left_out(v, drawn.left_out)

    first = verdict(0)
    if s.close_replays < 2 or first.candidate.measured > s.close_max_measured or not close_to_a_limit(first, s):
        return first
    verdicts = [first, *(verdict(draw) for draw in range(1, s.close_replays))]
    cur = [v.current for v in verdicts if v.current is not None]
    median = judge(median_metrics([v.candidate for v in verdicts]), median_metrics([v.baseline for v in verdicts]),
                   median_metrics(cur) if cur else None, s)
    median = replace(median, reason=f"{median.reason} (median of {len(verdicts)} replays: the first was close)")
    return with_left_out(median, first.left_out)


def replay_duration(stats: KeyStats, duration_s: float, s: GuardSettings) -> float:
    """`duration_s`, lengthened (up to `s.max_duration_s`) until the measured part of a window
    synthesised from `stats` is expected to hold `s.min_measured_requests`."""
    return lengthened(duration_s, stats.total_rate, s)


def lengthened(duration_s: float, rate: float, s: GuardSettings) -> float:
    """`duration_s`, lengthened (up to `s.max_duration_s`) until `rate` requests a second put
    `s.min_measured_requests` in a window's measured part."""
    if not rate > 0:
        return duration_s
    wanted = s.min_measured_requests / (rate * (1.0 - s.warmup_fraction))
    return max(duration_s, min(wanted, s.max_duration_s))


def close_to_a_limit(v: GuardVerdict, s: GuardSettings) -> bool:
    """Whether another draw of the window could plausibly turn `v`: a p99 TTFT within
    `s.close_margin` of the SLO or of the limit set by another replay's p99, or a KV hit within
    `s.close_kv_hit` of the gain asked for (or of the withdrawal margin)."""
    cand, base, cur = v.candidate, v.baseline, v.current

    def near(x: float, limit: float) -> bool:
        return math.isfinite(x) and math.isfinite(limit) and limit > 0 and abs(x / limit - 1.0) <= s.close_margin

    p99s = [(cand.ttft_p99_s, p99_limit(base, s)), (cand.ttft_p99_s, s.slo_p99_ttft_s)]
    kv = [cand.kv_hit - (base.kv_hit + s.min_kv_hit_gain)]
    if cur is not None:
        p99s += [(cur.ttft_p99_s, s.slo_p99_ttft_s), (cand.ttft_p99_s, p99_limit(cur, s))]
        kv.append(cur.kv_hit - (base.kv_hit - s.withdraw_kv_margin))
    return any(near(x, limit) for x, limit in p99s) or any(abs(d) <= s.close_kv_hit for d in kv)


def median_metrics(replays: Sequence[ReplayMetrics]) -> ReplayMetrics:
    """Each figure of `replays` as its median (the first replay's policy name; aborted if any one was)."""
    figures: dict[str, Any] = {f.name: float(np.median([getattr(r, f.name) for r in replays]))
                               for f in fields(ReplayMetrics) if f.type in ("float", float)}
    figures.update(requests=int(np.median([r.requests for r in replays])),
                   measured=int(np.median([r.measured for r in replays])), aborted=any(r.aborted for r in replays))
    return replace(replays[0], **figures)


@dataclass(frozen=True)
class ReplayGuard:
    """The guard as a replayed CacheRoute runs it at every re-plan (a `planned.PlanGuard`).

    The candidate and the plan in effect are replayed against no plan on the traffic before `now`
    (`recent_window`): (the candidate passes, the plan in effect holds). With almost no recent
    traffic there is nothing to judge: both stand.
    """

    settings: GuardSettings = GuardSettings()

    def __call__(self, trace: RequestTrace, now: float, candidate: Plan, profile: EngineProfile, seed: int, *,
                 routing: RoutingSettings = CACHEROUTE_ROUTING, current: Plan | None = None) -> tuple[bool, bool]:
        recent = self.recent_window(trace, now)
        if len(recent) < 2:
            return True, True
        v = guard(recent, candidate, current, profile=profile, settings=self.settings, seed=seed, routing=routing)
        return v.passed, v.current_holds

    def recent_window(self, trace: RequestTrace, now: float) -> RequestTrace:
        """The last `settings.window_s` of `trace` before `now`, reaching further back while it is
        thin, as the operator's guard lengthens a thin synthesised window (`replay_duration`): a p99
        over the 170 measured requests of two minutes at under 3 requests a second is set by two of
        them, and let through plans that cost capacity over the whole trace (docs/capacity.md)."""
        s, first = self.settings, float(trace.arrival_s[0])
        start = max(now - s.window_s, first)
        recent = trace.window(start, now)
        span = now - start
        if span <= 0:
            return recent
        length = lengthened(s.window_s, len(recent) / span, s)
        return trace.window(max(now - length, first), now) if length > s.window_s else recent
