"""The PromQL the control loop asks: one pool's router and vLLM series over one window.

Series are selected by the labels the cluster's Prometheus keeps for pods (`namespace`, `pod`):
router pods are `<pool>-router-<replicaset>-<id>` (the pool's router Deployment), vLLM pods
`<pool>-<ordinal>` (its StatefulSet). A key is the same hash on every router replica, so per-key
counters are summed over replicas; `increase` copes with router restarts (counter resets), and a
key's series created inside the window counts from zero (`key_counter`).

vLLM renamed its prefix-cache and KV-usage metrics (`vllm:gpu_prefix_cache_*` became
`vllm:prefix_cache_*`, `vllm:gpu_cache_usage_perc` became `vllm:kv_cache_usage_perc`) and exports
both names during the deprecation: each query takes the current name and falls back to the
legacy one per pod (`or`), so a pod is never counted twice; the `vllm_` spellings come last.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

ROUTER_PREFIX = "cacheroute_router"
KEY_REQUESTS = f"{ROUTER_PREFIX}_key_requests_total"
KEY_PROMPT_TOKENS = f"{ROUTER_PREFIX}_key_prompt_tokens_total"
KEY_PREFIX_TOKENS = f"{ROUTER_PREFIX}_key_prefix_tokens_total"
# The per-key counters, by the `WindowQueries` field that asks for each.
KEY_COUNTERS = {
    "key_requests": KEY_REQUESTS,
    "key_prompt_tokens": KEY_PROMPT_TOKENS,
    "key_prefix_tokens": KEY_PREFIX_TOKENS,
}
# When a key's series started (unix seconds), as prometheus_client exports a counter's creation.
KEY_CREATED = f"{ROUTER_PREFIX}_key_requests_created"
# Label values of the router's per-key series that are not keys (router/metrics.py).
OTHER_KEY = "__other__"
NO_KEY = "__none__"



def _spellings(*names: str) -> tuple[str, ...]:
    """Each name, then the same names with `vllm_` for `vllm:`: prometheus_client's OpenMetrics
    output (which Prometheus asks for first) rewrites the colon in sample names to `_`."""
    return (*names, *(n.replace("vllm:", "vllm_", 1) for n in names))


# vLLM metric names: current first, then the names older releases export.
PREFIX_CACHE_HITS = _spellings("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREFIX_CACHE_QUERIES = _spellings("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
KV_CACHE_USAGE = _spellings("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
REQUESTS_WAITING = _spellings("vllm:num_requests_waiting")
REQUESTS_RUNNING = _spellings("vllm:num_requests_running")
GENERATION_TOKENS = _spellings("vllm:generation_tokens_total")

# Key labels a regex matcher can list as they are: the routers' hashes and their two aggregates.
PLAIN_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")
# Kubernetes object names (DNS subdomains): nothing in them needs quoting in PromQL but the dot.
_OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _pod_regex(prefix: str, suffix: str) -> str:
    """A PromQL regex (as a string literal) matching `prefix` literally, then `suffix`."""
    return '"' + prefix.replace(".", "\\\\.") + suffix + '"'


def range_of(seconds: float) -> str:
    """A PromQL range of whole seconds (at least one)."""
    return f"{max(1, round(seconds))}s"


@dataclass(frozen=True)
class PoolSeries:
    """Label matchers of one pool's series."""

    namespace: str
    pool: str

    def __post_init__(self) -> None:
        for what, value in (("namespace", self.namespace), ("pool", self.pool)):
            if not _OBJECT_NAME.match(value):
                raise ValueError(f"{what} {value!r} is not a Kubernetes object name")

    @property
    def router(self) -> str:
        return f'namespace="{self.namespace}",pod=~{_pod_regex(self.pool, "-router-[a-z0-9]+-[a-z0-9]+")}'

    @property
    def engines(self) -> str:
        return f'namespace="{self.namespace}",pod=~{_pod_regex(self.pool, "-[0-9]+")}'


def _first_of(names: tuple[str, ...], template: str) -> str:
    """`template` (with `{name}`) for each name, joined by `or`: the first name present wins per series."""
    return " or ".join(template.format(name=n) for n in names)


