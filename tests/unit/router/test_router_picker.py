"""Which endpoint a request gets: planned, spilled, p2c or none."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from cacheroute.planner.plan import Destination, Plan, affinity_key_hash, plan_from_routes
from cacheroute.planner.routing import P2C, PLANNED, SPILLED
from cacheroute.router.endpoints import EndpointPool, SliceEndpoint
from cacheroute.router.picker import NONE, Picker
from cacheroute.router.table import build_table

ADDRESSES = [f"10.0.0.{i}:8000" for i in range(1, 7)]


def plan_for(routes: dict[str, list[int]], spill_threshold: float = 1.5) -> Plan:
    destinations = [Destination(f"pool-{i}", a) for i, a in enumerate(ADDRESSES)]
    return plan_from_routes(
        "pool",
        destinations,
        {affinity_key_hash(k): [f"pool-{i}" for i in v] for k, v in routes.items()},
        spill_threshold=spill_threshold,
    )


def picker_for(plan: Plan, *, seed: int = 1, slack: float = 2.0, fallbacks: int = 0, widen: bool = False) -> Picker:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, spill_slack=slack, fallbacks=fallbacks, seed=seed, widen_planned=widen)
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    return picker


def key(name: str) -> int:
    return affinity_key_hash(name)


def test_planned_key_goes_to_its_destination() -> None:
    picker = picker_for(plan_for({"alice": [3]}))
    for _ in range(20):
        decision = picker.pick(key("alice"))
        assert decision.outcome == PLANNED
        assert decision.endpoints[0].address == ADDRESSES[3]


def test_multi_destination_key_takes_the_least_loaded() -> None:
    picker = picker_for(plan_for({"alice": [1, 2, 4]}))
    by_address = picker.pool.by_address
    by_address[ADDRESSES[1]].in_flight = 3
    by_address[ADDRESSES[2]].in_flight = 1
    by_address[ADDRESSES[4]].in_flight = 2
    assert picker.pick(key("alice")).endpoints[0].address == ADDRESSES[2]


def test_ties_are_broken_by_the_key_hash_identically_on_every_replica() -> None:
    plan = plan_for({f"k{i}": [0, 1, 2] for i in range(60)})
    first = picker_for(plan, seed=1)
    second = picker_for(plan, seed=99)
    chosen = [first.pick(key(f"k{i}")).endpoints[0].address for i in range(60)]
    assert chosen == [second.pick(key(f"k{i}")).endpoints[0].address for i in range(60)]
    # The hash spreads equally loaded keys over the key's destinations.
    assert set(chosen) == set(ADDRESSES[:3])
    assert chosen[0] == ADDRESSES[key("k0") % 3]


def test_overloaded_destination_spills_to_p2c() -> None:
    picker = picker_for(plan_for({"alice": [0]}, spill_threshold=1.5), slack=2.0)
    hot = picker.pool.by_address[ADDRESSES[0]]
    # Mean load over 6 endpoints with 12 in flight on the hot one: 2.0; bound 1.5 * 2 + 2 = 5.
    for _ in range(12):
        picker.pool.acquire(hot)
    decision = picker.pick(key("alice"))
    assert decision.outcome == SPILLED
    assert decision.endpoints[0] is not hot


def test_load_within_the_bound_stays_planned() -> None:
    picker = picker_for(plan_for({"alice": [0]}, spill_threshold=2.0), slack=1.0)
    pool = picker.pool
    for e in pool.ready:
        for _ in range(4):
            pool.acquire(e)
    hot = pool.by_address[ADDRESSES[0]]
    # Mean 4.5 after 3 more on the hot endpoint: bound 2 * 4.5 + 1 = 10, load 7.
    for _ in range(3):
        pool.acquire(hot)
    assert picker.pick(key("alice")).outcome == PLANNED


def test_scraped_queue_counts_as_load() -> None:
    picker = picker_for(plan_for({"alice": [0]}))
    pool = picker.pool
    pool.record_scrape(pool.by_address[ADDRESSES[0]], ok=True, waiting=40)
    assert pool.waiting_ready == 40
    assert picker.pick(key("alice")).outcome == SPILLED


def test_unready_planned_destination_spills() -> None:
    plan = plan_for({"alice": [2]})
    pool = EndpointPool(scraping=True)
    picker = Picker(pool, seed=3)
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    for e in list(pool.by_address.values()):
        pool.record_scrape(e, ok=e.address != ADDRESSES[2])
    decisions = [picker.pick(key("alice")) for _ in range(30)]
    assert {d.outcome for d in decisions} == {SPILLED}
    assert ADDRESSES[2] not in {d.endpoints[0].address for d in decisions}


def test_unplanned_or_missing_key_uses_p2c_and_prefers_the_lighter_endpoint() -> None:
    plan = plan_for({"alice": [0]})
    picker = picker_for(plan)
    pool = picker.pool
    # Only two ready endpoints: p2c compares exactly these two.
    pool.set_slices({a: SliceEndpoint(a, "", a in ADDRESSES[:2]) for a in ADDRESSES})
    pool.by_address[ADDRESSES[0]].in_flight = 5
    for k in (key("bob"), None):
        decision = picker.pick(k)
        assert decision.outcome == P2C
        assert decision.endpoints[0].address == ADDRESSES[1]


def test_p2c_spreads_equal_load() -> None:
    picker = picker_for(plan_for({}))
    counts = Counter(picker.pick(None).endpoints[0].address for _ in range(600))
    assert set(counts) == set(ADDRESSES)
    assert min(counts.values()) > 50


def test_no_ready_endpoint_is_none() -> None:
    picker = picker_for(plan_for({"alice": [0]}))
    picker.pool.set_slices({})
    assert picker.pick(key("alice")).outcome == NONE
    assert picker.pick(None)[:2] == (NONE, ())


def test_single_ready_endpoint_keeps_an_overloaded_key() -> None:
    picker = picker_for(plan_for({"alice": [0]}))
    pool = picker.pool
    pool.set_slices({ADDRESSES[0]: SliceEndpoint(ADDRESSES[0], "pool-0", True)})
    for _ in range(50):
        pool.acquire(pool.by_address[ADDRESSES[0]])
    assert picker.pick(key("alice")).outcome == PLANNED


def test_subset_hint_limits_the_choice() -> None:
    picker = picker_for(plan_for({"alice": [0]}))
    allowed = {ADDRESSES[4], ADDRESSES[5]}
    decision = picker.pick(key("alice"), allowed)
    assert decision.outcome == SPILLED
    assert decision.endpoints[0].address in allowed
    assert picker.pick(key("alice"), {"10.9.9.9:1"}).outcome == NONE


@pytest.mark.parametrize("fallbacks", [1, 3])
def test_fallbacks_list_planned_destinations_then_the_least_loaded(fallbacks: int) -> None:
    picker = picker_for(plan_for({"alice": [2, 4]}), fallbacks=fallbacks)
    pool = picker.pool
    pool.by_address[ADDRESSES[4]].in_flight = 1
    pool.by_address[ADDRESSES[0]].in_flight = 3
    for a in ADDRESSES[1], ADDRESSES[3], ADDRESSES[5]:
        pool.by_address[a].in_flight = 2
    endpoints = [e.address for e in picker.pick(key("alice")).endpoints]
    assert endpoints[:2] == [ADDRESSES[2], ADDRESSES[4]][: fallbacks + 1]
    assert len(endpoints) == fallbacks + 1
    assert ADDRESSES[0] not in endpoints
    assert len(set(endpoints)) == len(endpoints)


def test_a_new_plan_replaces_the_old_one() -> None:
    picker = picker_for(plan_for({"alice": [0]}))
    picker.install(build_table(plan_for({"alice": [5]}), "v2"))
    assert picker.pick(key("alice")).endpoints[0].address == ADDRESSES[5]
    assert picker.table.version == "v2"


def test_in_flight_totals_follow_readiness_changes() -> None:
    pool = EndpointPool(scraping=True)
    pool.set_static(ADDRESSES[:2])
    a, b = (pool.by_address[x] for x in ADDRESSES[:2])
    pool.record_scrape(a, ok=True, waiting=3)
    pool.record_scrape(b, ok=True, waiting=1)
    pool.acquire(a)
    pool.acquire(a)
    pool.acquire(b)
    assert (pool.in_flight_ready, pool.waiting_ready) == (3, 4)
    pool.record_scrape(a, ok=False)
    assert (pool.in_flight_ready, pool.waiting_ready) == (1, 1)
    pool.release(a)
    pool.record_scrape(a, ok=True, waiting=2)
    assert (pool.in_flight_ready, pool.waiting_ready) == (2, 3)
    assert pool.mean_load() == 2.5
    pool.set_static(ADDRESSES[1:2])
    assert (pool.in_flight_ready, pool.waiting_ready) == (1, 1)


def test_slices_decide_membership_except_for_static_endpoints() -> None:
    pool = EndpointPool(scraping=False)
    pool.set_static([ADDRESSES[0]])
    pool.set_plan_destinations([Destination("pool-1", ADDRESSES[1]), Destination("pool-2")])
    pool.set_slices({
        ADDRESSES[2]: SliceEndpoint(ADDRESSES[2], "pool-2", True),
        ADDRESSES[3]: SliceEndpoint(ADDRESSES[3], "pool-3", False),
    })
    ready = {e.address for e in pool.ready}
    # Static: kept; plan address unknown to the slices: out; address-less destination: found by pod.
    assert ready == {ADDRESSES[0], ADDRESSES[2]}
    assert pool.by_address[ADDRESSES[2]].destination == "pool-2"
    assert pool.resolve(Destination("pool-2")) is pool.by_address[ADDRESSES[2]]
    assert not pool.by_address[ADDRESSES[3]].ready


def test_pods_back_on_new_addresses_are_found_by_name_not_by_the_plans_old_addresses() -> None:
    """The plan was written before the pods moved: pool-0 came back on a new address, pool-1's old
    address now belongs to pool-3, pool-2 is gone. The slices say where each pod is; the plan's
    addresses neither name another pod's endpoint nor leave a phantom to scrape."""
    plan = plan_for({"alice": [0], "bob": [1]})
    picker = picker_for(plan)
    pool = picker.pool
    moved = "10.0.1.1:8000"
    pool.set_slices({
        moved: SliceEndpoint(moved, "pool-0", True),
        ADDRESSES[1]: SliceEndpoint(ADDRESSES[1], "pool-3", True),
        ADDRESSES[4]: SliceEndpoint(ADDRESSES[4], "pool-4", True),
    })
    assert {a: e.destination for a, e in pool.by_address.items()} == {
        moved: "pool-0", ADDRESSES[1]: "pool-3", ADDRESSES[4]: "pool-4",
    }
    alice = picker.pick(key("alice"))
    assert (alice.outcome, alice.endpoints[0].address) == (PLANNED, moved)
    # bob's destination has no pod now: not sent to the pod that took its old address as if planned.
    assert picker.pick(key("bob")).outcome != PLANNED
    # Scaled to zero, the slices list nothing: the plan's old addresses are not endpoints either.
    pool.set_slices({})
    assert pool.by_address == {}


