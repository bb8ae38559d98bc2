"""What the loop reports about itself: vLLM's and the router's counters in Prometheus, and the
plan each router has loaded, read from its /metrics.

A phase's figures are differences of counters between two instants at which no request was in
flight, each read only once Prometheus holds a scrape taken after that instant: nothing is
extrapolated, and a phase's counts are exactly the requests it sent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cacheroute.sandbox.demo.cluster import DemoError, await_true

ROUTER_METRICS_PORT = 9090


@dataclass(frozen=True)
class Counters:
    """Counter values of the pool at one instant (vLLM token counters and requests, router decisions)."""

    at: float
    hit_tokens: float
    query_tokens: float
    requests_by_pod: dict[str, float] = field(default_factory=dict)
    decisions: dict[str, float] = field(default_factory=dict)

    def minus(self, before: Counters) -> Counters:
        return Counters(
            at=self.at,
            hit_tokens=self.hit_tokens - before.hit_tokens,
            query_tokens=self.query_tokens - before.query_tokens,
            requests_by_pod={p: v - before.requests_by_pod.get(p, 0.0) for p, v in self.requests_by_pod.items()},
            decisions={o: v - before.decisions.get(o, 0.0) for o, v in self.decisions.items()},
        )

    @property
    def served_kv_hit(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PoolMetrics:
    """PromQL over one pool's series (the sandbox Prometheus discovers annotated pods)."""

    def __init__(self, prometheus_url: str, namespace: str, pool: str) -> None:
        self.url = prometheus_url.rstrip("/")
        self.vllm = f'namespace="{namespace}",pod=~"{pool}-[0-9]+"'
        self.router = f'namespace="{namespace}",pod=~"{pool}-router-.+"'

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, str | float] = {"query": promql}
        if at is not None:
            params["time"] = at
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=15.0).json()
        if body.get("status") != "success":
            raise DemoError(f"Prometheus refused {promql!r}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def _by(self, promql: str, label: str, at: float) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(promql, at)}

    def _sum(self, promql: str, at: float) -> float:
        result = self.query(f"sum({promql})", at)
        return float(result[0]["value"][1]) if result else 0.0

    def oldest_sample(self, destinations: int) -> float:
        """The time of the oldest latest scrape over the pool's vLLM pods and routers (0 when a
        vLLM pod has no series yet)."""
        vllm = self.query(f"timestamp(vllm:prefix_cache_queries_total{{{self.vllm}}})")
        router = self.query(f"timestamp(cacheroute_router_decisions_total{{{self.router}}})")
        if len({r["metric"].get("pod") for r in vllm}) < destinations or not router:
            return 0.0
        return min(float(r["value"][1]) for r in vllm + router)

    def await_scraped_after(self, instant: float, destinations: int, timeout: float = 60.0) -> None:
        """Until every pod of the pool has been scraped after `instant`."""
        await_true(lambda: self.oldest_sample(destinations) > instant,
                   "Prometheus to scrape every vLLM pod and router", timeout, interval=0.25)

    def counters(self, at: float) -> Counters:
        return Counters(
            at=at,
            hit_tokens=self._sum(f"vllm:prefix_cache_hits_total{{{self.vllm}}}", at),
            query_tokens=self._sum(f"vllm:prefix_cache_queries_total{{{self.vllm}}}", at),
            requests_by_pod=self._by(f"sum by (pod) (vllm:request_success_total{{{self.vllm}}})", "pod", at),
            decisions=self._by(f"sum by (outcome) (cacheroute_router_decisions_total{{{self.router}}})",
                               "outcome", at),
        )

    def settled_counters(self, destinations: int, timeout: float = 60.0) -> Counters:
        """Counters as of now, once Prometheus holds a scrape of every pod taken after now."""
        now = time.time()
        self.await_scraped_after(now, destinations, timeout)
        # Evaluated now, not at `now`: the latest sample of every series is the scrape after `now`.
        return self.counters(time.time())


def router_plan_version(address: str) -> str | None:
    """The plan version a router has applied (its `cacheroute_router_plan_info`), None before any."""
    text = httpx.get(f"http://{address}:{ROUTER_METRICS_PORT}/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cacheroute_router_plan_info" and sample.labels.get("version"):
                return sample.labels["version"]
    return None


def await_routers_on(addresses: list[str], version: str, timeout: float) -> None:
    await_true(lambda: all(router_plan_version(a) == version for a in addresses),
               f"every router to apply plan {version}", timeout, interval=0.25)


def plan_status(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("status") or {})


def router_ready_endpoints(address: str) -> int:
    """How many endpoints a router may pick (its `cacheroute_router_endpoint_ready`)."""
    text = httpx.get(f"http://{address}:{ROUTER_METRICS_PORT}/metrics", timeout=5.0).text
    return sum(
        1 for family in text_string_to_metric_families(text) if family.name == "cacheroute_router_endpoint_ready"
        for sample in family.samples if sample.value == 1.0
    )
