"""Reading one control period's window from Prometheus.

`prometheus-api-client` is synchronous (requests), so every query runs in a worker thread, all
of a period's queries at once, each bounded by the AffinityPlan's `spec.prometheus.timeout` (on
the HTTP request and as Prometheus' own query timeout). Queries are evaluated at one whole-second
instant, so a period's figures are reproducible: the same queries at `evaluated_at` give the same
answer. Failures come out as `MetricsReadError` with the condition reason to report.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from cacheroute.operator.control.promql import NO_KEY, OTHER_KEY, PoolSeries, WindowQueries, window_queries

F64 = npt.NDArray[np.float64]

REASON_UNREACHABLE = "PrometheusUnreachable"
REASON_TIMEOUT = "PrometheusTimeout"
REASON_ERROR = "PrometheusError"
REASON_NOT_CONFIGURED = "PrometheusNotConfigured"


class MetricsReadError(Exception):
    """The window could not be read; `reason` is the MetricsAvailable condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True, eq=False)
class KeyCounts:
    """Per key label (the router's 16-hex hash, or the clear key when it exports names):
    increases over the window, summed over router replicas."""

    labels: tuple[str, ...]
    requests: F64
    prompt_tokens: F64
    prefix_tokens: F64

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Aggregate:
    """Traffic counted in one series rather than per key (`__other__`, `__none__`)."""

    requests: float = 0.0
    prompt_tokens: float = 0.0
    prefix_tokens: float = 0.0


@dataclass(frozen=True)
class EngineWindow:
    """What one vLLM pod reported over the window (None: it did not report it)."""

    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    generation_tokens: float | None = None
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None

    @property
    def kv_hit(self) -> float | None:
        if self.prefix_cache_hits is None or not self.prefix_cache_queries:
            return None
        return min(max(self.prefix_cache_hits / self.prefix_cache_queries, 0.0), 1.0)


@dataclass(frozen=True, eq=False)
class WindowMetrics:
    evaluated_at: int  # unix seconds the queries were evaluated at
    window_s: float
    keys: KeyCounts
    other: Aggregate  # keyed requests of keys the router's sketch does not track
    unkeyed: Aggregate  # requests without a key
    engines: Mapping[str, EngineWindow] = field(default_factory=dict)

    @property
    def total_requests(self) -> float:
        # fsum: correctly rounded whatever the order Prometheus listed the series in.
        return math.fsum([*self.keys.requests.tolist(), self.other.requests, self.unkeyed.requests])

    @property
    def generation_tokens(self) -> float | None:
        values = [e.generation_tokens for e in self.engines.values() if e.generation_tokens is not None]
        return math.fsum(values) if values else None

    @property
    def observed_kv_hit(self) -> float | None:
        """Served token-weighted KV hit over the window, from vLLM's prefix-cache counters."""
        pairs = [
            (e.prefix_cache_hits, e.prefix_cache_queries)
            for e in self.engines.values()
            if e.prefix_cache_hits is not None and e.prefix_cache_queries is not None
        ]
        queries = sum(q for _, q in pairs)
        if not queries > 0:
            return None
        return min(max(sum(h for h, _ in pairs) / queries, 0.0), 1.0)


def _values(result: Sequence[Mapping[str, Any]], label: str) -> dict[str, float]:
    """`label` value -> sample value of an instant vector; non-finite samples are dropped."""
    out: dict[str, float] = {}
    for item in result:
        name = item.get("metric", {}).get(label)
        if name is None:
            continue
        value = float(item["value"][1])
        if math.isfinite(value):
            out[name] = value
    return out


def _key_counts(requests: dict[str, float], prompt: dict[str, float], prefix: dict[str, float]) -> KeyCounts:
    labels = tuple(k for k, v in requests.items() if k not in (OTHER_KEY, NO_KEY) and v > 0)
    return KeyCounts(
        labels=labels,
        requests=np.fromiter((requests[k] for k in labels), np.float64, len(labels)),
        prompt_tokens=np.fromiter((max(prompt.get(k, 0.0), 0.0) for k in labels), np.float64, len(labels)),
        prefix_tokens=np.fromiter((max(prefix.get(k, 0.0), 0.0) for k in labels), np.float64, len(labels)),
    )