def test_an_unplanned_key_keeps_to_its_two_ring_candidates_on_every_replica() -> None:
    plan = plan_for({"alice": [0]})
    one, two = picker_for(plan, seed=1), picker_for(plan, seed=2)
    first = {one.pick(key("bob")).endpoints[0].address for _ in range(100)}
    assert len(first) == 1  # equal load: always the first candidate
    assert {two.pick(key("bob")).endpoints[0].address for _ in range(100)} == first
    # Make the first candidate the busiest endpoint: the key moves to its second candidate only.
    pool = one.pool
    pool.by_address[first.pop()].in_flight = 9
    moved = Counter(one.pick(key("bob")).endpoints[0].address for _ in range(100))
    assert len(moved) == 1
    assert one.pick(key("bob")).outcome == P2C
    # Many unplanned keys still use every endpoint.
    spread = Counter(two.pick(key(f"user-{i}")).endpoints[0].address for i in range(600))
    assert set(spread) == set(ADDRESSES)
    assert min(spread.values()) > 50


def test_an_unplanned_key_whose_candidates_are_unready_goes_to_plain_p2c() -> None:
    picker = picker_for(plan_for({}))
    pool = picker.pool
    chosen = picker.pick(key("bob")).endpoints[0].address
    pool.by_address[chosen].in_flight = 9
    other = picker.pick(key("bob")).endpoints[0].address
    assert other != chosen
    pool.set_slices({a: SliceEndpoint(a, "", a not in (chosen, other)) for a in ADDRESSES})
    seen = {picker.pick(key("bob")).endpoints[0].address for _ in range(200)}
    assert seen.isdisjoint({chosen, other})
    assert len(seen) > 2


