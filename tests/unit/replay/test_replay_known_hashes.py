"""The guard replays statistics whose keys are known only by hash (as the router exports them)."""

from __future__ import annotations

import numpy as np

from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.plan import Destination
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.replay.planned import Planned
from cacheroute.planner.replay.run import ReplayConfig, replay_trace
from cacheroute.planner.replay.window import window_from_stats


def hashed_stats(n: int = 20) -> KeyStats:
    hashes = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return KeyStats(
        names=tuple(f"{int(h):016x}" for h in hashes),
        rate=np.full(n, 0.2),
        prompt_tokens=np.full(n, 2000.0),
        prefix_tokens=np.full(n, 1800.0),
        output_tokens=np.full(n, 100.0),
        key_hashes=hashes,
    )


def test_the_replay_window_carries_the_known_hashes() -> None:
    stats = hashed_stats()
    window = window_from_stats(stats, duration_s=60)
    assert window.key_hashes is not None and window.key_hashes.tolist() == stats.hashes.tolist()
    assert window.window(0, 30).key_hashes is window.key_hashes


def test_a_plan_keyed_by_known_hashes_is_followed_in_replay() -> None:
    stats = hashed_stats()
    dests = [Destination(f"p-{i}", "", 1.0, 200_000) for i in range(4)]
    plan = compute_plan(stats, dests, pool="p").plan
    assert len(plan) == len(stats)
    window = window_from_stats(stats, duration_s=120)
    policy = Planned(plan)
    replay_trace(window, policy, ReplayConfig(destinations=4, destination_ids=tuple(d.id for d in dests)))
    # Every request is of a planned key: the replay must find each one in the plan.
    assert policy.planned_requests + policy.spilled_requests == len(window)