def _aggregate(name: str, requests: dict[str, float], prompt: dict[str, float], prefix: dict[str, float]) -> Aggregate:
    return Aggregate(
        max(requests.get(name, 0.0), 0.0), max(prompt.get(name, 0.0), 0.0), max(prefix.get(name, 0.0), 0.0)
    )


def window_from_results(
    results: Mapping[str, Sequence[Mapping[str, Any]]], *, evaluated_at: int, window_s: float
) -> WindowMetrics:
    """Assemble a window from the raw results of `WindowQueries` (by field name)."""
    requests = _values(results["key_requests"], "key")
    prompt = _values(results["key_prompt_tokens"], "key")
    prefix = _values(results["key_prefix_tokens"], "key")
    per_pod = {
        name: _values(results[name], "pod")
        for name in ("prefix_cache_hits", "prefix_cache_queries", "generation_tokens", "waiting", "running", "kv_usage")
    }
    pods = sorted(set().union(*per_pod.values()))
    engines = {pod: EngineWindow(**{name: values.get(pod) for name, values in per_pod.items()}) for pod in pods}
    return WindowMetrics(
        evaluated_at=evaluated_at,
        window_s=window_s,
        keys=_key_counts(requests, prompt, prefix),
        other=_aggregate(OTHER_KEY, requests, prompt, prefix),
        unkeyed=_aggregate(NO_KEY, requests, prompt, prefix),
        engines=engines,
    )


class PrometheusReader:
    """Queries one Prometheus (a requests session per reader, shared by its worker threads)."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        # No retries inside a period: a failed period is retried by the next one.
        self._client = PrometheusConnect(url=self.url, retry=Retry(total=0), timeout=timeout_s, method="POST")

    def close(self) -> None:
        self._client.close()

    def _query(self, promql: str, at: int) -> list[dict[str, Any]]:
        from prometheus_api_client.exceptions import PrometheusApiClientException
        from requests import exceptions as http

        params = {"time": str(at), "timeout": f"{self.timeout_s:g}s"}
        try:
            result: list[dict[str, Any]] = self._client.custom_query(promql, params=params, timeout=self.timeout_s)
        except (http.ConnectTimeout, http.ConnectionError) as exc:
            message = f"Prometheus at {self.url} is unreachable: {_short(exc)}"
            raise MetricsReadError(REASON_UNREACHABLE, message) from exc
        except http.Timeout as exc:
            raise MetricsReadError(
                REASON_TIMEOUT, f"Prometheus at {self.url} did not answer within {self.timeout_s:g}s"
            ) from exc
        except PrometheusApiClientException as exc:
            raise MetricsReadError(REASON_ERROR, f"Prometheus at {self.url} refused a query: {_short(exc)}") from exc
        except (http.RequestException, ValueError, KeyError) as exc:
            raise MetricsReadError(REASON_ERROR, f"Prometheus at {self.url} answered badly: {_short(exc)}") from exc
        return result

    async def read_window(self, series: PoolSeries, window_s: float, *, at: int, keys: bool = True) -> WindowMetrics:
        """All queries of one period, concurrently, evaluated at unix second `at` (without the
        per-key ones when `keys` is false)."""
        queries = window_queries(series, window_s)
        names = [n for n in WindowQueries.__dataclass_fields__ if keys or not n.startswith("key_")]
        calls = [asyncio.to_thread(self._query, getattr(queries, name), at) for name in names]
        try:
            answers = await asyncio.wait_for(asyncio.gather(*calls), timeout=self.timeout_s + 1.0)
        except TimeoutError as exc:
            raise MetricsReadError(
                REASON_TIMEOUT, f"Prometheus at {self.url} did not answer within {self.timeout_s:g}s"
            ) from exc
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in WindowQueries.__dataclass_fields__}
        results.update(zip(names, answers, strict=True))
        return window_from_results(results, evaluated_at=at, window_s=window_s)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
