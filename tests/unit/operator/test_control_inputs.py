"""From Prometheus answers to the planner's input: the window, statistics, destinations, pins."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cacheroute.operator.api.plan import AffinityPlanSpec
from cacheroute.operator.api.pool import InferencePool
from cacheroute.operator.control import inputs
from cacheroute.operator.control.prometheus import window_from_results
from cacheroute.planner.plan import affinity_key_hash


def vector(label: str, values: dict[str, float | str]) -> list[dict[str, Any]]:
    return [{"metric": {label: k}, "value": [1_700_000_000, str(v)]} for k, v in values.items()]


def hexkey(key: str) -> str:
    return f"{affinity_key_hash(key):016x}"


def results(**overrides: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {
        "key_requests": vector("key", {hexkey("a"): 60, hexkey("b"): 30, "__other__": 6, "__none__": 4}),
        "key_prompt_tokens": vector("key", {hexkey("a"): 60_000, hexkey("b"): 60_000, "__other__": 3000,
                                            "__none__": 2000}),
        "key_prefix_tokens": vector("key", {hexkey("a"): 48_000, hexkey("b"): 90_000, "__other__": 0}),
        "generation_tokens": vector("pod", {"llama-0": 10_000, "llama-1": 10_000}),
        "prefix_cache_hits": vector("pod", {"llama-0": 300, "llama-1": 100}),
        "prefix_cache_queries": vector("pod", {"llama-0": 1000, "llama-1": 1000}),
        "waiting": vector("pod", {"llama-0": 2, "llama-1": "NaN"}),
        "running": vector("pod", {"llama-0": 8}),
        "kv_usage": vector("pod", {"llama-1": 0.4}),
    }
    out.update(overrides)
    return out


def test_window_separates_keys_from_aggregates_and_combines_engines() -> None:
    w = window_from_results(results(), evaluated_at=1_700_000_000, window_s=60)
    assert set(w.keys.labels) == {hexkey("a"), hexkey("b")}
    assert (w.other.requests, w.unkeyed.requests, w.unkeyed.prompt_tokens) == (6, 4, 2000)
    assert w.total_requests == 100
    assert w.generation_tokens == 20_000
    assert w.observed_kv_hit == pytest.approx(0.2)
    assert w.engines["llama-0"].kv_hit == pytest.approx(0.3)
    # A NaN sample is no value; a pod missing from a query has None there.
    assert w.engines["llama-1"].waiting is None and w.engines["llama-0"].kv_usage is None


def test_window_without_vllm_metrics_has_no_observed_hit() -> None:
    empty: list[dict[str, Any]] = []
    w = window_from_results(
        results(prefix_cache_hits=empty, prefix_cache_queries=empty, generation_tokens=empty),
        evaluated_at=1, window_s=60,
    )
    assert w.observed_kv_hit is None and w.generation_tokens is None


def test_statistics_per_key_are_rates_and_means_with_known_hashes() -> None:
    w = window_from_results(results(), evaluated_at=1, window_s=60)
    prepared = inputs.key_stats(w)
    stats = prepared.stats
    assert prepared.output_tokens_known
    row = {int(h): i for i, h in enumerate(stats.hashes.tolist())}
    a, b = row[affinity_key_hash("a")], row[affinity_key_hash("b")]
    assert stats.rate[a] == pytest.approx(1.0) and stats.rate[b] == pytest.approx(0.5)
    assert stats.prompt_tokens[a] == pytest.approx(1000) and stats.prefix_tokens[a] == pytest.approx(800)
    # A prefix larger than the prompt (estimates from two sources) is capped at the prompt.
    assert stats.prefix_tokens[b] == pytest.approx(stats.prompt_tokens[b]) == pytest.approx(2000)
    # Output tokens: vLLM's generated tokens over all requests, the same mean for every key.
    assert np.allclose(stats.output_tokens, 200)
    # `__other__` and `__none__` are the traffic the plan cannot route.
    assert stats.unkeyed.rate == pytest.approx(10 / 60)
    assert stats.unkeyed.prompt_tokens == pytest.approx(500)
    assert stats.window_s == 60
    # Rows come in hash order, whatever order Prometheus answered in.
    assert list(stats.hashes) == sorted(stats.hashes)


def test_rows_of_pinned_keys_carry_the_clear_key_and_clear_labels_are_hashed() -> None:
    res = results(
        key_requests=vector("key", {hexkey("tenant-1"): 10, "tenant-2": 5}),
        key_prompt_tokens=vector("key", {hexkey("tenant-1"): 1000, "tenant-2": 500}),
        key_prefix_tokens=vector("key", {}),
    )
    stats = inputs.key_stats(window_from_results(res, evaluated_at=1, window_s=10), ["tenant-1"]).stats
    by_name = dict(zip(stats.names, stats.hashes.tolist(), strict=True))
    assert by_name["tenant-1"] == affinity_key_hash("tenant-1")
    # The router exported this one in clear (--export-key-names): hashed here, name kept.
    assert by_name["tenant-2"] == affinity_key_hash("tenant-2")


def test_one_key_under_two_labels_is_counted_once() -> None:
    res = results(
        key_requests=vector("key", {hexkey("k"): 10, "k": 5}),
        key_prompt_tokens=vector("key", {hexkey("k"): 1000, "k": 500}),
        key_prefix_tokens=vector("key", {}),
    )
    stats = inputs.key_stats(window_from_results(res, evaluated_at=1, window_s=10)).stats
    assert len(stats) == 1 and stats.rate[0] == pytest.approx(1.5) and stats.prompt_tokens[0] == pytest.approx(100)


def test_keys_without_requests_are_left_out() -> None:
    res = results(key_requests=vector("key", {hexkey("a"): 0, hexkey("b"): 3}))
    stats = inputs.key_stats(window_from_results(res, evaluated_at=1, window_s=10)).stats
    assert stats.hashes.tolist() == [affinity_key_hash("b")]


def pool(destinations: list[dict[str, Any]], kv: int | None = 123_456, host: int = 0) -> InferencePool:
    status: dict[str, Any] = {"destinations": destinations}
    if kv is not None:
        status["memoryPlan"] = {"kvCacheMemoryBytes": 1, "maxNumBatchedTokens": 1, "maxModelLen": 1, "maxNumSeqs": 1,
                                "kvCapacityTokens": kv, "hostKvCapacityTokens": host, "source": "Analytic"}
    return InferencePool.model_validate(
        {"metadata": {"name": "p"}, "spec": {"model": {"name": "m"}}, "status": status}
    )


def test_destinations_are_the_ready_ones_in_ordinal_order_with_kv_capacity() -> None:
    p = pool([
        {"id": "p-10", "address": "10.0.0.10:8000", "ready": True},
        {"id": "p-2", "address": "10.0.0.2:8000", "ready": True},
        {"id": "p-3", "address": "10.0.0.3:8000", "ready": False},
    ])
    ready = inputs.pool_destinations(p, ready_only=True)
    assert [(d.id, d.kv_capacity_tokens) for d in ready] == [("p-2", 123_456), ("p-10", 123_456)]
    assert [d.id for d in inputs.pool_destinations(p, ready_only=False)] == ["p-2", "p-3", "p-10"]
    (unplanned,) = inputs.pool_destinations(pool([{"id": "p-0", "ready": True}], kv=None), ready_only=True)
    assert unplanned.kv_capacity_tokens == 0


def test_a_pool_scaled_to_zero_is_told_apart_from_one_whose_replicas_are_not_ready() -> None:
    starting = pool([{"id": "p-0", "ready": False}])
    assert not inputs.pool_destinations(starting, ready_only=True)
    assert inputs.no_destination_message(starting, "p", ready_only=True) == "InferencePool p has no ready destination"
    zero = starting.model_copy(update={"spec": starting.spec.model_copy(update={"replicas": 0})})
    message = inputs.no_destination_message(zero, "p", ready_only=True)
    assert "scaled to zero (spec.replicas is 0)" in message and "until it has replicas again" in message


def test_destinations_carry_the_host_memory_tier_into_the_warm_budget() -> None:
    (d,) = inputs.pool_destinations(pool([{"id": "p-0", "ready": True}], host=1_468_006), ready_only=True)
    assert (d.kv_capacity_tokens, d.host_kv_capacity_tokens) == (123_456, 1_468_006)


def test_spec_settings_map_onto_the_planner_and_guard() -> None:
    spec = AffinityPlanSpec.model_validate({
        "poolRef": {"name": "p"},
        "budget": {"warmTokensPerDestination": 5000, "maxDestinationsPerKey": 2},
        "stability": {"maxChurn": 0.25, "minGain": 0.1},
        "guard": {"p99Ttft": "1500ms", "minKvHitGain": 0.05},
    })
    assert inputs.budget(spec).warm_tokens_per_destination == 5000
    assert inputs.budget(spec).max_destinations_per_key == 2
    assert (inputs.stability(spec).max_churn, inputs.stability(spec).min_gain) == (0.25, 0.1)
    g = inputs.guard_settings(spec)
    assert (g.slo_p99_ttft_s, g.min_kv_hit_gain) == (1.5, 0.05)


def test_pinned_routes_keep_ready_destinations_and_say_what_they_dropped() -> None:
    spec = AffinityPlanSpec.model_validate({
        "poolRef": {"name": "p"},
        "pinned": [{"key": "a", "destinations": ["p-0", "p-1"]}, {"key": "b", "destinations": ["p-1"]}],
    })
    ready = inputs.pool_destinations(pool([{"id": "p-0", "ready": True}, {"id": "p-1", "ready": False}]),
                                     ready_only=True)
    routes, notes = inputs.pinned_routes(spec, ready)
    assert routes == {"a": ["p-0"]}
    assert len(notes) == 2 and "p-1" in notes[0]
    assert inputs.unknown_pinned_destinations(spec, {"p-0"}) == [("a", "p-1"), ("b", "p-1")]
    assert inputs.unknown_pinned_destinations(spec, {"p-0", "p-1"}) == []


@pytest.mark.parametrize(("label", "expected"), [
    ("00000000000000ff", 255),
    ("ffffffffffffffff", 2**64 - 1),
    ("tenant-42", affinity_key_hash("tenant-42")),
    ("00000000000000FF", affinity_key_hash("00000000000000FF")),  # the router writes lower case only
])
def test_key_labels_map_to_affinity_hashes(label: str, expected: int) -> None:
    assert inputs.key_hash_of_label(label) == expected


# --- the routers' history in the window ----------------------------------------------------------

T = 1_700_000_000  # the period's instant


def test_missing_history_is_the_router_whose_first_sample_comes_longest_after_it_should() -> None:
    from cacheroute.operator.control.prometheus import missing_history

    window_start = T - 600
    first = {"r-a": T - 20, "r-b": T - 590, "r-new": T - 55, "r-unknown": T - 5}
    # r-a ran the whole window but Prometheus holds 20 s of it; r-new started 60 s ago and was
    # scraped 5 s later; nothing says when r-unknown started: passed over.
    started = {"r-a": T - 86_400, "r-b": T - 86_400, "r-new": T - 60}
    gap = missing_history(first, started, window_start)
    assert gap is not None and (gap.pod, gap.expected_from, gap.seconds) == ("r-a", window_start, 580)
    # A router that restarted after its first sample in the window misses nothing.
    assert missing_history({"r": T - 500}, {"r": T - 100}, window_start) is None


def _window(first: float, expected_from: float, window_s: float = 600) -> Any:
    from dataclasses import replace

    from cacheroute.operator.control.prometheus import MissingHistory

    base = window_from_results(results(), evaluated_at=T, window_s=window_s)
    return replace(base, missing=MissingHistory("llama-router-5d8c7b9f4-a0000", expected_from, first))


def test_a_window_holding_less_than_half_a_routers_history_is_not_planned_from() -> None:
    from cacheroute.operator.control.loop import _incomplete_window

    # Prometheus lost its data 20 s ago: 580 of the 600 s are missing; enough once the window's
    # start passes the gap's middle, 280 s from now.
    message = _incomplete_window(_window(T - 20, T - 600), "10m")
    assert message is not None
    assert "holds only the last 20 s of the 10m window for router pod llama-router-5d8c7b9f4-a0000" in message
    assert "in about 4 min 40 s" in message
    # Half the window held: planned from.
    assert _incomplete_window(_window(T - 300, T - 600), "10m") is None
    # A router 100 s old whose first 80 s are missing: enough once it has run 160 s.
    message = _incomplete_window(_window(T - 20, T - 100), "10m")
    assert message is not None and message.endswith("in about 1 min")
    # A new router's first scrape a few seconds after its start is no missing history.
    assert _incomplete_window(_window(T - 4, T - 12), "10m") is None
    assert _incomplete_window(window_from_results(results(), evaluated_at=T, window_s=600), "10m") is None
