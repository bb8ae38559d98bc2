"""The PromQL of a control period: which series, which names, which window."""

from __future__ import annotations

import re

import pytest

from cacheroute.operator.control.promql import KEY_REQUESTS, PoolSeries, key_counter, range_of, window_queries


def test_router_series_are_summed_per_key_over_the_pools_router_pods() -> None:
    q = window_queries(PoolSeries("llm", "llama"), 1800.0)
    pods = 'namespace="llm",pod=~"llama-router-[a-z0-9]+-[a-z0-9]+"'
    assert q.key_requests == "sum by (key) (increase(cacheroute_router_key_requests_total{" + pods + "}[1800s]))"
    assert "cacheroute_router_key_prompt_tokens_total" in q.key_prompt_tokens
    assert "cacheroute_router_key_prefix_tokens_total" in q.key_prefix_tokens
    # Which keys have a series created in the window: those are counted again by key_counter.
    assert q.key_born == "count by (key) (cacheroute_router_key_requests_created{" + pods + "} > time() - 1800)"


def test_keys_born_in_the_window_count_their_value_and_the_others_their_increase() -> None:
    series = PoolSeries("llm", "llama")
    pods = 'namespace="llm",pod=~"llama-router-[a-z0-9]+-[a-z0-9]+"'
    listed = pods + ',key=~"00aa11bb22cc33dd|__other__"'
    for router, keys in ((pods, None), (listed, ["__other__", "00aa11bb22cc33dd"])):
        selected = "cacheroute_router_key_requests_total{" + router + "}"
        born = "(cacheroute_router_key_requests_created{" + router + "} > time() - 1800)"
        assert key_counter(series, KEY_REQUESTS, 1800, keys) == (
            f"sum by (key) ((increase({selected}[1800s]) unless {born})"
            f" or (last_over_time({selected}[1800s]) and {born}))"
        )


@pytest.mark.parametrize("keys", [[], ["tenant a"], ['x"|.*'], ["k" * 65]])
def test_only_plain_key_labels_are_listed_in_a_query(keys: list[str]) -> None:
    with pytest.raises(ValueError, match="plain key labels"):
        key_counter(PoolSeries("llm", "llama"), KEY_REQUESTS, 60, keys)


def test_vllm_series_take_the_current_name_then_the_legacy_ones_per_pod() -> None:
    q = window_queries(PoolSeries("llm", "llama"), 60)
    names = re.findall(r"increase\(([a-z_:]+)\{", q.prefix_cache_hits)
    assert names == [
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm_prefix_cache_hits_total",
        "vllm_gpu_prefix_cache_hits_total",
    ]
    assert q.prefix_cache_hits.count(" or ") == 3
    assert all(part.startswith("sum by (pod)") for part in q.prefix_cache_hits.split(" or "))
    usage = re.findall(r"avg_over_time\(([a-z_:]+)\{", q.kv_usage)
    assert usage[:2] == ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]
    assert 'pod=~"llama-[0-9]+"' in q.waiting


def test_a_dot_in_a_pool_name_is_matched_literally() -> None:
    q = window_queries(PoolSeries("llm", "llama.v2"), 60)
    assert 'pod=~"llama\\\\.v2-[0-9]+"' in q.running


@pytest.mark.parametrize("name", ["Llama", "a\"b", "", "x}"])
def test_names_that_are_not_kubernetes_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes object name"):
        PoolSeries("llm", name)


def test_ranges_are_whole_seconds() -> None:
    assert (range_of(0.2), range_of(90.4), range_of(1800)) == ("1s", "90s", "1800s")
