"""Routing by a plan (`planned`) and CacheRoute itself: a plan recomputed every control period.

Both route by the router's rule (`cacheroute.planner.routing`, the same code the router runs):
planned keys to the least loaded of their candidates with bounded-affinity spill, unplanned keys
by key-seeded p2c (`unplanned="key-p2c"`, the default) or random p2c (`unplanned="p2c"`, as the
report does), keyless requests by p2c; with `RoutingSettings.follow_prefixes` (the router's
default), a request follows the longest prefix of it the policy routed before
(`prefixes.PrefixFollower` over the trace's block ids, where the router hashes the prompt's text
in blocks of the same size). Load is the router's in-flight count (each request weighing
`in_flight_weight`) plus the queue depth the destination reports, plus prompt tokens in flight
when `tokens_per_unit` is set (`EngineLoads`, `tokenload.py`). `Planned()` with no plan and the
defaults of `RoutingSettings()` is key-seeded p2c alone, the router's fallback for unplanned keys.

`cacheroute` re-plans every `control_period_s` (60 s) from the statistics of the requests that
arrived in the previous `window_s` (30 min) only (`keystats.key_stats_from_trace` over the past, never the
future), with `planning.compute_plan` and the previous plan for stability. Before the first
period ends there is no plan (every key by the unplanned rule). With a guard, each candidate plan
is replayed against no plan on the past window and, when it predicts no gain, the plan in effect
stays, as in the operator, unless it has become worse than no plan: then it is withdrawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keyring import DEFAULT_UNPLANNED, KeyRing, check_unplanned_mode
from cacheroute.planner.keystats import key_stats_from_trace
from cacheroute.planner.load import CostModel
from cacheroute.planner.plan import Destination, Plan
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.prefixes import DEFAULT_PREFIX_MEMORY_BLOCKS, PrefixFollower, memory_blocks
from cacheroute.planner.replay.hardware import EngineProfile
from cacheroute.planner.replay.policy import Policy, RouterView
from cacheroute.planner.routing import (
    DEFAULT_FOLLOW_RATIO,
    DEFAULT_FOLLOW_SLACK,
    DEFAULT_SPILL_SLACK,
    DEFAULT_SPILL_THRESHOLD,
    FOLLOWED,
    PLANNED,
    SPILLED,
    RoutingRule,
    check_follow,
    check_spill,
    ring_candidates,
)
from cacheroute.planner.settings import Budget, Stability
from cacheroute.planner.tokenload import (
    BYTES_PER_TOKEN,
    DEFAULT_IN_FLIGHT_WEIGHT,
    DEFAULT_TOKENS_PER_LOAD_UNIT,
    TokenEstimator,
    check_in_flight_weight,
    check_tokens_per_unit,
    pending_prompt_tokens,
)
from cacheroute.planner.trace import NO_KEY, RequestTrace

DEFAULT_CONTROL_PERIOD_S = 60.0
# Statistics window of each re-plan: the operator's default metrics window (AffinityPlan
# spec.metricsWindow, 30 min), so keys of a few requests per window are seen more than once.
DEFAULT_WINDOW_S = 1800.0


@dataclass(frozen=True)
class RoutingSettings:
    """How the router measures load (`--tokens-per-load-unit`, `--in-flight-weight`) and whether
    requests follow their longest routed prefix (`--follow-prefixes`, `prefixes.PrefixFollower`, a
    memory of `--prefix-memory-blocks`).

    The defaults are the router's routing before token-aware load and prefix memory (request-count
    load, no memory); `CACHEROUTE_ROUTING` is what the router runs by default now.
    """

    tokens_per_unit: float = 0.0  # 0: load counts requests only
    # What a request in flight weighs against a queued one (`tokenload.py`).
    in_flight_weight: float = 1.0
    follow_prefixes: bool = False
    # Planned keys keep their ring candidates too (the router's `--widen-planned`; off: their plan
    # entry alone, whose length the planner decides from the key's load).
    widen_planned: bool = False
    follow_ratio: float = DEFAULT_FOLLOW_RATIO
    follow_slack: float = DEFAULT_FOLLOW_SLACK
    prefix_memory_blocks: int = DEFAULT_PREFIX_MEMORY_BLOCKS
    # With follow_prefixes and key-seeded p2c, unplanned requests with no prefix worth following
    # are scored by the prefix held and load (`routing` step 6), as the router does whenever it
    # follows prefixes; off only to measure what the scoring adds.
    score_unplanned: bool = True
    # Planned requests are scored too when the plan credits its entries below 1 (`routing` step 1,
    # `credit.py`), as the router does; off only to measure what the credit adds.
    credit_entries: bool = True

    def __post_init__(self) -> None:
        check_tokens_per_unit(self.tokens_per_unit)
        check_in_flight_weight(self.in_flight_weight)
        check_follow(self.follow_ratio, self.follow_slack)
        if self.prefix_memory_blocks < 1:
            raise ValueError(f"prefix memory must hold at least 1 block, got {self.prefix_memory_blocks}")


CACHEROUTE_ROUTING = RoutingSettings(tokens_per_unit=DEFAULT_TOKENS_PER_LOAD_UNIT,
                                     in_flight_weight=DEFAULT_IN_FLIGHT_WEIGHT, follow_prefixes=True)


class EngineLoads:
    """The rule's view of load in the replay: the router's in-flight count, each request weighing
    `in_flight_weight`, plus the queue depth the destination reports, plus the prompt tokens still
    to prefill over `tokens_per_unit` (0: none); the mean over every destination (all are ready in
    the replay)."""

    __slots__ = ("_engines", "_inflight", "_memo", "_pending", "_per_request", "_unit", "_view")

    def __init__(self, view: RouterView, tokens_per_unit: float = 0.0, in_flight_weight: float = 1.0) -> None:
        self._view = view
        self._inflight = view.inflight
        self._engines = view.engines
        self._pending = view.pending
        self._unit = 1.0 / tokens_per_unit if tokens_per_unit > 0 else 0.0
        self._per_request = in_flight_weight
        # Per destination, the last count of prompt tokens still to prefill and what it was counted
        # from: requests in flight (how many, the newest) and the queue depth. Any dispatch changes
        # the newest, any finish the number, so an unchanged triple means an unchanged count.
        self._memo: list[tuple[int, int, int, int]] = [(0, -1, 0, 0)] * view.n

    def tokens(self, d: int, /) -> int:
        """Prompt tokens still to prefill at `d` (`tokenload.pending_prompt_tokens`)."""
        return self._counted(d, len(self._engines[d].waiting))

    def _counted(self, d: int, waiting: int) -> int:
        charges = self._pending[d]
        if not charges:
            return 0
        newest = next(reversed(charges))
        size, last, queued, total = self._memo[d]
        if size == len(charges) and last == newest and queued == waiting:
            return total
        total = pending_prompt_tokens(charges, waiting)[0]
        self._memo[d] = (len(charges), newest, waiting, total)
        return total

    def load(self, d: int, /) -> float:
        waiting = len(self._engines[d].waiting)
        load = self._inflight[d] * self._per_request + waiting
        return load + self._counted(d, waiting) * self._unit if self._unit else load

    def mean(self) -> float:
        view = self._view
        queued = 0
        tokens = 0
        counting = bool(self._unit)
        for d, engine in enumerate(self._engines):
            waiting = len(engine.waiting)
            queued += waiting
            if counting:
                tokens += self._counted(d, waiting)
        return (view.total_inflight * self._per_request + queued + tokens * self._unit) / view.n


class Planned(Policy):
    """Follow a fixed plan (the router's behaviour for one plan version)."""

    name: ClassVar[str] = "planned"

    def __init__(self, plan: Plan | None = None, spill_slack: float = DEFAULT_SPILL_SLACK,
                 unplanned: str = DEFAULT_UNPLANNED, routing: RoutingSettings | None = None) -> None:
        check_spill(plan.spill_threshold if plan is not None else DEFAULT_SPILL_THRESHOLD, spill_slack)
        self.fixed_plan = plan
        self.spill_slack = spill_slack
        self.unplanned = check_unplanned_mode(unplanned)
        self.routing = routing or RoutingSettings()

    def describe(self) -> dict[str, object]:
        r = self.routing
        return {"name": self.name, "spill_slack": self.spill_slack, "unplanned": self.unplanned,
                "routes": len(self.fixed_plan) if self.fixed_plan is not None else 0,
                "tokens_per_unit": r.tokens_per_unit, "in_flight_weight": r.in_flight_weight,
                "follow_prefixes": r.follow_prefixes,
                "score_unplanned": r.score_unplanned, "credit_entries": r.credit_entries}

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        self._hashes = view.key_hashes()
        self._hash_list: list[int] = [int(h) for h in self._hashes]
        self._routes: dict[int, tuple[int, ...]] = {}
        # Every destination is ready in the replay; the rule names them by index.
        self._usable = range(view.n)
        r = self.routing
        self._loads = EngineLoads(view, r.tokens_per_unit, r.in_flight_weight)
        self._key_candidates = ring_candidates(KeyRing(view.destination_ids), self._usable, memo=True)
        # Load units per prompt token (0: load counts requests only), for the prefix follower too.
        self._unit = 1.0 / r.tokens_per_unit if r.tokens_per_unit > 0 else 0.0
        self._estimator = TokenEstimator()
        view.charging = r.tokens_per_unit > 0
        # The router's memory of routed prefixes, sized as the router sizes it: per destination,
        # what its KV cache holds.
        self._follower: PrefixFollower | None = None
        if r.follow_prefixes:
            prof = view.profile
            fleet = view.n * (prof.kv_capacity_tokens + prof.host_kv_capacity_tokens)
            blocks = memory_blocks(fleet, view.n, view.block_size, r.prefix_memory_blocks)
            self._follower = PrefixFollower(blocks, view.block_size, self._unit)
        self.planned_requests = 0
        self.spilled_requests = 0
        self.followed_requests = 0
        # The outcome of the latest decision (`routing.OUTCOMES`), as the router counts it.
        self.last_outcome = ""
        self.install(self.fixed_plan)

    def install(self, plan: Plan | None, keys: npt.NDArray[np.int64] | None = None, *,
                key_seeded: bool | None = None) -> None:
        """Route by `plan` from now on (None: everything p2c). `keys` limits the key ids looked
        up to those that can be in the plan (the keys of the window it was built from);
        `key_seeded` overrides the policy's way of routing unplanned keys."""
        self._routes = {}
        self._pinned: set[int] = set()
        seeded = self.unplanned == "key-p2c" if key_seeded is None else key_seeded
        self._scoring = seeded and self.routing.score_unplanned and self._follower is not None
        self._rule = RoutingRule(
            self._loads,
            self.rng.random,
            spill_threshold=plan.spill_threshold if plan is not None else DEFAULT_SPILL_THRESHOLD,
            spill_slack=self.spill_slack,
            key_candidates=self._key_candidates if seeded else None,
            follow_ratio=self.routing.follow_ratio,
            follow_slack=self.routing.follow_slack,
            widen_planned=self.routing.widen_planned,
            entry_credit=plan.entry_credit if plan is not None and self.routing.credit_entries else 1.0,
        )
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
        if len(plan.pinned_keys):
            pinned = set(plan.pinned_keys.tolist())
            keys = plan.route_keys.tolist()
            self._pinned = {k for k, p in zip(cand[hit].tolist(), pos[hit].tolist(), strict=True) if keys[p] in pinned}

    def route(self, i: int, now: float) -> int:
        view = self.view
        k = view.key[i]
        follower = self._follower
        charging = view.charging
        follow = None
        gain = 0.0
        held = None
        blocks: list[int] = []
        tokens = 0
        if follower is not None or charging:
            # What the router reads off the body: its size, and the prefixes it routed before.
            tokens = self._estimator.estimate(view.input_tokens[i] * BYTES_PER_TOKEN)
        if follower is not None:
            blocks = view.blocks(i)
            at, gain = follower.target(blocks, tokens)
            if at >= 0:
                follow = at
        route = None if k == NO_KEY else self._routes.get(k)
        if follow is None and self._scoring and (route is None or self._rule.scores_planned(k in self._pinned)):
            assert follower is not None
            held = follower.held(blocks, tokens)
        if k == NO_KEY:
            outcome, d = self._rule.choose(None, None, self._usable, follow=follow, follow_gain=gain, held=held,
                                           prompt_tokens=tokens)
        else:
            outcome, d = self._rule.choose(
                self._hash_list[k], route, self._usable, follow=follow, follow_gain=gain,
                pinned=k in self._pinned, held=held, prompt_tokens=tokens,
            )
        self.last_outcome = outcome
        if outcome == PLANNED:
            self.planned_requests += 1
        elif outcome == SPILLED:
            self.spilled_requests += 1
        elif outcome == FOLLOWED:
            self.followed_requests += 1
        c = follower.settle(blocks, d, tokens) if follower is not None else tokens
        if charging:
            view.pending[d][i] = c
        return d


class KeySeededP2C(Planned):
    """Key-seeded p2c alone, no plan: the router's routing of keys its plan does not hold, as a
    per-request policy of its own (load in requests, no prefix memory)."""

    name: ClassVar[str] = "key-p2c"

    def __init__(self) -> None:
        super().__init__(None)


@dataclass(frozen=True)
class PlannerSettings:
    """What the operator passes to the planner every control period."""

    control_period_s: float = DEFAULT_CONTROL_PERIOD_S
    window_s: float = DEFAULT_WINDOW_S  # statistics window, ending at the re-plan
    budget: Budget = field(default_factory=Budget)
    stability: Stability = field(default_factory=Stability)
    cost: CostModel = field(default_factory=CostModel)
    spill_threshold: float = DEFAULT_SPILL_THRESHOLD
    unplanned: str = DEFAULT_UNPLANNED  # how the router sends keys outside the plan

    def __post_init__(self) -> None:
        if not self.control_period_s > 0:
            raise ValueError("control period must be positive")
        if not self.window_s > 0:
            raise ValueError("statistics window must be positive")
        check_spill(self.spill_threshold, DEFAULT_SPILL_SLACK)
        check_unplanned_mode(self.unplanned)


class PlanGuard(Protocol):
    """A check of every candidate plan before CacheRoute routes by it (`guard.ReplayGuard`):
    whether the candidate may run, and whether the plan in effect (`current`) may stay, judged on
    `trace` up to `now` on destinations of `profile`, every plan routed by `routing`."""

    def __call__(self, trace: RequestTrace, now: float, candidate: Plan, profile: EngineProfile, seed: int, *,
                 routing: RoutingSettings, current: Plan | None) -> tuple[bool, bool]: ...


class CacheRoute(Planned):
    name: ClassVar[str] = "cacheroute"

    def __init__(self, settings: PlannerSettings | None = None, spill_slack: float = DEFAULT_SPILL_SLACK,
                 guard: PlanGuard | None = None, routing: RoutingSettings | None = None) -> None:
        self.settings = settings or PlannerSettings()
        super().__init__(None, spill_slack, self.settings.unplanned, routing or CACHEROUTE_ROUTING)
        self.guard = guard
        self.replans = 0
        self.guard_rejections = 0
        self.withdrawals = 0

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
            "guard": self.guard is not None,
            "tokens_per_unit": self.routing.tokens_per_unit,
            "in_flight_weight": self.routing.in_flight_weight,
            "follow_prefixes": self.routing.follow_prefixes,
            "score_unplanned": self.routing.score_unplanned,
            "credit_entries": self.routing.credit_entries,
        }

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        trace = view.trace
        start = float(trace.arrival_s[0]) if len(trace) else 0.0
        self._next_plan = start + self.settings.control_period_s
        self._previous: Plan | None = None
        profile = view.profile
        self._plan_destinations = tuple(
            Destination(id=d, kv_capacity_tokens=profile.kv_capacity_tokens,
                        host_kv_capacity_tokens=profile.host_kv_capacity_tokens)
            for d in view.destination_ids
        )
        cost = self.settings.cost
        if profile.host_kv_capacity_tokens and not cost.host_copy_s_per_token:
            # The planner values host-held prefixes net of the copy back this replica pays.
            cost = replace(cost, host_copy_s_per_token=profile.host_copy_s_per_token)
        self._cost = cost
        self.replans = 0
        self.guard_rejections = 0
        self.withdrawals = 0

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
                self._plan_destinations,
                pool="replay",
                budget=s.budget,
                stability=s.stability,
                cost=self._cost,
                previous=self._previous,
                spill_threshold=s.spill_threshold,
            )
        except PlanInputError:
            # Nothing plannable in this window: the operator keeps the last good plan.
            return
        candidate = result.plan
        self.replans += 1
        if self.guard is not None:
            passed, holds = self.guard(trace, now, candidate, self.view.profile, self.replans, routing=self.routing,
                                       current=self._previous)
            if not passed:
                # As in the operator: the plan in effect stays while it is no worse than no plan (none
                # yet: the router's routing without one), and the next candidate is planned from it.
                self.guard_rejections += 1
                if self._previous is not None and not holds:
                    self.withdrawals += 1
                    self._previous = None
                    self.install(None)
                return
        self._previous = candidate
        self.install(candidate, np.unique(win.key[win.key != NO_KEY]))
