"""The four steps of a plan, each through its own module: load and replicas, admission, placement,
stability. (`test_planner_planning.py` tests them together through `compute_plan`.)"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from cacheroute.planner.admission import admit, eligible_keys, greedy_admit, nothing_admitted_because
from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic, affinity_key_hashes
from cacheroute.planner.load import CostModel, key_demand, warm_budget
from cacheroute.planner.placement import KeptRoutes, placer_for
from cacheroute.planner.plan import Destination, plan_from_routes
from cacheroute.planner.settings import Budget, Stability
from cacheroute.planner.stability import keep_previous, moved_replicas, previous_routes, stabilise

# One prompt token of prefill costs 1 ms; nothing else costs: a key's warm load is rate x
# (prompt - prefix) / 1000 destinations.
UNIT = CostModel(prefill_s_per_token=1e-3, decode_s_per_token=0.0)


def stats_of(rows: Mapping[str, tuple[float, float, float]], unkeyed: UnkeyedTraffic | None = None) -> KeyStats:
    """Keys as name -> (rate, prompt tokens, prefix tokens); no output tokens."""
    names = tuple(rows)
    cols = np.array([rows[n] for n in names], dtype=np.float64).reshape(len(names), 3)
    return KeyStats(names, cols[:, 0], cols[:, 1], cols[:, 2], np.zeros(len(names)), unkeyed or UnkeyedTraffic())


def fleet(n: int, kv: int = 0) -> list[Destination]:
    return [Destination(f"d-{i}", "", 1.0, kv) for i in range(n)]


def demand_of(stats: KeyStats, n: int, budget: Budget, pinned: dict[str, list[str]] | None = None):
    return key_demand(stats, fleet(n), weights=np.ones(n), pinned=pinned or {}, budget=budget, cost=UNIT)


def admitted_of(stats: KeyStats, n: int, budget: Budget, previous=None, stability: Stability | None = None):
    demand = demand_of(stats, n, budget)
    admission = admit(stats, key_load=demand.key_load, replicas=demand.replicas, room=demand.room,
                      pinned=demand.pinned.mask, previous=previous, stability=stability or Stability(), cost=UNIT)
    return demand, admission


# --- 1. load and replicas ---------------------------------------------------------------------------


def test_warm_budget_is_the_fixed_number_within_capacity_or_a_share_of_it() -> None:
    ds = [Destination("a", "", 1.0, 1_000), Destination("b", "", 1.0, 0), Destination("c", "", 1.0, 10_000)]
    assert warm_budget(ds, Budget(warm_tokens_per_destination=5_000)).tolist() == [1_000, 5_000, 5_000]
    assert warm_budget(ds, Budget(auto_fraction=0.5)).tolist() == [500, 0, 5_000]


def test_a_key_gets_enough_replicas_that_none_takes_more_than_its_share_of_a_destination() -> None:
    # hot: 10 req/s x 200 fresh tokens x 1 ms = 2.0 destinations; at most 0.5 each: 4 replicas.
    stats = stats_of({"hot": (10.0, 1_200, 1_000), "cold": (0.1, 1_200, 1_000)})
    demand = demand_of(stats, 6, Budget(1_000, max_key_share_of_destination=0.5, max_destinations_per_key=8))
    assert demand.key_load.tolist() == pytest.approx([2.0, 0.02])
    assert demand.replicas.tolist() == [4, 1]
    assert demand_of(stats, 3, Budget(1_000, max_destinations_per_key=8)).replicas.tolist() == [3, 1]


def test_pinned_routes_take_their_load_and_warm_room_before_admission() -> None:
    stats = stats_of({"a": (2.0, 1_500, 1_000), "b": (1.0, 1_500, 1_000)})
    demand = demand_of(stats, 2, Budget(3_000, max_destinations_per_key=2), {"a": ["d-1", "d-0"], "gone": ["d-0"]})
    pin = demand.pinned
    assert pin.mask.tolist() == [True, False]
    assert pin.rows.tolist() == [0, -1]  # a key without statistics is routed but carries nothing
    assert pin.load.tolist() == pytest.approx([0.5, 0.5])  # a's 1.0 split over its two destinations
    assert demand.room.tolist() == [2_000, 2_000]
    assert not demand.notes
    over = demand_of(stats, 2, Budget(500), {"a": ["d-1"]})
    assert over.room.tolist() == [500, 0]
    assert over.notes == ("pinned prefixes exceed the warm budget on d-1",)


@pytest.mark.parametrize(
    ("pinned", "message"),
    [
        ({"a": []}, "must list at least one destination"),
        ({"a": ["d-9"]}, "names destination 'd-9', which is not in the pool"),
        ({"a": ["d-0", "d-0"]}, "lists a destination twice"),
        ({"a": ["d-0", "d-1", "d-2"]}, "more than budget.max_destinations_per_key=2"),
    ],
)
def test_bad_pinned_routes_are_refused_naming_the_key(pinned: dict[str, list[str]], message: str) -> None:
    with pytest.raises(PlanInputError, match=message):
        demand_of(stats_of({"a": (1.0, 100, 50)}), 3, Budget(1_000, max_destinations_per_key=2), pinned)


# --- 2. admission -------------------------------------------------------------------------------------


def test_eligible_keys_have_something_to_save_and_fit_on_their_replicas() -> None:
    rate = np.array([1.0, 0.0, 1.0, 1.0, 1.0])
    prefix = np.array([100.0, 100.0, 0.0, 600.0, 300.0])
    replicas = np.array([1, 1, 1, 1, 2])
    room = np.array([500.0, 300.0])
    assert eligible_keys(rate, prefix, replicas, room).tolist() == [True, False, False, False, True]
    excluded = np.array([True, False, False, False, False])
    assert eligible_keys(rate, prefix, replicas, room, excluded).tolist() == [False, False, False, False, True]


def test_greedy_admission_takes_the_densest_keys_and_skips_those_that_no_longer_fit() -> None:
    candidates = np.arange(4)
    density = np.array([4.0, 3.0, 2.0, 1.0])
    cost = np.array([5.0, 6.0, 3.0, 2.0])
    # 0 fits (5 left of 10), 1 does not, 2 fits (2 left), 3 fits (0 left).
    assert greedy_admit(candidates, density, cost, 10.0).tolist() == [0, 2, 3]
    assert greedy_admit(candidates, density, cost, 0.0).tolist() == []


def test_admission_ranks_keys_by_prefill_saved_per_kv_token() -> None:
    # long saves 9,000 tokens/s for 9,000 of KV (1 per token); short 2,000 for 1,000 (2 per token).
    stats = stats_of({"long": (1.0, 10_000, 9_000), "short": (2.0, 2_000, 1_000)})
    _, admission = admitted_of(stats, 1, Budget(9_500))
    assert admission.keys.rows.tolist() == [1]
    assert admission.candidates == 2
    _, both = admitted_of(stats, 1, Budget(10_000))
    assert both.keys.rows.tolist() == [0, 1]
    assert both.keys.per_replica.tolist() == pytest.approx([1.0, 2.0])
    assert both.keys.cold.tolist() == pytest.approx([10.0, 4.0])


def test_keys_of_the_previous_plan_keep_their_slot_against_a_slightly_denser_newcomer() -> None:
    stats = stats_of({"incumbent": (1.00, 2_000, 1_000), "newcomer": (1.01, 2_000, 1_000)})
    _, fresh = admitted_of(stats, 1, Budget(1_000))
    assert fresh.keys.rows.tolist() == [1]
    previous = plan_from_routes("p", fleet(1), {int(affinity_key_hashes(["incumbent"])[0]): ["d-0"]})
    _, kept = admitted_of(stats, 1, Budget(1_000), previous, Stability(min_gain=0.02))
    assert kept.keys.rows.tolist() == [0]
    # A head start smaller than the newcomer's lead does not save the incumbent.
    _, lost = admitted_of(stats, 1, Budget(1_000), previous, Stability(min_gain=0.005))
    assert lost.keys.rows.tolist() == [1]


def test_an_empty_admission_says_why() -> None:
    budget = np.array([100.0])
    assert nothing_admitted_because(0, budget, 0, 0) == "no keyed traffic in the window: nothing to admit"
    assert "warm budget is zero" in (nothing_admitted_because(3, np.zeros(1), 0, 3) or "")
    assert "no key has a reusable prefix that fits" in (nothing_admitted_because(3, budget, 0, 3) or "")
    assert "/v1/completions request shows none" in (nothing_admitted_because(3, budget, 0, 0) or "")
    assert nothing_admitted_because(3, budget, 1, 3) is None


# --- 3. placement -----------------------------------------------------------------------------------


def placer_of(rows: Mapping[str, tuple[float, float, float]], n: int, budget: Budget,
              unkeyed: UnkeyedTraffic | None = None):
    stats = stats_of(rows, unkeyed)
    demand, admission = admitted_of(stats, n, budget)
    return placer_for(admission.keys, demand, stats, UNIT, np.ones(n))


def test_placement_spreads_replicas_longest_first_onto_the_least_loaded_destinations() -> None:
    # Loads 0.6, 0.5, 0.4, 0.3 onto two destinations: LPT gives {0.6, 0.3} and {0.5, 0.4}.
    rows = {f"k{i}": (load, 1_100, 100) for i, load in enumerate([0.6, 0.5, 0.4, 0.3])}
    placer = placer_of(rows, 2, Budget(1_000, max_key_share_of_destination=1.0))
    a = placer.assign(KeptRoutes.nothing(placer.adm.replicas))
    key, dest = a.by_key()
    assert key.tolist() == [0, 1, 2, 3]
    assert dest[0] == dest[3] != dest[1] == dest[2]
    assert sorted(a.planned.tolist()) == pytest.approx([0.9, 0.9])
    assert a.room.tolist() == [800, 800]
    assert placer.objective(a) == pytest.approx(0.9)


def test_kept_replicas_stay_and_a_key_s_new_replicas_avoid_the_destinations_it_keeps() -> None:
    rows = {"hot": (4.0, 1_100, 100), "b": (0.1, 1_100, 100)}
    placer = placer_of(rows, 4, Budget(1_000, max_key_share_of_destination=1.0, max_destinations_per_key=4))
    assert placer.adm.replicas.tolist() == [4, 1]
    kept = KeptRoutes(key=np.array([0]), dest=np.array([2]), missing=np.array([3, 1]), forced=np.zeros(2, np.int64))
    key, dest = placer.assign(kept).by_key()
    hot = dest[key == 0].tolist()
    assert hot[0] == 2 and sorted(hot) == [0, 1, 2, 3]


def test_unplaced_keys_and_unkeyed_traffic_are_spread_by_p2c() -> None:
    placer = placer_of({"a": (1.0, 1_100, 100)}, 2, Budget(1_000), UnkeyedTraffic(rate=2.0, prompt_tokens=500))
    assert placer.unkeyed == pytest.approx(1.0)
    nothing = placer.assign(KeptRoutes(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64),
                                       np.zeros(1, np.int64)))
    assert placer.spread(nothing) == pytest.approx(1.0 + 1.1)  # unkeyed + a, cold
    placed = placer.assign(KeptRoutes.nothing(placer.adm.replicas))
    assert placer.spread(placed) == pytest.approx(1.0)


# --- 4. stability -----------------------------------------------------------------------------------


def test_previous_routes_map_destinations_by_id_and_mark_vanished_ones() -> None:
    hashes = affinity_key_hashes(["a", "b", "c"])
    previous = plan_from_routes("p", fleet(3), {int(hashes[0]): ["d-2", "d-0"], int(hashes[2]): ["d-1"]})
    prev = previous_routes(previous, hashes, ["d-0", "d-2"])  # d-1 is gone
    assert prev.offsets.tolist() == [0, 2, 2, 3]
    assert prev.dest.tolist() == [1, 0, -1]


def test_keep_previous_keeps_what_still_fits_and_forces_the_rest_to_move() -> None:
    hashes = affinity_key_hashes(["a", "b", "c"])
    previous = plan_from_routes("p", fleet(2), {int(hashes[0]): ["d-0"], int(hashes[1]): ["d-0"],
                                                int(hashes[2]): ["d-1"]})
    prev = previous_routes(previous, hashes, ["d-0"])  # d-1 is gone
    # d-0 has room for one prefix: the key of higher priority stays.
    kept = keep_previous(prev, np.array([1, 1, 1]), np.array([100.0, 100.0, 100.0]), np.array([1.0, 2.0, 3.0]),
                         np.array([150.0]))
    assert kept.key.tolist() == [1] and kept.dest.tolist() == [0]
    assert kept.missing.tolist() == [1, 0, 1]
    assert kept.forced.tolist() == [1, 0, 1]


def test_moved_replicas_count_new_destinations_of_incumbents_beyond_growth() -> None:
    prev = previous_routes(
        plan_from_routes("p", fleet(3), {int(h): ["d-0"] for h in affinity_key_hashes(["a", "b"])}),
        affinity_key_hashes(["a", "b", "new"]),
        ["d-0", "d-1", "d-2"],
    )
    # a moved to d-1; b grew to two replicas (d-0 kept, d-2 added); new is new.
    moved = moved_replicas(np.array([0, 1, 1, 2]), np.array([1, 0, 2, 1]), prev, np.array([1, 2, 1]))
    assert moved.tolist() == [1, 0, 0]


def skewed_replan(stability: Stability):
    """Four keys of 0.5 that the previous plan put all on d-0 of a now larger fleet."""
    rows = {f"k{i}": (0.5, 1_100, 100) for i in range(4)}
    placer = placer_of(rows, 4, Budget(1_000, max_key_share_of_destination=1.0))
    previous = plan_from_routes("p", fleet(4), {int(h): ["d-0"] for h in placer.adm.hashes})
    return stabilise(placer, previous, ["d-0", "d-1", "d-2", "d-3"], stability, pinned_load=0.0)


def test_a_placement_that_does_not_gain_enough_is_kept_in_place() -> None:
    stats = stats_of({f"k{i}": (0.1, 1_100, 100) for i in range(4)})
    demand, admission = admitted_of(stats, 4, Budget(1_000))
    placer = placer_for(admission.keys, demand, stats, UNIT, np.ones(4))
    first = stabilise(placer, None, ["d-0", "d-1", "d-2", "d-3"], Stability(), pinned_load=0.0)
    previous = plan_from_routes("p", fleet(4), {int(h): [f"d-{d}"] for h, d in
                                                zip(admission.keys.hashes[first.key], first.dest, strict=True)})
    again = stabilise(placer, previous, ["d-0", "d-1", "d-2", "d-3"], Stability(), pinned_load=0.0)
    assert again.kept_previous
    assert again.churn == 0.0
    assert again.dest.tolist() == first.dest.tolist()
    assert again.note.startswith("kept previous placement: a fresh placement gains 0.0%")


def test_a_rebalance_moves_at_most_the_churn_cap_from_the_most_loaded_destination() -> None:
    capped = skewed_replan(Stability(max_churn=0.5, min_gain=0.02))
    assert not capped.kept_previous
    assert capped.note.startswith("re-balanced: max load 2.000 -> 1.000")
    assert capped.churn == pytest.approx(0.5) and capped.churn_forced == 0.0
    assert np.count_nonzero(capped.dest == 0) == 2
    frozen = skewed_replan(Stability(max_churn=0.0))
    assert frozen.kept_previous and frozen.churn == 0.0
    assert "max churn is 0" in frozen.note


def test_moves_off_a_vanished_destination_are_forced_and_not_capped() -> None:
    rows = {f"k{i}": (0.5, 1_100, 100) for i in range(4)}
    placer = placer_of(rows, 2, Budget(1_000, max_key_share_of_destination=1.0))
    previous = plan_from_routes("p", fleet(3), {int(h): ["d-2"] for h in placer.adm.hashes})
    result = stabilise(placer, previous, ["d-0", "d-1"], Stability(max_churn=0.0), pinned_load=0.0)
    assert result.churn == result.churn_forced == 1.0
    assert sorted(np.bincount(result.dest, minlength=2).tolist()) == [2, 2]
