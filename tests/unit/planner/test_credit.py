"""How firmly a plan keeps keys on their entries: from how long a prefix lives in the fleet's caches."""

from __future__ import annotations

import numpy as np
import pytest

from cacheroute.planner.credit import MIN_ENTRY_CREDIT, cache_lifetime_s, entry_credit, held_share
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic
from cacheroute.planner.plan import Destination
from cacheroute.planner.planning import compute_plan


def stats_of(keys: int, qps: float, prompt: float = 4_500.0, prefix: float = 2_000.0,
             unkeyed: UnkeyedTraffic | None = None) -> KeyStats:
    ones = np.ones(keys)
    return KeyStats(names=tuple(f"k{i}" for i in range(keys)), rate=qps / keys * ones, prompt_tokens=prompt * ones,
                    prefix_tokens=prefix * ones, output_tokens=50 * ones, unkeyed=unkeyed or UnkeyedTraffic())


def fleet(n: int, kv: int, host: int = 0) -> list[Destination]:
    return [Destination(f"d{i}", kv_capacity_tokens=kv, host_kv_capacity_tokens=host) for i in range(n)]


def every(stats: KeyStats) -> np.ndarray:
    return np.ones(len(stats), dtype=bool)


def test_a_prefix_lives_as_long_as_the_caches_take_to_fill_with_what_the_traffic_writes() -> None:
    # 10 requests/s, each writing 2,500 prompt tokens past its prefix and 50 of output: 25,500 tokens/s.
    s = stats_of(100, 10.0)
    assert cache_lifetime_s(s, fleet(4, 255_000)) == pytest.approx(40.0)
    assert cache_lifetime_s(s, fleet(4, 127_500, host=127_500)) == pytest.approx(40.0)
    # Requests without a key write their whole prompt and output.
    busy = stats_of(100, 10.0, unkeyed=UnkeyedTraffic(rate=5.0, prompt_tokens=5_050.0, output_tokens=50.0))
    assert cache_lifetime_s(busy, fleet(4, 255_000)) == pytest.approx(20.0)


def test_entries_hold_for_keys_that_come_back_before_eviction_only_when_kept_in_one_place() -> None:
    fleet4 = fleet(4, 255_000)  # a prefix lives 40 s at 10 requests/s
    # 200 keys each back every 20 s: cached on one destination, evicted between visits spread over four.
    held = stats_of(200, 10.0)
    assert held_share(held, fleet4, every(held)) == 1.0
    assert entry_credit(held, fleet4, every(held)) == 1.0
    # 20 keys back every 2 s are cached wherever they go; 1,000 keys back every 100 s nowhere.
    for keys in (20, 1_000):
        s = stats_of(keys, 10.0)
        assert held_share(s, fleet4, every(s)) == 0.0
        assert entry_credit(s, fleet4, every(s)) == MIN_ENTRY_CREDIT
    # A prefix that is most of the prompt is followed to where it went, entry or not.
    short, long = stats_of(200, 10.0, prefix=2_200.0), stats_of(200, 10.0, prefix=2_300.0)
    assert entry_credit(short, fleet4, every(short)) == 1.0
    assert entry_credit(long, fleet4, every(long)) == MIN_ENTRY_CREDIT
    # An unknown KV size shows nothing: the entries hold.
    assert entry_credit(stats_of(20, 10.0), fleet(4, 0), every(held)) == 1.0


def test_only_the_admitted_keys_savings_decide() -> None:
    # Half the traffic from 10 hot keys cached anywhere, half from 100 keys needing their entries.
    hot, warm = stats_of(10, 5.0), stats_of(100, 5.0)
    s = KeyStats(names=hot.names + tuple(f"w{i}" for i in range(100)), rate=np.r_[hot.rate, warm.rate],
                 prompt_tokens=np.r_[hot.prompt_tokens, warm.prompt_tokens],
                 prefix_tokens=np.r_[hot.prefix_tokens, warm.prefix_tokens],
                 output_tokens=np.r_[hot.output_tokens, warm.output_tokens])
    fleet4 = fleet(4, 255_000)
    assert held_share(s, fleet4, every(s)) == pytest.approx(0.5)
    only_hot = np.r_[np.ones(10, dtype=bool), np.zeros(100, dtype=bool)]
    assert entry_credit(s, fleet4, only_hot) == MIN_ENTRY_CREDIT
    assert entry_credit(s, fleet4, ~only_hot) == 1.0


def test_the_planner_puts_the_credit_in_the_plan_and_says_why() -> None:
    fleet4 = fleet(4, 255_000)
    held = compute_plan(stats_of(200, 10.0), fleet4, pool="p").plan
    anywhere = compute_plan(stats_of(20, 10.0), fleet4, pool="p").plan
    assert len(held) and len(anywhere)
    assert held.entry_credit == 1.0
    assert "credited" not in held.summary.reason
    assert anywhere.entry_credit == MIN_ENTRY_CREDIT
    assert "entries credited with 0.25" in anywhere.summary.reason
    assert compute_plan(stats_of(20, 10.0), fleet4, pool="p", credit=1.0).plan.entry_credit == 1.0
