"""Key-seeded p2c candidates: spread, stable under membership changes, the same everywhere."""

from __future__ import annotations

from collections import Counter

import pytest

from cacheroute.planner.keyring import KeyRing
from cacheroute.planner.plan import affinity_key_hash

KEYS = [affinity_key_hash(f"key-{i}") for i in range(30_000)]


def test_candidates_are_two_distinct_members_spread_evenly() -> None:
    ring = KeyRing([f"pool-{i}" for i in range(10)])
    firsts: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    for h in KEYS:
        a, b = ring.pair(h)
        assert a != b
        firsts[a] += 1
        seconds[b] += 1
    expected = len(KEYS) / 10
    # 64 points per member: each member's share stays within about a quarter of the mean.
    assert max(abs(c - expected) for c in firsts.values()) < 0.3 * expected
    assert max(abs(c - expected) for c in seconds.values()) < 0.3 * expected


def test_removing_a_member_moves_only_the_keys_that_had_it_as_a_candidate() -> None:
    members = [f"pool-{i}" for i in range(10)]
    before = KeyRing(members)
    after = KeyRing([m for m in members if m != "pool-3"])
    moved = 0
    for h in KEYS:
        old = {before.members[i] for i in before.pair(h)}
        new = {after.members[i] for i in after.pair(h)}
        if "pool-3" not in old:
            assert new == old
        else:
            moved += 1
            assert old - {"pool-3"} <= new
    assert moved < 0.3 * len(KEYS)


def test_the_pair_depends_on_members_not_on_their_order() -> None:
    members = [f"pool-{i}" for i in range(7)]
    a, b = KeyRing(members), KeyRing(list(reversed(members)))
    for h in KEYS[:2000]:
        assert [a.members[i] for i in a.pair(h)] == [b.members[i] for i in b.pair(h)]


def test_a_single_member_is_both_candidates_and_bad_rings_are_refused() -> None:
    assert KeyRing(["only"]).pair(123) == (0, 0)
    with pytest.raises(ValueError, match="distinct"):
        KeyRing(["a", "a"])
    with pytest.raises(ValueError, match="no members"):
        KeyRing([]).pair(1)
    with pytest.raises(ValueError, match="at least 1"):
        KeyRing(["a"], points=0)