def test_random_p2c_for_unplanned_keys_when_asked() -> None:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, seed=3, unplanned="p2c")
    plan = plan_for({})
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    assert len({picker.pick(key("bob")).endpoints[0].address for _ in range(200)}) == len(ADDRESSES)
    with pytest.raises(ValueError, match="unplanned"):
        Picker(pool, unplanned="sticky")


def test_a_computed_route_keeps_its_ring_pair_and_as_many_planned_destinations_as_it_is_long() -> None:
    """With --widen-planned, computed routes (not pinned) widen to the key's two ring candidates,
    then its planned destinations up to the entry's length: a one-destination key is never pinned
    to one endpoint, a hot key planned on four keeps four candidates."""
    plan = plan_for({"alice": [0], "hot": [0, 1, 2, 3]})
    widened = plan
    pinned_plan = replace(plan, pinned_keys=np.sort(plan.route_keys))
    picker = picker_for(widened, widen=True)
    # Equal load: the key's first ring candidate, on every replica.
    ring_first = picker.pick(key("alice")).endpoints[0]
    assert picker_for(widened, seed=5, widen=True).pick(key("alice")).endpoints[0].address == ring_first.address
    # Load its two ring candidates: it moves between them only, never elsewhere.
    seen = set()
    for _ in range(40):
        decision = picker.pick(key("alice"))
        assert decision.outcome in (PLANNED, SPILLED)
        seen.add(decision.endpoints[0].address)
        picker.pool.acquire(decision.endpoints[0])
    assert len(seen) >= 2
    hot = picker_for(widened, widen=True)
    spread = set()
    for _ in range(40):
        decision = hot.pick(key("hot"))
        spread.add(decision.endpoints[0].address)
        hot.pool.acquire(decision.endpoints[0])
    assert len(spread) == 4
    # The same plan with the routes pinned, or without widening, keeps alice on destination 0 alone.
    for entry_only in (picker_for(pinned_plan, widen=True), picker_for(widened)):
        assert {entry_only.pick(key("alice")).endpoints[0].address for _ in range(20)} == {ADDRESSES[0]}


def test_prompt_tokens_in_flight_count_as_load() -> None:
    """An endpoint prefilling one long prompt loses to one holding a few short requests, when load
    is token-aware; with requests only it would win (fewer in flight)."""
    plan = plan_for({"alice": [0, 1]})
    for tokens_per_unit, expected in ((4096.0, ADDRESSES[1]), (0.0, ADDRESSES[0])):
        pool = EndpointPool(scraping=False)
        picker = Picker(pool, seed=1, tokens_per_unit=tokens_per_unit)
        pool.set_plan_destinations(plan.destinations)
        picker.install(build_table(plan, "v1"))
        pool.acquire(pool.by_address[ADDRESSES[0]], 60_000)
        for _ in range(2):
            pool.acquire(pool.by_address[ADDRESSES[1]], 100 if picker.token_aware else 0)
        assert picker.pick(key("alice")).endpoints[0].address == expected
        assert pool.mean_load() > 0