def key_counter(series: PoolSeries, metric: str, window_s: int, keys: Sequence[str] | None = None) -> str:
    """Per key label: the counter's increase over the window, summed over router replicas.

    A router creates a key's series at the key's first request, so the first sample Prometheus
    takes already holds every request before that scrape, and `increase` (a difference between
    samples) never counts them: a new key's burst between two scrapes would count nothing. The
    router exports when each key's series started (`…_key_requests_created`, one per key for
    all three counters): a series created inside the window counts its last value (it started
    from zero there), any other its increase (also where Prometheus keeps no `_created` series:
    then as before). Judging by the creation time, not by the first sample, matters after a gap
    in scraping: a series first seen after a Prometheus outage was not born in the window.

    `keys` restricts the query to those key labels (each matching `PLAIN_KEY`).
    """
    window = range_of(window_s)
    router = series.router if keys is None else f"{series.router},{_keys_matcher(keys)}"
    selected = f"{metric}{{{router}}}"
    born = f"({KEY_CREATED}{{{router}}} > time() - {window_s})"
    return (
        f"sum by (key) ((increase({selected}[{window}]) unless {born})"
        f" or (last_over_time({selected}[{window}]) and {born}))"
    )


def key_increase(series: PoolSeries, metric: str, window_s: int) -> str:
    """Per key label: the counter's increase over the window, summed over router replicas; what
    `key_counter` gives for every key none of whose series was created inside the window."""
    return f"sum by (key) (increase({metric}{{{series.router}}}[{range_of(window_s)}]))"


def key_born(series: PoolSeries, window_s: int) -> str:
    """Per key label: how many of its router series were created inside the window."""
    return f"count by (key) ({KEY_CREATED}{{{series.router}}} > time() - {window_s})"


# Steps of the subquery that finds a router's first sample in the window: its precision.
HISTORY_STEPS = 240


def router_first_sample(series: PoolSeries, window_s: int, at: int) -> str:
    """Per router pod: the time of the earliest sample Prometheus holds for it in the window that
    ends at unix second `at`, to within window/240 (the series the router exports from its start,
    its `__other__` requests).

    A subquery step sees the latest sample before it, which after a Prometheus outage is one from
    before the outage: only samples inside the window count (`>=` its start, a literal)."""
    step = max(1, round(window_s / HISTORY_STEPS))
    alive = f'{KEY_REQUESTS}{{{series.router},key="{OTHER_KEY}"}}'
    return f"min by (pod) (min_over_time((timestamp({alive}) >= {at - window_s})[{window_s}s:{step}s]))"


def router_started(series: PoolSeries) -> str:
    """Per router pod: when its router started (unix seconds; its `__other__` series' creation)."""
    return f'max by (pod) ({KEY_CREATED}{{{series.router},key="{OTHER_KEY}"}})'


def _keys_matcher(keys: Sequence[str]) -> str:
    if not keys or not all(PLAIN_KEY.fullmatch(k) for k in keys):
        raise ValueError("keys must be a non-empty list of plain key labels")
    return f'key=~"{"|".join(sorted(keys))}"'


def engine_counter(series: PoolSeries, names: tuple[str, ...], window: str) -> str:
    """Per vLLM pod: a counter's increase over the window (current name, else legacy)."""
    return _first_of(names, f"sum by (pod) (increase({{name}}{{{{{series.engines}}}}}[{window}]))")


def engine_gauge_mean(series: PoolSeries, names: tuple[str, ...], window: str) -> str:
    """Per vLLM pod: a gauge's mean over the window (current name, else legacy)."""
    return _first_of(names, f"max by (pod) (avg_over_time({{name}}{{{{{series.engines}}}}}[{window}]))")


@dataclass(frozen=True)
class WindowQueries:
    """Every query of one control period, by what it measures.

    The per-key counts are increases; the keys that `key_born` lists (a series created inside the
    window) are counted again by `key_counter` (see `prometheus.PrometheusReader`). Asking
    `key_counter` for every key costs Prometheus about four times the increase (1.6 s against
    0.42 s a query for 128,826 keys): it matches every series against its creation time twice.
    """

    key_requests: str
    key_prompt_tokens: str
    key_prefix_tokens: str
    key_born: str
    generation_tokens: str
    prefix_cache_hits: str
    prefix_cache_queries: str
    waiting: str
    running: str
    kv_usage: str


def window_seconds(window_s: float) -> int:
    """The window as the queries ask for it: whole seconds, at least one."""
    return max(1, round(window_s))


def window_queries(series: PoolSeries, window_s: float) -> WindowQueries:
    seconds = window_seconds(window_s)
    w = range_of(seconds)
    return WindowQueries(
        **{name: key_increase(series, metric, seconds) for name, metric in KEY_COUNTERS.items()},
        key_born=key_born(series, seconds),
        generation_tokens=engine_counter(series, GENERATION_TOKENS, w),
        prefix_cache_hits=engine_counter(series, PREFIX_CACHE_HITS, w),
        prefix_cache_queries=engine_counter(series, PREFIX_CACHE_QUERIES, w),
        waiting=engine_gauge_mean(series, REQUESTS_WAITING, w),
        running=engine_gauge_mean(series, REQUESTS_RUNNING, w),
        kv_usage=engine_gauge_mean(series, KV_CACHE_USAGE, w),
    )
