"""Routing by a plan (`planned`) and CacheRoute itself: a plan recomputed every control period.

The routing rule is the router's (router/picker.py): a planned key goes to the least-loaded of
its destinations (ties: the first at or after `key_hash % len`); when that destination's load
exceeds `spill_threshold x mean load + spill_slack` the request spills to power-of-two choices
among the other destinations. Unplanned keys go to key-seeded p2c by default (`unplanned`): the
two candidates come from the key's hash on a consistent-hash ring of the destinations
(`keyring.KeyRing`) instead of being drawn at random, so the follow-up turns of a conversation
whose key is not (yet) planned find their history on one of two destinations, while the tail of
small keys still balances like p2c; `unplanned="p2c"` draws them at random, as
the report does. Keyless requests always go p2c. Load is the router's in-flight count plus the
queue depth the destination reports.

`cacheroute` re-plans every `control_period_s` (60 s) from the statistics of the requests that
arrived in the previous `window_s` (30 min) only (`keystats.key_stats_from_trace` over the past, never the
future), with `planning.compute_plan` and the previous plan for stability. Before the first
period ends there is no plan (everything p2c). With a guard, each candidate plan is replayed
against p2c on the past window and, when it predicts no gain, the period runs on p2c.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keyring import DEFAULT_UNPLANNED, KeyRing, check_unplanned_mode
from cacheroute.planner.keystats import key_stats_from_trace
from cacheroute.planner.load import CostModel
from cacheroute.planner.plan import Destination, Plan
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.replay.policy import Policy, RouterView
from cacheroute.planner.settings import Budget, Stability
from cacheroute.planner.trace import NO_KEY

DEFAULT_CONTROL_PERIOD_S = 60.0
# Statistics window of each re-plan: the operator's default metrics window (AffinityPlan
# spec.metricsWindow, 30 min), so keys of a few requests per window are seen more than once.
DEFAULT_WINDOW_S = 1800.0
DEFAULT_SPILL_SLACK = 2.0


class Planned(Policy):
    """Follow a fixed plan (the router's behaviour for one plan version)."""

    name: ClassVar[str] = "planned"

    def __init__(self, plan: Plan | None = None, spill_slack: float = DEFAULT_SPILL_SLACK,
                 unplanned: str = DEFAULT_UNPLANNED) -> None:
        if spill_slack < 0:
            raise ValueError("spill slack must not be negative")
        self.fixed_plan = plan
        self.spill_slack = spill_slack
        self.unplanned = check_unplanned_mode(unplanned)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "spill_slack": self.spill_slack, "unplanned": self.unplanned,
                "routes": len(self.fixed_plan) if self.fixed_plan is not None else 0}

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        self._hashes = view.key_hashes()
        self._hash_list: list[int] = [int(h) for h in self._hashes]
        self._routes: dict[int, tuple[int, ...]] = {}
        self._spill_threshold = 1.5
        self.planned_requests = 0
        self.spilled_requests = 0
        self._key_seeded = self.unplanned == "key-p2c"
        self._ring = KeyRing(view.destination_ids)
        self._pairs: dict[int, tuple[int, int]] = {}
        self.install(self.fixed_plan)

    def install(self, plan: Plan | None, keys: npt.NDArray[np.int64] | None = None) -> None:
        """Route by `plan` from now on (None: everything p2c). `keys` limits the key ids looked
        up to those that can be in the plan (the keys of the window it was built from)."""
        self.active_plan = plan
        self._routes = {}
        if plan is None or not len(plan):
            return
        view = self.view
        ids = [d.id for d in plan.destinations]
        if tuple(ids) != view.destination_ids:
            index = {d: i for i, d in enumerate(view.destination_ids)}
            missing = [d for d in ids if d not in index]
            if missing:
                raise ValueError(f"plan names destination {missing[0]!r}, which the replay does not have")
            remap = np.array([index[d] for d in ids], dtype=np.int64)
        else:
            remap = np.arange(len(ids), dtype=np.int64)
        cand = np.arange(len(self._hashes), dtype=np.int64) if keys is None else np.asarray(keys, dtype=np.int64)
        h = self._hashes[cand]
        pos = np.searchsorted(plan.route_keys, h)
        pos = np.minimum(pos, len(plan.route_keys) - 1)
        hit = plan.route_keys[pos] == h
        offs = plan.route_offsets
        dests = remap[plan.route_dests.astype(np.int64)]
        routes = self._routes
        for k, p in zip(cand[hit].tolist(), pos[hit].tolist(), strict=True):
            routes[k] = tuple(dests[offs[p] : offs[p + 1]].tolist())
        self._spill_threshold = plan.spill_threshold

    def _p2c(self, exclude: int) -> int:
        """Power of two choices on in-flight + queue depth, optionally avoiding one destination."""
        view = self.view
        n = view.n
        if n == 1:
            return 0
        rnd = self.rng.random
        if exclude >= 0:
            if n == 2:
                return 1 - exclude
            # Two distinct draws among the n - 1 others, mapped around the excluded index.
            a = int(rnd() * (n - 1))
            b = int(rnd() * (n - 2))
            if b >= a:
                b += 1
            if a >= exclude:
                a += 1
            if b >= exclude:
                b += 1
        else:
            a = int(rnd() * n)
            b = int(rnd() * (n - 1))
            if b >= a:
                b += 1
        engines = view.engines
        inflight = view.inflight
        la = inflight[a] + len(engines[a].waiting)
        lb = inflight[b] + len(engines[b].waiting)
        return b if lb < la else a

    def _key_p2c(self, k: int) -> int:
        """The less loaded of the key's two ring candidates (the router's rule); the first on a tie."""
        view = self.view
        pair = self._pairs.get(k)
        if pair is None:
            pair = self._pairs[k] = self._ring.pair(self._hash_list[k])
        a, b = pair
        engines = view.engines
        inflight = view.inflight
        la = inflight[a] + len(engines[a].waiting)
        lb = inflight[b] + len(engines[b].waiting)
        return b if lb < la else a

    def route(self, i: int, now: float) -> int:
        view = self.view
        k = view.key[i]
        if k == NO_KEY:
            return self._p2c(-1)
        group = self._routes.get(k)
        if group is None:
            return self._key_p2c(k) if self._key_seeded else self._p2c(-1)
        engines = view.engines
        inflight = view.inflight
        if len(group) == 1:
            best = group[0]
            best_load = inflight[best] + len(engines[best].waiting)
        else:
            m = len(group)
            start = self._hash_list[k] % m
            best = -1
            best_load = 0
            for step in range(m):
                d = group[(start + step) % m]
                load = inflight[d] + len(engines[d].waiting)
                if best < 0 or load < best_load:
                    best, best_load = d, load
        mean = (view.total_inflight + sum(len(e.waiting) for e in engines)) / view.n
        if best_load > self._spill_threshold * mean + self.spill_slack and view.n > 1:
            self.spilled_requests += 1
            return self._p2c(best)
        self.planned_requests += 1
        return best


