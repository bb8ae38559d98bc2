"""Reading a window from the real Prometheus: per-key counters summed over router replicas, vLLM
counters under current and legacy names, a Prometheus that is not there."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cacheroute.operator.control import prometheus
from cacheroute.operator.control.prometheus import MetricsReadError, PrometheusReader
from cacheroute.operator.control.promjson import pattern_values
from cacheroute.operator.control.promql import PoolSeries, window_queries
from cacheroute.sandbox.process import free_port
from tests.support.control import (
    ControlEnv,
    Traffic,
    key_label,
    wait_for_samples,
    wait_for_window,
    zipf_traffic,
)

pytestmark = pytest.mark.integration

WINDOW = 10


async def test_window_sums_router_replicas_and_reads_both_vllm_names(env: ControlEnv) -> None:
    traffic: Traffic = zipf_traffic(5, 10.0, prompt=1000, prefix_share=0.5, exponent=1.0)
    # Two router replicas each see half of every key; llama-1 exports vLLM's legacy names.
    env.fleet("llama", routers=2, engines=2, legacy_engines=[1]).set_traffic(traffic)
    # Another pool's series in the same namespace must not leak in.
    env.fleet("other", routers=1, engines=1).set_traffic(zipf_traffic(3, 50.0, prompt=10, prefix_share=0, exponent=0))
    wait_for_window(env.prometheus_url, env.namespace, len(traffic.keys) + 2 + 3 + 2, WINDOW, engines=3)

    reader = PrometheusReader(env.prometheus_url, timeout_s=5)
    try:
        window = await reader.read_window(PoolSeries(env.namespace, "llama"), WINDOW, at=int(time.time()))
    finally:
        reader.close()
    assert sorted(window.keys.labels) == sorted(key_label(k.key) for k in traffic.keys)
    rates = dict(zip(window.keys.labels, window.keys.requests / WINDOW, strict=True))
    for k in traffic.keys:
        # increase() extrapolates over scrape gaps: allow for it, but both replicas must be summed.
        assert rates[key_label(k.key)] == pytest.approx(k.rate, rel=0.25)
    prompt = dict(zip(window.keys.labels, window.keys.prompt_tokens / window.keys.requests, strict=True))
    assert prompt[key_label(traffic.keys[0].key)] == pytest.approx(1000, rel=1e-6)
    assert window.other.requests > 0 and window.unkeyed.requests > 0
    assert set(window.engines) == {"llama-0", "llama-1"}
    assert window.engines["llama-1"].prefix_cache_queries and window.engines["llama-1"].kv_usage == 0.5
    assert window.observed_kv_hit == pytest.approx(traffic.kv_hit, abs=0.02)
    assert window.generation_tokens and window.generation_tokens / window.total_requests == pytest.approx(
        traffic.output_tokens, rel=0.25
    )
    # Prometheus' own answers are read in one pass of the pattern, not decoded item by item.
    queries = window_queries(PoolSeries(env.namespace, "llama"), WINDOW)
    async with httpx.AsyncClient(timeout=10) as http:
        for query, label in ((queries.key_requests, "key"), (queries.kv_usage, "pod")):
            raw = (await http.post(f"{env.prometheus_url}/api/v1/query", data={"query": query})).content
            assert pattern_values(raw, label), raw[:300]


@pytest.mark.parametrize("listed", [True, False], ids=["born-keys-listed", "every-key-recounted"])
async def test_a_new_keys_burst_between_two_scrapes_is_counted(
    env: ControlEnv, listed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key's first requests all land before Prometheus first scrapes its series: the window
    still counts them (a router creates a key's series at its first request). A series that
    Prometheus sees for the first time but the router began an hour ago (as after an outage of
    Prometheus) is not counted whole. Both ways of counting the keys born in the window again
    (by name, or every key when there are too many to list) give the same counts."""
    if not listed:
        monkeypatch.setattr(prometheus, "MAX_LISTED_KEYS", 0)
    traffic = zipf_traffic(3, 10.0, prompt=100, prefix_share=0.5, exponent=1.0)
    fleet = env.fleet("llama", routers=1, engines=1)
    fleet.set_traffic(traffic)
    wait_for_window(env.prometheus_url, env.namespace, len(traffic.keys) + 2, WINDOW, engines=1)
    fleet.burst("tenant-new", requests=7, prompt_tokens=300)
    fleet.burst("tenant-old", requests=5000, prompt_tokens=300, started=time.time() - 3600)
    label = key_label("tenant-new")
    wait_for_samples(env.prometheus_url, env.namespace, label, 2)
    wait_for_samples(env.prometheus_url, env.namespace, key_label("tenant-old"), 2)

    reader = PrometheusReader(env.prometheus_url, timeout_s=5)
    try:
        window = await reader.read_window(PoolSeries(env.namespace, "llama"), WINDOW, at=int(time.time()))
    finally:
        reader.close()
    counts = dict(zip(window.keys.labels, window.keys.requests, strict=True))
    assert counts.get(label) == 7
    assert key_label("tenant-old") not in counts  # no increase seen: not 5,000 requests in the window
    prompt = dict(zip(window.keys.labels, window.keys.prompt_tokens, strict=True))
    assert prompt[label] == 7 * 300
    # The keys that were there before the window still count their increase, not their total.
    for k in traffic.keys:
        assert counts[key_label(k.key)] / WINDOW == pytest.approx(k.rate, rel=0.25)


async def test_a_query_prometheus_refuses_is_reported_with_its_error(env: ControlEnv) -> None:
    reader = PrometheusReader(env.prometheus_url, timeout_s=5)
    try:
        with pytest.raises(MetricsReadError) as caught:
            await asyncio.to_thread(reader._query, "sum by (key) (", int(time.time()), "key")
    finally:
        reader.close()
    assert caught.value.reason == "PrometheusError"
    assert "refused a query: HTTP 400" in caught.value.message and "parse error" in caught.value.message


async def test_an_absent_prometheus_is_reported_as_unreachable() -> None:
    reader = PrometheusReader(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    try:
        with pytest.raises(MetricsReadError) as caught:
            await reader.read_window(PoolSeries("ns", "llama"), 60, at=int(time.time()))
    finally:
        reader.close()
    assert caught.value.reason == "PrometheusUnreachable"
