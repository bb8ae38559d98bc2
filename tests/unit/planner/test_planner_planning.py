"""Planning one control period: admission, replication, stability, pinned routes, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic
from cacheroute.planner.load import CostModel
from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import decode_plan, encode_plan
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.settings import Budget, Stability
from tests.support.synthetic_stats import SyntheticStatsSpec, synthetic_key_stats

UNIT = CostModel(prefill_s_per_token=1e-3, decode_s_per_token=0.0)


def dests(n: int, kv: int = 100_000, prefix: str = "d") -> list[Destination]:
    return [Destination(f"{prefix}-{i}", f"10.0.0.{i}:8000", 1.0, kv) for i in range(n)]


def stats_of(rows: dict[str, tuple[float, float, float, float]], unkeyed: UnkeyedTraffic | None = None) -> KeyStats:
    names = tuple(rows)
    cols = np.array([rows[n] for n in names], dtype=np.float64).reshape(len(names), 4)
    return KeyStats(names, cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], unkeyed or UnkeyedTraffic())


def routes_by_name(result, stats: KeyStats) -> dict[str, tuple[str, ...]]:
    return {
        n: result.plan.destinations_of(affinity_key_hash(n))
        for n in stats.names
        if result.plan.destinations_of(affinity_key_hash(n))
    }


def test_admission_values_saved_prefill_per_kv_token_not_raw_savings() -> None:
    # long saves 9,000 tokens/s holding 9,000; short saves 2,000 holding 1,000: short is worth more per token.
    stats = stats_of({"long": (1.0, 10_000, 9_000, 10), "short": (2.0, 2_000, 1_000, 10)})
    result = compute_plan(stats, dests(1), pool="p", budget=Budget(warm_tokens_per_destination=9_500))
    assert set(routes_by_name(result, stats)) == {"short"}
    # Ranked by raw savings, long would take this budget alone.
    result = compute_plan(stats, dests(1), pool="p", budget=Budget(warm_tokens_per_destination=9_000))
    assert set(routes_by_name(result, stats)) == {"short"}
    assert float(result.warm_used.sum()) == 1_000
    result = compute_plan(stats, dests(1), pool="p", budget=Budget(warm_tokens_per_destination=10_000))
    assert set(routes_by_name(result, stats)) == {"short", "long"}


def test_keys_without_a_reusable_prefix_are_never_admitted() -> None:
    stats = stats_of({"one-off": (50.0, 4_000, 0, 10), "idle": (0.0, 4_000, 3_000, 10), "ok": (0.1, 100, 50, 1)})
    result = compute_plan(stats, dests(2), pool="p", budget=Budget(warm_tokens_per_destination=10**9))
    assert set(routes_by_name(result, stats)) == {"ok"}


def test_hot_key_is_replicated_so_no_destination_takes_more_than_its_share() -> None:
    # hot: 10 req/s x 200 uncached tokens x 1e-3 s = 2.0 destinations of load.
    stats = stats_of({"hot": (10.0, 1_200, 1_000, 0), "cold": (0.1, 1_200, 1_000, 0)})
    budget = Budget(warm_tokens_per_destination=50_000, max_key_share_of_destination=0.5, max_destinations_per_key=8)
    result = compute_plan(stats, dests(6), pool="p", budget=budget, cost=UNIT)
    routes = routes_by_name(result, stats)
    assert len(routes["hot"]) == 4 == len(set(routes["hot"]))
    assert len(routes["cold"]) == 1
    assert float(result.warm_used.sum()) == 5 * 1_000
    per_replica = result.key_load[stats.names.index("hot")] / 4
    assert per_replica <= 0.5
    # Capped by max destinations per key.
    capped = compute_plan(stats, dests(6), pool="p", budget=Budget(50_000, max_destinations_per_key=2), cost=UNIT)
    assert len(routes_by_name(capped, stats)["hot"]) == 2


def test_pinned_routes_come_first_and_consume_budget() -> None:
    stats = stats_of({"a": (5.0, 2_000, 1_500, 10), "b": (4.0, 2_000, 1_500, 10), "c": (3.0, 2_000, 1_500, 10)})
    pinned = {"c": ["d-1", "d-0"], "not-in-stats": ["d-1"]}
    budget = Budget(warm_tokens_per_destination=3_000, max_destinations_per_key=2)
    result = compute_plan(stats, dests(2), pool="p", budget=budget, pinned=pinned)
    routes = routes_by_name(result, stats)
    assert routes["c"] == ("d-1", "d-0")
    assert result.plan.destinations_of(affinity_key_hash("not-in-stats")) == ("d-1",)
    # c holds 1,500 on each destination, so one more 1,500-token prefix fits per destination.
    assert set(routes) == {"a", "b", "c"}
    assert result.warm_used.tolist() == [3_000, 3_000]
    assert result.plan.summary.admitted_keys == 4


def test_identical_input_gives_identical_plan_bytes() -> None:
    stats = synthetic_key_stats(SyntheticStatsSpec(keys=5_000, seed=7))
    a = compute_plan(stats, dests(8, 200_000), pool="p", generated_at="t0")
    b = compute_plan(stats, dests(8, 200_000), pool="p", generated_at="t1")
    pa, pb = encode_plan(a.plan), encode_plan(b.plan)
    assert pa.version == pb.version
    assert {k: v for k, v in pa.files.items() if k != "plan.json.gz"} == {
        k: v for k, v in pb.files.items() if k != "plan.json.gz"
    }
    c = compute_plan(stats, dests(8, 200_000), pool="p", generated_at="t0")
    assert encode_plan(c.plan).files == pa.files


def test_replanning_the_same_traffic_changes_nothing() -> None:
    stats = synthetic_key_stats(SyntheticStatsSpec(keys=3_000, seed=1))
    first = compute_plan(stats, dests(10, 150_000), pool="p")
    again = compute_plan(stats, dests(10, 150_000), pool="p", previous=first.plan)
    assert again.churn == 0.0
    assert again.plan.routes() == first.plan.routes()
    assert encode_plan(again.plan).files["routes-0000.bin.gz"] == encode_plan(first.plan).files["routes-0000.bin.gz"]


def test_small_drift_keeps_the_previous_placement() -> None:
    stats = synthetic_key_stats(SyntheticStatsSpec(keys=3_000, seed=1))
    first = compute_plan(stats, dests(10, 150_000), pool="p")
    rng = np.random.default_rng(0)
    drift = KeyStats(
        stats.names,
        stats.rate * rng.uniform(0.99, 1.01, len(stats)),
        stats.prompt_tokens,
        stats.prefix_tokens,
        stats.output_tokens,
        stats.unkeyed,
    )
    second = compute_plan(drift, dests(10, 150_000), pool="p", previous=first.plan)
    assert second.kept_previous
    assert second.churn_voluntary == 0.0
    assert "kept previous placement" in second.reason
    before = routes_by_name(first, stats)
    after = routes_by_name(second, drift)
    common = set(before) & set(after)
    assert len(common) >= 0.95 * len(before)
    assert all(before[k] == after[k] for k in common)


def test_vanished_destination_forces_moves_that_are_reported_but_not_capped() -> None:
    stats = synthetic_key_stats(SyntheticStatsSpec(keys=3_000, seed=2))
    first = compute_plan(stats, dests(10, 150_000), pool="p")
    survivors = dests(10, 150_000)[:9]
    stab = Stability(max_churn=0.0, min_gain=0.02)
    second = compute_plan(stats, survivors, pool="p", previous=first.plan, stability=stab)
    before = routes_by_name(first, stats)
    lost = {k for k, v in before.items() if "d-9" in v}
    assert lost
    after = routes_by_name(second, stats)
    assert all("d-9" not in v for v in after.values())
    # Keys that did not lose their destination stay where they were.
    for k in set(before) & set(after) - lost:
        assert after[k] == before[k]
    assert second.churn_forced > 0
    assert second.churn_voluntary == 0.0
    assert second.churn == pytest.approx(second.churn_forced)
    assert second.plan.summary.churn == pytest.approx(second.churn)


def test_scale_out_rebalances_within_the_churn_cap() -> None:
    stats = synthetic_key_stats(SyntheticStatsSpec(keys=3_000, seed=3, unkeyed_share=0.0, zero_prefix_share=0.0))
    budget = Budget(warm_tokens_per_destination=10**8)
    cost = CostModel(prefill_s_per_token=1e-4, decode_s_per_token=1e-3)
    first = compute_plan(stats, dests(4, 0), pool="p", budget=budget, cost=cost)
    assert first.plan.summary.admitted_keys > 2_500
    stuck = compute_plan(
        stats, dests(8, 0), pool="p", budget=budget, cost=cost, previous=first.plan, stability=Stability(0.0, 0.02)
    )
    assert stuck.kept_previous and stuck.churn == 0.0
    moved = compute_plan(
        stats, dests(8, 0), pool="p", budget=budget, cost=cost, previous=first.plan, stability=Stability(0.1, 0.02)
    )
    assert not moved.kept_previous
    assert 0 < moved.churn_voluntary <= 0.1
    assert moved.churn_forced == 0.0
    assert moved.objective < stuck.objective * 0.98
    assert "re-balanced" in moved.reason


def test_incumbents_near_the_cut_keep_their_slot() -> None:
    stats = stats_of({"old": (1.00, 2_000, 1_000, 10), "new": (1.01, 2_000, 1_000, 10)})
    d = dests(1)
    previous = plan_from_routes("p", d, {affinity_key_hash("old"): ["d-0"]})
    budget = Budget(warm_tokens_per_destination=1_000)
    kept = compute_plan(stats, d, pool="p", budget=budget, previous=previous, stability=Stability(0.1, 0.02))
    assert set(routes_by_name(kept, stats)) == {"old"}
    fresh = compute_plan(stats, d, pool="p", budget=budget, previous=previous, stability=Stability(0.1, 0.0))
    assert set(routes_by_name(fresh, stats)) == {"new"}


def test_summary_figures_and_round_trip() -> None:
    stats = stats_of(
        {"a": (2.0, 1_000, 800, 10), "b": (1.0, 3_000, 0, 10)},
        UnkeyedTraffic(rate=1.0, prompt_tokens=2_000, output_tokens=10),
    )
    result = compute_plan(stats, dests(2), pool="p", budget=Budget(10_000), generated_at="2026-01-01T00:00:00Z")
    s = result.plan.summary
    assert s.admitted_keys == 1
    assert s.admitted_request_share == pytest.approx(2.0 / 4.0)
    assert s.admitted_token_share == pytest.approx(2_000 / (2_000 + 3_000 + 2_000))
    assert s.predicted_kv_hit == pytest.approx(1_600 / 7_000)
    assert set(s.predicted_load) == {"d-0", "d-1"}
    assert result.lower_bound <= result.objective + 1e-12
    back = decode_plan(encode_plan(result.plan).files)
    assert back.routes() == result.plan.routes()
    assert back.summary == s
    assert back.generated_at == "2026-01-01T00:00:00Z"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no destinations", "destinations is empty"),
        ("duplicate destination", r"destinations\[1\].id 'd-0' appears more than once"),
        ("zero weight", r"destinations\[0\] \(d-0\) weight is 0.0"),
        ("negative capacity", r"kv_capacity_tokens is -5"),
        ("unknown pinned destination", r"pinned\['a'\] names destination 'd-7', which is not in the pool"),
        ("pinned without destinations", r"pinned\['a'\] must list at least one destination"),
        ("pinned twice the same", r"pinned\['a'\] lists a destination twice"),
        ("pinned over the cap", r"pinned\['a'\] lists 3 destinations, more than budget.max_destinations_per_key=2"),
        ("no pool", "pool is ''"),
        ("foreign previous plan", "previous plan belongs to pool 'other'"),
        ("bad spill", "spill_threshold is nan"),
    ],
)
def test_bad_planning_input_raises_one_error_type_naming_the_field(case: str, message: str) -> None:
    stats = stats_of({"a": (1.0, 100, 50, 1)})
    d = dests(3)
    kwargs: dict[str, object] = {"pool": "p", "budget": Budget(1000, max_destinations_per_key=2)}
    if case == "no destinations":
        d = []
    elif case == "duplicate destination":
        d = [d[0], d[0]]
    elif case == "zero weight":
        d = [Destination("d-0", weight=0.0)]
    elif case == "negative capacity":
        d = [Destination("d-0", kv_capacity_tokens=-5)]
    elif case == "unknown pinned destination":
        kwargs["pinned"] = {"a": ["d-7"]}
    elif case == "pinned without destinations":
        kwargs["pinned"] = {"a": []}
    elif case == "pinned twice the same":
        kwargs["pinned"] = {"a": ["d-1", "d-1"]}
    elif case == "pinned over the cap":
        kwargs["pinned"] = {"a": ["d-0", "d-1", "d-2"]}
    elif case == "no pool":
        kwargs["pool"] = ""
    elif case == "foreign previous plan":
        kwargs["previous"] = plan_from_routes("other", d, {})
    elif case == "bad spill":
        kwargs["spill_threshold"] = float("nan")
    with pytest.raises(PlanInputError, match=message):
        compute_plan(stats, d, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Budget(warm_tokens_per_destination=-1), "warm_tokens_per_destination must be an integer >= 0"),
        (lambda: Budget(warm_tokens_per_destination="lots"), "or 'auto', got 'lots'"),  # type: ignore[arg-type]
        (lambda: Budget(max_destinations_per_key=0), "max_destinations_per_key must be an integer in"),
        (lambda: Budget(max_key_share_of_destination=0.0), "max_key_share_of_destination must be in"),
        (lambda: Budget(auto_fraction=float("nan")), "auto_fraction must be in"),
        (lambda: Stability(max_churn=1.5), "max_churn must be in"),
        (lambda: Stability(min_gain=-0.1), "min_gain must be in"),
        (lambda: CostModel(prefill_s_per_token=-1.0), "cost.prefill_s_per_token is -1.0"),
        (lambda: CostModel(0.0, 0.0, 0.0), "all zeros"),
    ],
)
def test_bad_settings_are_refused(make, message: str) -> None:
    with pytest.raises(PlanInputError, match=message):
        make()


def test_nothing_to_plan_gives_an_empty_plan_with_its_reason() -> None:
    none = np.zeros(0)
    empty = KeyStats((), none, none, none, none, UnkeyedTraffic(rate=3.0, prompt_tokens=100, output_tokens=10))
    result = compute_plan(empty, dests(2), pool="p")
    assert len(result.plan) == 0
    assert "no keyed traffic" in result.plan.summary.reason
    stats = stats_of({"a": (1.0, 100, 50, 1)})
    zero = compute_plan(stats, dests(2, kv=0), pool="p")
    assert len(zero.plan) == 0
    assert "warm budget is zero" in zero.reason
    zero_fixed = compute_plan(stats, dests(2), pool="p", budget=Budget(warm_tokens_per_destination=0))
    assert len(zero_fixed.plan) == 0
    # Pinned routes survive a zero budget.
    pinned = compute_plan(stats, dests(2, kv=0), pool="p", pinned={"a": ["d-1"]})
    assert pinned.plan.routes() == {affinity_key_hash("a"): ("d-1",)}
