"""Each routing policy's defining behaviour, on crafted requests and router states."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from cacheroute.planner.plan import Destination, Plan, plan_from_routes
from cacheroute.planner.replay.engine import Engine, RequestTable
from cacheroute.planner.replay.guard import ReplayGuard
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE, EngineProfile
from cacheroute.planner.replay.planned import CacheRoute, Planned, PlannerSettings, RoutingSettings
from cacheroute.planner.replay.policies import BoundedConsistentHash, PowerOfTwo, StickyHash
from cacheroute.planner.replay.policy import Policy, RouterView
from cacheroute.planner.replay.prefix_policies import GiePrefixScorer, Preble, PrefixTree
from cacheroute.planner.replay.registry import make_policy
from cacheroute.planner.replay.run import ReplayConfig, destination_ids, replay_trace
from cacheroute.planner.trace import RequestTrace


def bind(policy: Policy, trace: RequestTrace, n: int, seed: int = 0) -> RouterView:
    """The policy bound to a router view over idle destinations (in-flight counts settable)."""
    req = RequestTable(trace.arrival_s.tolist(), trace.input_tokens.tolist(), trace.output_tokens.tolist())
    offs = trace.block_offsets.tolist()

    def blocks(i: int) -> list[int]:
        out: list[int] = trace.block_ids[offs[i] : offs[i + 1]].tolist()
        return out

    engines = [Engine(d, DEFAULT_PROFILE, trace.block_size, req, blocks) for d in range(n)]
    view = RouterView(trace, engines, req, destination_ids=destination_ids(n), profile=DEFAULT_PROFILE,
                      get_blocks=blocks)
    policy.bind(view, seed)
    return view


def set_load(view: RouterView, loads: list[int]) -> None:
    view.inflight[:] = loads
    view.total_inflight = sum(loads)


def test_sticky_hash_sends_each_key_to_one_destination(make_trace) -> None:
    reqs = [(i * 0.5, f"k{i % 5}", 40, 4, [1000 * i + j for j in range(10)]) for i in range(50)]
    r = replay_trace(make_trace(reqs), StickyHash(), ReplayConfig(destinations=8))
    by_key: dict[int, set[int]] = {}
    for k, d in zip(np.arange(50) % 5, r.dest.tolist(), strict=True):
        by_key.setdefault(int(k), set()).add(d)
    assert all(len(ds) == 1 for ds in by_key.values())
    assert len({next(iter(ds)) for ds in by_key.values()}) > 1


def test_p2c_never_picks_the_busiest_and_always_the_idlest_when_drawn(make_trace) -> None:
    trace = make_trace([(0.0, "a", 4, 1, [1])])
    pol = PowerOfTwo()
    view = bind(pol, trace, 4, seed=1)
    set_load(view, [0, 10, 20, 30])
    picks = Counter(pol.route(0, 0.0) for _ in range(3000))
    assert picks[3] == 0
    # Destination 0 is in half of the six pairs and wins all of them.
    assert picks[0] / 3000 == pytest.approx(0.5, abs=0.05)
    assert picks[1] / 3000 == pytest.approx(1 / 3, abs=0.05)


def test_chwbl_keeps_a_key_in_place_until_its_destination_is_overloaded(make_trace) -> None:
    trace = make_trace([(0.0, "tenant-42", 4, 1, [1])])
    pol = BoundedConsistentHash()
    view = bind(pol, trace, 8)
    home = pol.route(0, 0.0)
    set_load(view, [10] * 8)
    assert pol.route(0, 0.0) == home  # balanced load: stays on its ring position
    loads = [10] * 8
    loads[home] = 40  # in_flight + 1 > (total + 1) / n * 1.25
    set_load(view, loads)
    moved = pol.route(0, 0.0)
    assert moved != home
    # The next destination clockwise, deterministically.
    assert pol.route(0, 0.0) == moved
    # Light load: (total + 1) / n * 1.25 < 1, so no destination passes the bound and KubeAI takes
    # the first destination of the walk, the key's home.
    loads = [0] * 8
    loads[(home + 1) % 8] = 1
    set_load(view, loads)
    assert pol.route(0, 0.0) == home


def test_prefix_tree_follows_the_longest_match_until_load_is_imbalanced(make_trace) -> None:
    trace = make_trace([
        (0.0, None, 16, 1, [1, 2, 3, 4]),
        (1.0, None, 16, 1, [1, 2, 3, 5]),  # shares 3 of 4 blocks with request 0
        (2.0, None, 16, 1, [7, 8, 9, 10]),  # shares nothing
        (3.0, None, 16, 1, [1, 2, 3, 6]),
    ])
    pol = PrefixTree()
    view = bind(pol, trace, 4)
    set_load(view, [3, 0, 2, 5])
    first = pol.route(0, 0.0)
    assert first == 1  # no match: least loaded
    set_load(view, [3, 9, 2, 5])
    assert pol.route(1, 1.0) == first  # match 75 % > 30 %: the worker holding it, despite load
    assert pol.route(2, 2.0) == 2  # no match: least loaded
    set_load(view, [100, 170, 100, 100])  # max - min > 64 and max > 1.5 min: imbalanced
    assert pol.route(3, 3.0) == 0  # shortest queue, match ignored


def test_gie_scorer_prefers_the_pod_with_the_prefix_unless_it_is_saturated(make_trace) -> None:
    trace = make_trace([
        (0.0, None, 16, 1, [1, 2, 3, 4]),
        (1.0, None, 16, 1, [1, 2, 3, 4]),
        (2.0, None, 16, 1, [1, 2, 3, 4]),
    ])
    pol = GiePrefixScorer()
    view = bind(pol, trace, 3, seed=5)
    home = pol.route(0, 0.0)
    assert pol.route(1, 1.0) == home  # prefix 3 + queue 2 + kv 2 beats 0 + 2 + 2
    cache = view.engines[home].cache
    cache.pinned_tokens = cache.capacity_tokens  # KV full: kv score 0
    view.engines[home].waiting.extend([7, 8, 9])  # longest queue: queue score 0
    assert pol.route(2, 2.0) != home


def test_preble_exploits_long_matches_and_explores_by_load(make_trace) -> None:
    trace = make_trace([
        (0.0, None, 32, 1, [1, 2, 3, 4, 5, 6, 7, 8]),
        (1.0, None, 36, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9]),  # 8 of 9 blocks seen: exploit
        (2.0, None, 32, 1, [20, 21, 22, 23, 24, 25, 26, 27]),  # new prompt: explore
    ])
    pol = Preble()
    view = bind(pol, trace, 4)
    first = pol.route(0, 0.0)
    set_load(view, [1, 1, 1, 1])
    assert pol.route(1, 1.0) == first
    loads = [0, 0, 0, 0]
    loads[first] = 50
    set_load(view, loads)
    assert pol.route(2, 2.0) != first


def _plan_to(dest: int, key: str, n: int):
    from cacheroute.planner.plan import affinity_key_hash

    ds = [Destination(id=d) for d in destination_ids(n)]
    return plan_from_routes("pool", ds, {affinity_key_hash(key): [ds[dest].id]}, spill_threshold=1.5)


def test_planned_keys_follow_the_plan_and_spill_when_overloaded(make_trace) -> None:
    trace = make_trace([(0.0, "hot", 16, 1, [1, 2, 3, 4]), (0.0, "cold", 16, 1, [5, 6, 7, 8])])
    pol = Planned(_plan_to(3, "hot", 6), spill_slack=2.0, unplanned="p2c")
    view = bind(pol, trace, 6)
    set_load(view, [4, 4, 4, 6, 4, 4])
    assert all(pol.route(0, 0.0) == 3 for _ in range(50))
    # 14 > 1.5 x mean(~5.7) + 2: spill to p2c among the others.
    set_load(view, [4, 4, 4, 14, 4, 4])
    spilled = {pol.route(0, 0.0) for _ in range(50)}
    assert 3 not in spilled
    assert pol.spilled_requests == 50
    set_load(view, [0, 0, 0, 0, 0, 0])
    cold = {pol.route(1, 0.0) for _ in range(100)}
    assert len(cold) > 1  # unplanned: p2c


def test_unplanned_keys_stay_on_their_two_hash_candidates(make_trace) -> None:
    from cacheroute.planner.keyring import KeyRing
    from cacheroute.planner.plan import affinity_key_hash

    trace = make_trace([(0.0, "hot", 16, 1, [1, 2, 3, 4]), (0.0, "cold", 16, 1, [5, 6, 7, 8])])
    pol = Planned(_plan_to(3, "hot", 6))
    view = bind(pol, trace, 6)
    a, b = KeyRing(destination_ids(6)).pair(affinity_key_hash("cold"))
    assert a != b
    set_load(view, [2] * 6)
    assert {pol.route(1, 0.0) for _ in range(50)} == {a}  # a tie keeps the first candidate
    loads = [0] * 6
    loads[a] = 5
    loads[b] = 3
    set_load(view, loads)  # others idle, yet only the key's two candidates are compared
    assert {pol.route(1, 0.0) for _ in range(50)} == {b}
    assert pol.planned_requests == 0


def test_cacheroute_plans_from_the_past_only(make_trace) -> None:
    # Key a is busy from the start; key b only appears after the first re-plan at t = 60.
    reqs = [(float(t), "a", 64, 4, [1, 2, 3, 4, 100 + t]) for t in range(0, 180, 2)]
    reqs += [(float(t) + 0.5, "b", 64, 4, [50, 51, 52, 53, 500 + t]) for t in range(70, 180, 2)]
    reqs.sort(key=lambda r: r[0])
    trace = make_trace(reqs, block_size=16)
    pol = CacheRoute(PlannerSettings(control_period_s=60.0, window_s=60.0))
    view = bind(pol, trace, 4)
    k_a, k_b = view.key[0], next(view.key[i] for i, r in enumerate(reqs) if r[1] == "b")
    seen: dict[float, tuple[bool, bool]] = {}
    for i, r in enumerate(reqs):
        pol.route(i, r[0])
        seen[r[0]] = (k_a in pol._routes, k_b in pol._routes)
    assert seen[0.0] == (False, False)  # no plan before the first control period ends
    assert seen[60.0] == (True, False)  # planned at 60 from [0, 60): b has not arrived yet
    assert seen[120.0] == (True, True)  # the next plan sees b's requests of [60, 120)
    assert pol.replans >= 2


def test_a_key_with_several_destinations_goes_to_the_least_loaded_one(make_trace) -> None:
    from cacheroute.planner.plan import affinity_key_hash

    ds = [Destination(id=d) for d in destination_ids(6)]
    plan = plan_from_routes("pool", ds, {affinity_key_hash("hot"): [ds[1].id, ds[4].id]})
    trace = make_trace([(0.0, "hot", 16, 1, [1, 2, 3, 4])])
    pol = Planned(plan, routing=RoutingSettings(widen_planned=False))
    view = bind(pol, trace, 6)
    set_load(view, [3, 5, 3, 3, 2, 3])
    assert pol.route(0, 0.0) == 4
    set_load(view, [3, 1, 3, 3, 2, 3])
    assert pol.route(0, 0.0) == 1


def test_cacheroute_asks_its_guard_before_routing_by_a_new_plan(make_trace) -> None:
    reqs = [(float(t), "a", 64, 4, [1, 2, 3, 4, 100 + t]) for t in range(0, 200, 2)]
    trace = make_trace(reqs, block_size=16)
    asked: list[tuple[float, int]] = []

    def guard(trace: RequestTrace, now: float, candidate: Plan, profile: EngineProfile, seed: int, *,
              routing: RoutingSettings, current: Plan | None) -> tuple[bool, bool]:
        asked.append((now, len(candidate)))
        assert routing is pol.routing
        return verdict, True

    for verdict in (False, True):
        asked.clear()
        pol = CacheRoute(PlannerSettings(control_period_s=60.0, window_s=60.0), guard=guard)
        view = bind(pol, trace, 4)
        for i, r in enumerate(reqs):
            pol.route(i, r[0])
        assert [now for now, _ in asked] == [60.0, 120.0, 180.0]
        assert all(routes == 1 for _, routes in asked)
        assert pol.replans == 3
        # A rejected plan is not routed by: with no plan in effect yet, the period runs without one.
        assert pol.guard_rejections == (0 if verdict else 3)
        assert (view.key[0] in pol._routes) is verdict


@pytest.mark.parametrize("holds", [True, False])
def test_a_rejected_candidate_leaves_the_plan_in_effect_while_it_holds(make_trace, holds: bool) -> None:
    reqs = [(float(t), "a", 64, 4, [1, 2, 3, 4, 100 + t]) for t in range(0, 200, 2)]
    trace = make_trace(reqs, block_size=16)
    verdicts = iter([True, False, False])
    in_effect: list[Plan | None] = []

    def guard(*_args: object, current: Plan | None, **_kw: object) -> tuple[bool, bool]:
        in_effect.append(current)
        return next(verdicts), holds

    pol = CacheRoute(PlannerSettings(control_period_s=60.0, window_s=60.0), guard=guard)
    view = bind(pol, trace, 4)
    for i, r in enumerate(reqs):
        pol.route(i, r[0])
    assert (pol.replans, pol.guard_rejections) == (3, 2)
    assert in_effect[0] is None and in_effect[1] is not None
    if holds:
        # As the operator does: the first plan, applied, still routes after two rejected candidates.
        assert pol.withdrawals == 0 and view.key[0] in pol._routes
    else:
        # Worse than no plan on recent traffic: withdrawn, and nothing left to withdraw after.
        assert pol.withdrawals == 1 and view.key[0] not in pol._routes and in_effect[2] is None


def test_a_guarded_policy_holds_plans_to_the_objective_it_is_measured_against() -> None:
    guarded = make_policy("cacheroute-guard", slo_p99_ttft_s=1.25)
    assert isinstance(guarded, CacheRoute) and isinstance(guarded.guard, ReplayGuard)
    assert guarded.guard.settings.slo_p99_ttft_s == 1.25
    default = make_policy("cacheroute-guard")
    assert isinstance(default, CacheRoute) and isinstance(default.guard, ReplayGuard)
    assert default.guard.settings.slo_p99_ttft_s == 3.5
    # An objective gives no guard to a policy that has none.
    unguarded = make_policy("cacheroute", slo_p99_ttft_s=1.25)
    assert isinstance(unguarded, CacheRoute) and unguarded.guard is None
    make_policy("gie-prefix", slo_p99_ttft_s=1.25)


def test_cacheroute_without_a_plan_routes_as_the_router_does_before_its_first_plan(make_trace) -> None:
    reqs = [(float(t), "a" if t % 4 else "b", 64, 4, [1, 2, 3, 4, 100 + t]) for t in range(0, 600, 2)]
    trace = make_trace(reqs, block_size=16)
    never = make_policy("cacheroute-noplan")
    planning = CacheRoute(PlannerSettings(control_period_s=60.0, window_s=60.0))
    bind(never, trace, 4)
    bind(planning, trace, 4)
    assert isinstance(never, CacheRoute)
    went = []
    for i, r in enumerate(reqs):
        went.append((never.route(i, r[0]), planning.route(i, r[0])))
    assert never.replans == 0 and not never._routes
    assert planning.replans > 0 and planning._routes
    # Before the first plan both route alike.
    assert all(a == b for (a, b), r in zip(went, reqs, strict=True) if r[0] < 60.0)
