"""A planned table of >= 200,000 routes survives the ConfigMap payload, every object under 1 MiB."""

from __future__ import annotations

import numpy as np

from cacheroute.planner.plan import Destination
from cacheroute.planner.plan_format import decode_plan, encode_plan
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.settings import Budget
from tests.support.synthetic_stats import SyntheticStatsSpec, synthetic_key_stats

# The API server refuses a ConfigMap whose data and binaryData hold more than 1 MiB.
CONFIGMAP_LIMIT = 1 << 20


def test_two_hundred_thousand_routes_round_trip_in_sharded_configmaps() -> None:
    stats = synthetic_key_stats(SyntheticStatsSpec(keys=240_000, total_rate=2_000.0, zero_prefix_share=0.0, seed=5))
    dests = [Destination(f"llama-{i}", f"10.1.{i // 250}.{i % 250}:8000", 1.0, 0) for i in range(256)]
    budget = Budget(warm_tokens_per_destination=10**9)
    result = compute_plan(stats, dests, pool="llama", budget=budget, generated_at="2026-01-01T00:00:00Z")
    plan = result.plan
    assert len(plan) >= 200_000
    payload = encode_plan(plan)
    assert len(payload.configmaps) >= 2
    for name, files in payload.configmaps.items():
        size = sum(len(payload.files[f]) for f in files)
        assert size <= CONFIGMAP_LIMIT, f"{name} holds {size} bytes"
    back = decode_plan(payload.files)
    assert np.array_equal(back.route_keys, plan.route_keys)
    assert np.array_equal(back.route_offsets, plan.route_offsets)
    assert np.array_equal(back.route_dests, plan.route_dests)
    assert back.summary == plan.summary
    # Every planned key of the statistics is found by its hash in the decoded plan.
    rows = np.flatnonzero(result.routed)[::997]
    for r in rows.tolist():
        assert back.destinations_of(int(stats.hashes[r])) == result.destinations_of_key(r)
