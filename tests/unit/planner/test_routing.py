"""The routing rule on its own: destinations are names, load is a table."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from cacheroute.planner.keyring import KeyRing
from cacheroute.planner.routing import (
    DEFAULT_FOLLOW_RATIO,
    DEFAULT_FOLLOW_SLACK,
    DEFAULT_SPILL_SLACK,
    DEFAULT_SPILL_THRESHOLD,
    FOLLOWED,
    KEY_P2C,
    P2C,
    PLANNED,
    SCORED,
    SPILLED,
    RoutingRule,
    check_follow,
    check_spill,
    key_candidates,
    ring_candidates,
)

NAMES = ["a", "b", "c", "d", "e", "f"]


class TableLoads:
    def __init__(self, loads: dict[str, float]) -> None:
        self.loads = loads

    def load(self, destination: str, /) -> float:
        return self.loads[destination]

    def mean(self) -> float:
        return sum(self.loads.values()) / len(self.loads)


def rule_for(
    loads: dict[str, float], *, seed: int = 1, key_seeded: bool = False, **settings: float | bool
) -> RoutingRule[str]:
    candidates = ring_candidates(KeyRing(NAMES), NAMES) if key_seeded else None
    return RoutingRule(TableLoads(loads), random.Random(seed).random, key_candidates=candidates, **settings)  # type: ignore[arg-type]


def idle() -> dict[str, float]:
    return dict.fromkeys(NAMES, 0.0)


def test_the_defaults_are_the_documented_bounds() -> None:
    rule = rule_for(idle())
    assert (rule.spill_threshold, rule.spill_slack) == (DEFAULT_SPILL_THRESHOLD, DEFAULT_SPILL_SLACK) == (1.5, 2.0)
    assert (rule.follow_ratio, rule.follow_slack) == (DEFAULT_FOLLOW_RATIO, DEFAULT_FOLLOW_SLACK) == (1.5, 2.0)


def test_a_planned_key_goes_to_its_least_loaded_destination() -> None:
    loads = idle() | {"b": 3, "c": 1, "e": 2}
    assert rule_for(loads).choose(7, ["b", "c", "e"], NAMES) == (PLANNED, "c")


def test_ties_go_to_the_first_destination_at_or_after_the_key_hash() -> None:
    rule = rule_for(idle())
    entry = ["b", "c", "e"]
    assert [rule.least_loaded(entry, h, None) for h in range(6)] == ["b", "c", "e", "b", "c", "e"]


def test_unusable_planned_destinations_are_skipped_and_none_left_spills() -> None:
    rule = rule_for(idle() | {"c": 1})
    assert rule.least_loaded(["b", "c"], 0, lambda d: d != "b") == "c"
    assert rule.least_loaded(["b"], 0, lambda d: d != "b") is None
    outcome, chosen = rule.choose(0, ["b"], ["a", "c"], lambda d: d != "b")
    assert outcome == SPILLED
    assert chosen in {"a", "c"}


def test_bounded_affinity_spills_above_threshold_times_mean_plus_slack() -> None:
    # Mean 2 over six destinations: the bound is 1.5 x 2 + 2 = 5.
    at_bound = idle() | {"a": 5, "b": 7}
    assert rule_for(at_bound).choose(0, ["a"], NAMES) == (PLANNED, "a")
    above = idle() | {"a": 6, "b": 6}
    rule = rule_for(above)
    assert rule.overloaded("a")
    spilled = {rule.choose(0, ["a"], NAMES) for _ in range(200)}
    assert {outcome for outcome, _ in spilled} == {SPILLED}
    assert "a" not in {d for _, d in spilled}
    # The bound follows the settings: a laxer threshold keeps the key.
    assert rule_for(above, spill_threshold=3.0).choose(0, ["a"], NAMES) == (PLANNED, "a")


def test_an_overloaded_destination_keeps_the_key_when_it_is_the_only_usable_one() -> None:
    assert rule_for(idle() | {"a": 50}).choose(0, ["a"], ["a"]) == (PLANNED, "a")


def test_an_unplanned_key_uses_the_less_loaded_of_its_two_ring_candidates() -> None:
    key = 12345
    first, second = ring_candidates(KeyRing(NAMES), NAMES)(key)
    assert first != second
    assert rule_for(idle(), key_seeded=True).choose(key, None, NAMES) == (KEY_P2C, first)  # tie: the first
    busy = idle() | {first: 3.0, second: 1.0}
    # Every other destination is idle, yet only the two candidates are compared.
    assert rule_for(busy, key_seeded=True).choose(key, None, NAMES) == (KEY_P2C, second)


def test_unusable_ring_candidates_are_skipped_then_plain_p2c_takes_over() -> None:
    key = 999
    first, second = ring_candidates(KeyRing(NAMES), NAMES)(key)
    rule = rule_for(idle() | {second: 9.0}, key_seeded=True)
    assert rule.choose(key, None, NAMES, lambda d: d != first) == (KEY_P2C, second)
    others = [d for d in NAMES if d not in (first, second)]
    seen = {rule.choose(key, None, others, lambda d: d in others)[1] for _ in range(300)}
    assert seen == set(others)


def test_without_key_seeding_unplanned_and_keyless_requests_take_plain_p2c() -> None:
    rule = rule_for(idle())
    assert Counter(rule.choose(5, None, NAMES)[0] for _ in range(50)) == {P2C: 50}
    picks = Counter(rule.choose(None, None, NAMES)[1] for _ in range(600))
    assert set(picks) == set(NAMES)


def test_p2c_prefers_the_lighter_of_two_draws_and_never_the_excluded() -> None:
    loads = {"a": 0.0, "b": 10.0, "c": 20.0, "d": 30.0}
    rule = rule_for(loads)
    picks = Counter(rule.p2c(list(loads)) for _ in range(3000))
    assert picks["d"] == 0
    # "a" is in half of the six pairs and wins them all.
    assert picks["a"] / 3000 == pytest.approx(0.5, abs=0.05)
    assert "a" not in {rule.p2c(list(loads), exclude="a") for _ in range(300)}
    assert rule.p2c(["a", "b"], exclude="a") == "b"


@pytest.mark.parametrize(("threshold", "slack"), [(0.0, 2.0), (-1.0, 2.0), (1.5, -0.5), (float("nan"), 1.0)])
def test_spill_settings_out_of_range_are_refused(threshold: float, slack: float) -> None:
    with pytest.raises(ValueError, match="spill"):
        check_spill(threshold, slack)
    check_spill(1.0, 0.0)


def test_memoised_ring_candidates_equal_the_ring_s_own() -> None:
    ring = KeyRing(NAMES)
    plain, memo = ring_candidates(ring, NAMES), ring_candidates(ring, NAMES, memo=True)
    for key in range(0, 10**6, 9973):
        assert plain(key) == memo(key) == memo(key) == tuple(NAMES[i] for i in ring.pair(key))


def test_a_planned_key_keeps_its_ring_pair_and_takes_as_many_planned_destinations_as_its_entry_is_long() -> None:
    key = 4242
    first, second = ring_candidates(KeyRing(NAMES), NAMES)(key)
    others = [d for d in NAMES if d not in (first, second)]
    # One planned destination: the key is not pinned, it keeps its two ring candidates.
    assert list(key_candidates([others[0]], (first, second))) == [first, second]
    # Three: the ring pair and the first planned destination not in it.
    assert list(key_candidates([first, others[0], others[1]], (first, second))) == [first, second, others[0]]
    assert list(key_candidates(others, (first, second))) == [first, second, *others[:2]]
    # A planned destination that is idle is taken over a loaded ring candidate when it is a candidate.
    loads = idle() | {first: 4.0, second: 4.0}
    rule = rule_for(loads, key_seeded=True, widen_planned=True)
    assert rule.choose(key, [first, others[0], others[1]], NAMES) == (PLANNED, others[0])
    # A one-destination entry: the pair decides, the planned destination is not used.
    assert rule.choose(key, [others[0]], NAMES)[1] in (first, second)


def test_a_pinned_rule_keeps_planned_keys_to_their_entry() -> None:
    key = 4242
    first, second = ring_candidates(KeyRing(NAMES), NAMES)(key)
    other = next(d for d in NAMES if d not in (first, second))
    rule = rule_for(idle(), key_seeded=True, widen_planned=False)
    assert rule.choose(key, [other], NAMES) == (PLANNED, other)


def test_a_request_follows_its_prefix_within_the_load_bound() -> None:
    key = 77
    first, second = ring_candidates(KeyRing(NAMES), NAMES)(key)
    held = next(d for d in NAMES if d not in (first, second))
    # The key's pair is idle; the destination holding the prefix carries 2: 2 <= 1.5 x 0 + 2.
    rule = rule_for(idle() | {held: 2.0}, key_seeded=True)
    assert rule.choose(key, None, NAMES, follow=held) == (FOLLOWED, held)
    # Above the bound the request stays with the rule's own choice...
    rule = rule_for(idle() | {held: 2.5}, key_seeded=True)
    assert rule.choose(key, None, NAMES, follow=held) == (KEY_P2C, first)
    # ...unless what it saves there (its prefix, in load units) covers the difference.
    assert rule.choose(key, None, NAMES, follow=held, follow_gain=0.5) == (FOLLOWED, held)
    # The bound grows with the load of the alternative: 1.5 x 4 + 2 = 8.
    rule = rule_for(idle() | {first: 4.0, second: 4.0, held: 8.0}, key_seeded=True)
    assert rule.choose(key, None, NAMES, follow=held) == (FOLLOWED, held)
    # An unusable or switched-off follow target is ignored.
    assert rule.choose(key, None, NAMES, lambda d: d != held, follow=held)[0] == KEY_P2C
    assert rule_for(idle(), key_seeded=True, follow_ratio=0.0).choose(key, None, NAMES, follow=held)[0] == KEY_P2C
    # Following the destination the rule picked anyway is no follow.
    assert rule_for(idle(), key_seeded=True).choose(key, None, NAMES, follow=first) == (KEY_P2C, first)


def test_an_unplanned_request_goes_where_a_prefix_of_it_is_held_as_far_as_load_allows() -> None:
    key = 77
    first, second = ring_candidates(KeyRing(NAMES), NAMES)(key)
    holder, light, heavy, *_ = (d for d in NAMES if d not in (first, second))
    # Equal loads: a tenth of the prompt held (3 x 0.1) decides.
    rule = rule_for(dict.fromkeys(NAMES, 1.0), key_seeded=True)
    assert rule.choose(key, None, NAMES, held={holder: 100}, prompt_tokens=1000) == (SCORED, holder)
    # The most loaded, the holder loses: 3 x 0.1 against the others' 2 x 1.
    rule = rule_for(idle() | {holder: 4.0}, key_seeded=True)
    outcome, chosen = rule.choose(key, None, NAMES, held={holder: 100}, prompt_tokens=1000)
    assert outcome == SCORED
    assert chosen != holder
    # Half the load spread above the least loaded: 3 x 0.4 + 2 x 0.5 = 2.2 beats 2 x 1 = 2...
    rule = rule_for(dict.fromkeys(NAMES, 2.0) | {light: 1.0, heavy: 3.0}, key_seeded=True)
    assert rule.choose(key, None, NAMES, held={holder: 400}, prompt_tokens=1000) == (SCORED, holder)
    # ...and 3 x 0.3 + 1 = 1.9 does not.
    assert rule.choose(key, None, NAMES, held={holder: 300}, prompt_tokens=1000) == (SCORED, light)


def test_a_scored_request_with_nothing_to_tell_apart_goes_to_its_first_ring_candidate() -> None:
    # Nothing held and every load equal: the key keeps the affinity key-seeded p2c would give it.
    for key in range(40):
        first, _ = ring_candidates(KeyRing(NAMES), NAMES)(key)
        assert rule_for(idle(), key_seeded=True).choose(key, None, NAMES, held={}, prompt_tokens=500) == (SCORED, first)
    # Unusable destinations are never scored, however much they hold.
    first, second = ring_candidates(KeyRing(NAMES), NAMES)(5)
    usable = [d for d in NAMES if d != first]
    rule = rule_for(idle(), key_seeded=True)
    assert rule.choose(5, None, usable, lambda d: d != first, held={first: 400}, prompt_tokens=500) == (SCORED, second)


def test_keyless_requests_with_nothing_to_tell_apart_spread_like_p2c() -> None:
    rule = rule_for(idle(), key_seeded=True)
    went = Counter(rule.choose(None, None, NAMES, held={}, prompt_tokens=100) for _ in range(600))
    assert set(went) == {(SCORED, d) for d in NAMES}
    assert min(went.values()) > 60  # 100 expected each
    # What one destination holds still draws them while loads are equal.
    assert rule.choose(None, None, NAMES, held={"d": 50}, prompt_tokens=100) == (SCORED, "d")


def test_only_unplanned_requests_without_a_prefix_to_follow_are_scored() -> None:
    key = 77
    first, second = ring_candidates(KeyRing(NAMES), NAMES)(key)
    holder = next(d for d in NAMES if d not in (first, second))
    seeded = rule_for(idle(), key_seeded=True)
    # A planned key keeps its plan; a request with a prefix worth following follows it.
    assert seeded.choose(key, [second], NAMES, held={holder: 400}, prompt_tokens=500) == (PLANNED, second)
    assert seeded.choose(key, None, NAMES, follow=holder, held={holder: 400}, prompt_tokens=500) == (FOLLOWED, holder)
    # Without `held` (no memory of routed prefixes) the key takes key-seeded p2c.
    assert seeded.choose(key, None, NAMES) == (KEY_P2C, first)
    # Plain p2c for unplanned keys (the report's routing) does not score.
    outcome, _ = rule_for(idle()).choose(key, None, NAMES, held={holder: 400}, prompt_tokens=500)
    assert outcome == P2C


@pytest.mark.parametrize(("ratio", "slack"), [(-0.1, 2.0), (1.5, -1.0), (float("nan"), 1.0)])
def test_follow_settings_out_of_range_are_refused(ratio: float, slack: float) -> None:
    with pytest.raises(ValueError, match="follow"):
        check_follow(ratio, slack)
    check_follow(0.0, 0.0)


def test_a_credited_plan_entry_yields_its_request_only_to_a_clearly_less_loaded_destination() -> None:
    key = 77
    entry = "c"
    # A quarter of the prompt credited to the entry: 3 x 0.25 = 0.75 of score. Loads 0-4: the entry
    # at the top of the span scores 0.75, an idle destination 2: the request leaves.
    busy = idle() | {entry: 4.0}
    outcome, chosen = rule_for(busy, key_seeded=True, entry_credit=0.25).choose(
        key, [entry], NAMES, held={}, prompt_tokens=1000)
    assert outcome == SCORED
    assert chosen != entry
    # A quarter of the span above the least loaded (0.75 + 2 x 0.75 = 2.25 against 2): it stays.
    near = dict.fromkeys(NAMES, 4.0) | {entry: 1.0, "a": 0.0}
    assert rule_for(near, key_seeded=True, entry_credit=0.25).choose(
        key, [entry], NAMES, held={}, prompt_tokens=1000) == (PLANNED, entry)
    # Equal loads: the entry, not the key's ring candidates.
    assert rule_for(idle(), key_seeded=True, entry_credit=0.25).choose(
        key, [entry], NAMES, held={}, prompt_tokens=1000) == (PLANNED, entry)
    # What a destination is remembered to hold counts beyond the credit.
    assert rule_for(idle(), key_seeded=True, entry_credit=0.25).choose(
        key, [entry], NAMES, held={"e": 400}, prompt_tokens=1000) == (SCORED, "e")


def test_a_credit_of_one_a_pinned_route_or_no_prefix_memory_keep_bounded_affinity() -> None:
    key = 77
    busy = idle() | {"c": 1.5}
    # Under the spill bound (1.5 x 0.25 + 2) the entry keeps the request, whatever the others' loads.
    assert rule_for(busy, key_seeded=True).choose(key, ["c"], NAMES, held={}, prompt_tokens=1000) == (PLANNED, "c")
    assert rule_for(busy, key_seeded=True, entry_credit=0.25).choose(
        key, ["c"], NAMES, held={}, prompt_tokens=1000, pinned=True) == (PLANNED, "c")
    assert rule_for(busy, key_seeded=True, entry_credit=0.25).choose(key, ["c"], NAMES) == (PLANNED, "c")
    # A prefix worth following is followed from the entry, as before.
    assert rule_for(idle(), key_seeded=True, entry_credit=0.25).choose(
        key, ["c"], NAMES, follow="e", held={}, prompt_tokens=1000) == (FOLLOWED, "e")
