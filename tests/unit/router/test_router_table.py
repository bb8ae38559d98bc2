"""The picker's routing table holds exactly the plan's routes."""

from __future__ import annotations

import numpy as np

from cacheroute.planner.plan import Destination, Plan
from cacheroute.planner.plan_format import decode_plan, encode_plan
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.table import build_table, resolve_groups


def random_plan(n: int, destinations: int, seed: int) -> Plan:
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 2**64 - 1, n, dtype=np.uint64))
    counts = rng.choice([1, 1, 1, 2, 3, 4, 6], len(keys))
    offsets = np.zeros(len(keys) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    dests = np.concatenate([rng.permutation(destinations)[:c] for c in counts]).astype(np.uint16)
    return Plan(
        "pool",
        tuple(Destination(f"pool-{i}", f"10.1.{i // 250}.{i % 250}:8000") for i in range(destinations)),
        keys,
        offsets,
        dests,
    )


def test_table_matches_the_plan_routes() -> None:
    plan = decode_plan(encode_plan(random_plan(5000, 40, seed=7)).files)
    table = build_table(plan, "v")
    expected = plan.routes()
    assert len(table) == len(expected)
    ids = [d.id for d in plan.destinations]
    for key, dest_ids in expected.items():
        assert tuple(ids[i] for i in table.groups[table.routes[key]]) == dest_ids
    # Keys with the same destination list share a group.
    assert len(table.groups) == len(set(expected.values()))


def test_groups_resolve_to_known_endpoints_in_plan_order() -> None:
    plan = random_plan(300, 8, seed=3)
    pool = EndpointPool(scraping=False)
    # Only half the destinations have a known address.
    pool.set_static([d.address for d in plan.destinations[:4]])
    table = build_table(plan, "v")
    groups = resolve_groups(table, pool)
    for group, endpoints in zip(table.groups, groups, strict=True):
        assert [e.address for e in endpoints] == [
            plan.destinations[i].address for i in group if i < 4
        ]


def test_empty_plan() -> None:
    plan = Plan("pool", (), np.zeros(0, np.uint64), np.zeros(1, np.int64), np.zeros(0, np.uint16))
    table = build_table(plan, "v")
    assert len(table) == 0
    assert table.groups == ()