@dataclass(frozen=True)
class PlannerSettings:
    """What the operator passes to the planner every control period."""

    control_period_s: float = DEFAULT_CONTROL_PERIOD_S
    window_s: float = DEFAULT_WINDOW_S  # statistics window, ending at the re-plan
    budget: Budget = field(default_factory=Budget)
    stability: Stability = field(default_factory=Stability)
    cost: CostModel = field(default_factory=CostModel)
    spill_threshold: float = 1.5
    unplanned: str = DEFAULT_UNPLANNED  # how the router sends keys outside the plan

    def __post_init__(self) -> None:
        if not self.control_period_s > 0:
            raise ValueError("control period must be positive")
        if not self.window_s > 0:
            raise ValueError("statistics window must be positive")
        check_unplanned_mode(self.unplanned)


class CacheRoute(Planned):
    name: ClassVar[str] = "cacheroute"

    def __init__(self, settings: PlannerSettings | None = None, spill_slack: float = DEFAULT_SPILL_SLACK,
                 guard: object | None = None) -> None:
        self.settings = settings or PlannerSettings()
        super().__init__(None, spill_slack, self.settings.unplanned)
        # A `guard.GuardSettings`; typed loosely to keep the import one-way (guard imports us).
        self.guard_settings = guard
        self.replans = 0
        self.guard_rejections = 0

    def describe(self) -> dict[str, object]:
        s = self.settings
        return {
            "name": self.name,
            "control_period_s": s.control_period_s,
            "window_s": s.window_s,
            "spill_threshold": s.spill_threshold,
            "spill_slack": self.spill_slack,
            "unplanned": self.unplanned,
            "warm_budget": s.budget.warm_tokens_per_destination,
            "guard": self.guard_settings is not None,
        }

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        trace = view.trace
        start = float(trace.arrival_s[0]) if len(trace) else 0.0
        self._next_plan = start + self.settings.control_period_s
        self._previous: Plan | None = None
        self._destinations = tuple(
            Destination(id=d, kv_capacity_tokens=view.profile.kv_capacity_tokens) for d in view.destination_ids
        )
        self.replans = 0
        self.guard_rejections = 0

    def route(self, i: int, now: float) -> int:
        if now >= self._next_plan:
            self._replan(now)
        return super().route(i, now)

    def _replan(self, now: float) -> None:
        s = self.settings
        period = s.control_period_s
        while self._next_plan <= now:
            self._next_plan += period
        trace = self.view.trace
        lo = max(now - s.window_s, float(trace.arrival_s[0]))
        # Only requests that have already arrived: the current one arrives at `now`.
        win = trace.window(lo, now)
        if len(win) == 0 or not bool(np.any(win.key != NO_KEY)):
            return
        try:
            stats = key_stats_from_trace(trace, lo, now)
            result = compute_plan(
                stats,
                self._destinations,
                pool="replay",
                budget=s.budget,
                stability=s.stability,
                cost=s.cost,
                previous=self._previous,
                spill_threshold=s.spill_threshold,
            )
        except PlanInputError:
            # Nothing plannable in this window: the operator keeps the last good plan.
            return
        candidate = result.plan
        self.replans += 1
        self._previous = candidate
        keys = np.unique(win.key[win.key != NO_KEY])
        if self.guard_settings is not None:
            from cacheroute.planner.replay.guard import GuardSettings, guard

            assert isinstance(self.guard_settings, GuardSettings)
            recent = trace.window(max(now - self.guard_settings.window_s, float(trace.arrival_s[0])), now)
            # Candidate against p2c on the recent past; the incumbent is not replayed (cost). With
            # almost no recent traffic there is nothing to judge: the candidate stands.
            verdict = (
                guard(recent, candidate, None, profile=self.view.profile, settings=self.guard_settings,
                      seed=self.replans)
                if len(recent) >= 2
                else None
            )
            if verdict is not None and not verdict.passed:
                # The guard compared the plan against plain p2c: that is what runs this period.
                self.guard_rejections += 1
                self.install(None)
                self._key_seeded = False
                return
        self._key_seeded = self.unplanned == "key-p2c"
        self.install(candidate, keys)
