"""Properties of whole plans for random input (hypothesis)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic
from cacheroute.planner.load import CostModel
from cacheroute.planner.plan import Destination, Plan, affinity_key_hash
from cacheroute.planner.plan_format import encode_plan
from cacheroute.planner.planning import PlanResult, compute_plan
from cacheroute.planner.settings import Budget, Stability

COST = CostModel(prefill_s_per_token=1e-4, decode_s_per_token=1e-3)


@dataclass
class Case:
    stats: KeyStats
    dests: list[Destination]
    budget: Budget
    stability: Stability
    pinned: dict[str, list[str]]
    previous: Plan | None


@st.composite
def stats_strategy(draw: st.DrawFn, names: st.SearchStrategy[str] | None = None) -> KeyStats:
    n = draw(st.integers(0, 40))
    rows = draw(
        st.lists(
            st.tuples(
                st.one_of(st.just(0.0), st.floats(0.0, 5.0)),
                st.floats(1.0, 20_000.0),
                st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
                st.floats(0.0, 400.0),
            ),
            min_size=n,
            max_size=n,
        )
    )
    unkeyed = UnkeyedTraffic(draw(st.floats(0, 10)), draw(st.floats(0, 5_000)), draw(st.floats(0, 300)))
    return KeyStats(
        names=tuple(f"key-{i}" for i in range(n)),
        rate=np.array([r[0] for r in rows], dtype=np.float64),
        prompt_tokens=np.array([r[1] for r in rows], dtype=np.float64),
        prefix_tokens=np.array([r[1] * r[2] for r in rows], dtype=np.float64),
        output_tokens=np.array([r[3] for r in rows], dtype=np.float64),
        unkeyed=unkeyed,
    )


@st.composite
def destinations_strategy(draw: st.DrawFn, identical: bool = False) -> list[Destination]:
    m = draw(st.integers(1, 6))
    weights = [1.0] * m if identical else draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=m, max_size=m))
    kv = draw(st.lists(st.sampled_from([0, 5_000, 20_000, 100_000]), min_size=m, max_size=m))
    return [Destination(f"d-{i}", "", w, k) for i, (w, k) in enumerate(zip(weights, kv, strict=True))]


@st.composite
def cases(draw: st.DrawFn, with_previous: bool = True) -> Case:
    stats = draw(stats_strategy())
    dests = draw(destinations_strategy())
    budget = Budget(
        warm_tokens_per_destination=draw(st.one_of(st.just("auto"), st.integers(0, 60_000))),
        auto_fraction=draw(st.floats(0.1, 1.0)),
        max_destinations_per_key=draw(st.integers(1, 4)),
        max_key_share_of_destination=draw(st.floats(0.05, 1.0)),
    )
    stability = Stability(max_churn=draw(st.floats(0.0, 1.0)), min_gain=draw(st.floats(0.0, 0.2)))
    pinned: dict[str, list[str]] = {}
    for name in draw(st.lists(st.sampled_from([*stats.names, "extra-1", "extra-2"]), max_size=4, unique=True)):
        k = draw(st.integers(1, min(budget.max_destinations_per_key, len(dests))))
        pinned[name] = list(draw(st.permutations([d.id for d in dests]))[:k])
    previous = None
    if with_previous and draw(st.booleans()):
        # The previous period: other traffic, and a fleet that may have lost or gained members.
        old_stats = draw(stats_strategy())
        old_dests = draw(destinations_strategy())
        previous = compute_plan(old_stats, old_dests, pool="p", budget=Budget(10_000), cost=COST).plan
    return Case(stats, dests, budget, stability, pinned, previous)


def run(case: Case, generated_at: str = "") -> PlanResult:
    return compute_plan(
        case.stats,
        case.dests,
        pool="p",
        budget=case.budget,
        stability=case.stability,
        cost=COST,
        previous=case.previous,
        pinned=case.pinned,
        generated_at=generated_at,
    )


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@given(cases())
@SETTINGS
def test_plans_respect_budget_replicas_pins_and_churn(case: Case) -> None:
    result = run(case)
    plan = result.plan
    m = len(case.dests)
    idx = {d.id: i for i, d in enumerate(case.dests)}
    routes = plan.routes()
    stats = case.stats
    prefix = dict(zip(stats.names, stats.prefix_tokens.tolist(), strict=True))
    # Pinned routes are in the plan exactly as given.
    for key, pin in case.pinned.items():
        assert routes.pop(affinity_key_hash(key)) == tuple(pin)
    pinned_kv = np.zeros(m)
    for key, pin in case.pinned.items():
        for d in pin:
            pinned_kv[idx[d]] += prefix.get(key, 0.0)
    # Every other routed key: a known key with something to reuse, 1..max destinations, distinct.
    by_hash = {affinity_key_hash(n): i for i, n in enumerate(stats.names)}
    used = np.zeros(m)
    for h, ids in routes.items():
        row = by_hash[h]
        assert stats.rate[row] > 0 and stats.prefix_tokens[row] > 0
        assert 1 <= len(ids) <= case.budget.max_destinations_per_key
        assert len(set(ids)) == len(ids)
        for d in ids:
            used[idx[d]] += stats.prefix_tokens[row]
    # The warm budget is never exceeded (beyond what pinned routes alone take).
    budget = result.warm_budget
    assert bool(np.all(used <= np.maximum(budget - pinned_kv, 0.0) * (1 + 1e-9) + 1e-6))
    assert np.allclose(result.warm_used, used + pinned_kv)
    # Voluntary churn within the cap; forced and voluntary make up the total.
    assert result.churn_voluntary <= case.stability.max_churn + 1e-9
    assert abs(result.churn - result.churn_forced - result.churn_voluntary) < 1e-9
    assert 0.0 <= result.churn_forced <= result.churn <= 1.0 + 1e-9
    if case.previous is None:
        assert result.churn == 0.0
    # The lower bound is one.
    assert result.lower_bound <= result.objective * (1 + 1e-9) + 1e-12
    assert set(plan.summary.predicted_load) == set(idx)


@given(cases())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_identical_input_gives_identical_plan_bytes(case: Case) -> None:
    a = encode_plan(run(case, "2026-01-01T00:00:00Z").plan)
    b = encode_plan(run(case, "2026-01-01T00:00:00Z").plan)
    assert a.files == b.files
    assert a.version == b.version


@given(stats_strategy(), destinations_strategy())
@SETTINGS
def test_objective_meets_the_list_scheduling_bound(stats: KeyStats, dests: list[Destination]) -> None:
    """One destination per key and warm room that never binds: only load decides placement.

    (Replicas must land on distinct destinations, which on a mixed fleet can force one onto a
    small destination; the bound is for keys free to go anywhere.)
    """
    budget = Budget(warm_tokens_per_destination=10**9, max_destinations_per_key=1)
    dests = [Destination(d.id, "", d.weight, 0) for d in dests]
    result = compute_plan(stats, dests, pool="p", budget=budget, cost=COST)
    w = np.array([d.weight for d in dests])
    routed = np.flatnonzero(result.routed)
    largest = float(result.key_load[routed].max()) if len(routed) else 0.0
    mean = (float(result.planned_load.sum()) + result.spread_load) / float(w.sum())
    assert result.objective <= mean + largest / float(w.min()) + 1e-9
    assert result.unplaced_keys == 0


@given(stats_strategy(), st.integers(1, 6), st.floats(0.05, 1.0))
@SETTINGS
def test_replicated_keys_split_their_load_within_the_share(stats: KeyStats, m: int, share: float) -> None:
    budget = Budget(warm_tokens_per_destination=10**9, max_destinations_per_key=4, max_key_share_of_destination=share)
    dests = [Destination(f"d-{i}", "", 1.0, 0) for i in range(m)]
    result = compute_plan(stats, dests, pool="p", budget=budget, cost=COST)
    for row in np.flatnonzero(result.routed).tolist():
        n_dest = len(result.destinations_of_key(row))
        assert n_dest == result.replicas[row] == min(4, m, max(1, math.ceil(result.key_load[row] / share - 1e-12)))
        # Below the cap, no replica takes more than the allowed share of a destination.
        if n_dest < min(4, m):
            assert result.key_load[row] / n_dest <= share + 1e-12


def optimum(items: list[float], m: int) -> float:
    best = float("inf")
    for assign in itertools.product(range(m), repeat=len(items)):
        per = [0.0] * m
        for p, d in zip(items, assign, strict=True):
            per[d] += p
        best = min(best, max(per))
    return best


@given(stats_strategy(), st.integers(2, 4))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_planned_load_is_within_the_lpt_factor_of_the_optimum(stats: KeyStats, m: int) -> None:
    """Identical destinations, one destination per key: LPT's (4/3 - 1/(3m)) x optimum."""
    budget = Budget(warm_tokens_per_destination=10**9, max_destinations_per_key=1)
    dests = [Destination(f"d-{i}", "", 1.0, 0) for i in range(m)]
    result = compute_plan(stats, dests, pool="p", budget=budget, cost=COST)
    items = result.key_load[result.routed].tolist()
    if not items or len(items) > 7:
        return
    opt = optimum(items, m)
    assert float(result.planned_load.max()) <= (4 / 3 - 1 / (3 * m)) * opt * (1 + 1e-9)
