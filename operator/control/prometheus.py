"""Reading one control period's window from Prometheus.

Every query runs in a worker thread (a synchronous HTTP client, the answer decoded there too), all
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

import httpx
import numpy as np
import numpy.typing as npt

from cacheroute.operator.control.promjson import AnswerError, values_by_label, vector_values
from cacheroute.operator.control.promql import (
    KEY_COUNTERS,
    NO_KEY,
    OTHER_KEY,
    PLAIN_KEY,
    PoolSeries,
    WindowQueries,
    key_counter,
    router_first_sample,
    router_started,
    window_queries,
    window_seconds,
)

F64 = npt.NDArray[np.float64]
# Keys with a series born in the window listed by name in the query that counts them again; past
# this (a router restarted in the window: every key of it) every key is counted that way.
MAX_LISTED_KEYS = 1000
ENGINE_QUERIES = ("prefix_cache_hits", "prefix_cache_queries", "generation_tokens", "waiting", "running", "kv_usage")

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


@dataclass(frozen=True)
class MissingHistory:
    """A router pod's samples that Prometheus should hold in the window and does not: it was
    down, or lost its data, from `expected_from` (the window's start, or the router's if later)
    to `first_sample`."""

    pod: str
    expected_from: float
    first_sample: float

    @property
    def seconds(self) -> float:
        return self.first_sample - self.expected_from


def missing_history(
    first_samples: Mapping[str, float], started: Mapping[str, float], window_start: float
) -> MissingHistory | None:
    """The router pod whose first sample in the window comes longest after it should have, if any.
    A pod whose start is not known is passed over: its late first sample may be a new router's."""
    worst: MissingHistory | None = None
    for pod, first in first_samples.items():
        if pod not in started:
            continue
        gap = MissingHistory(pod, max(window_start, started[pod]), first)
        if gap.seconds > 0 and (worst is None or gap.seconds > worst.seconds):
            worst = gap
    return worst


@dataclass(frozen=True, eq=False)
class WindowMetrics:
    evaluated_at: int  # unix seconds the queries were evaluated at
    window_s: float
    keys: KeyCounts
    other: Aggregate  # keyed requests of keys the router's sketch does not track
    unkeyed: Aggregate  # requests without a key
    engines: Mapping[str, EngineWindow] = field(default_factory=dict)
    # The largest stretch of router history missing from the window (None: none, or not read).
    missing: MissingHistory | None = None

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


def window_from_values(
    values: Mapping[str, Mapping[str, float]], *, evaluated_at: int, window_s: float,
    missing: MissingHistory | None = None,
) -> WindowMetrics:
    """Assemble a window from each `WindowQueries` field's answer, as label value -> sample value."""
    requests, prompt, prefix = (dict(values[n]) for n in KEY_COUNTERS)
    per_pod = {name: values[name] for name in ENGINE_QUERIES}
    pods = sorted(set().union(*per_pod.values()))
    engines = {pod: EngineWindow(**{name: per_pod[name].get(pod) for name in ENGINE_QUERIES}) for pod in pods}
    return WindowMetrics(
        evaluated_at=evaluated_at,
        window_s=window_s,
        keys=_key_counts(requests, prompt, prefix),
        other=_aggregate(OTHER_KEY, requests, prompt, prefix),
        unkeyed=_aggregate(NO_KEY, requests, prompt, prefix),
        engines=engines,
        missing=missing,
    )


def window_from_results(
    results: Mapping[str, Sequence[Mapping[str, Any]]], *, evaluated_at: int, window_s: float
) -> WindowMetrics:
    """Assemble a window from the decoded results of `WindowQueries` (by field name)."""
    values = {name: values_by_label(result, _label(name)) for name, result in results.items()}
    return window_from_values(values, evaluated_at=evaluated_at, window_s=window_s)


def _label(query: str) -> str:
    """The label a `WindowQueries` field's answer is keyed by."""
    return "key" if query.startswith("key_") else "pod"


class PrometheusReader:
    """Queries one Prometheus (an HTTP client per reader, shared by its worker threads)."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        # No retries inside a period: a failed period is retried by the next one.
        self._client = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._client.close()

    def _answer(self, promql: str, at: int) -> bytes:
        form = {"query": promql, "time": str(at), "timeout": f"{self.timeout_s:g}s"}
        try:
            response = self._client.post(f"{self.url}/api/v1/query", data=form)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            message = f"Prometheus at {self.url} is unreachable: {_short(exc)}"
            raise MetricsReadError(REASON_UNREACHABLE, message) from exc
        except httpx.TimeoutException as exc:
            raise MetricsReadError(
                REASON_TIMEOUT, f"Prometheus at {self.url} did not answer within {self.timeout_s:g}s"
            ) from exc
        except httpx.HTTPError as exc:
            raise MetricsReadError(REASON_ERROR, f"Prometheus at {self.url} answered badly: {_short(exc)}") from exc
        if response.status_code != 200:
            message = f"HTTP {response.status_code}: {_clipped(response.text)}"
            raise MetricsReadError(REASON_ERROR, f"Prometheus at {self.url} refused a query: {message}")
        return response.content

    def _query(self, promql: str, at: int, label: str) -> dict[str, float]:
        body = self._answer(promql, at)
        try:
            return vector_values(body, label)
        except AnswerError as exc:
            raise MetricsReadError(REASON_ERROR, f"Prometheus at {self.url} answered badly: {_short(exc)}") from exc

    async def read_window(self, series: PoolSeries, window_s: float, *, at: int, keys: bool = True) -> WindowMetrics:
        """All queries of one period, concurrently, evaluated at unix second `at` (without the
        per-key ones when `keys` is false); then the keys with a series created in the window."""
        try:
            values, missing = await asyncio.wait_for(
                self._read(series, window_s, at, keys), timeout=self.timeout_s + 1.0
            )
        except TimeoutError as exc:
            raise MetricsReadError(
                REASON_TIMEOUT, f"Prometheus at {self.url} did not answer within {self.timeout_s:g}s"
            ) from exc
        return window_from_values(values, evaluated_at=at, window_s=window_s, missing=missing)

    async def _read(
        self, series: PoolSeries, window_s: float, at: int, keys: bool
    ) -> tuple[dict[str, dict[str, float]], MissingHistory | None]:
        queries = window_queries(series, window_s)
        names = [n for n in WindowQueries.__dataclass_fields__ if keys or not n.startswith("key_")]
        calls = [asyncio.to_thread(self._query, getattr(queries, name), at, _label(name)) for name in names]
        seconds = window_seconds(window_s)
        # The routers' history in the window, where the per-key counts are read from it.
        history = [
            asyncio.to_thread(self._query, router_first_sample(series, seconds, at), at, "pod"),
            asyncio.to_thread(self._query, router_started(series), at, "pod"),
        ] if keys else []
        answers = await asyncio.gather(*calls, *history)
        values: dict[str, dict[str, float]] = {name: {} for name in WindowQueries.__dataclass_fields__}
        values.update(zip(names, answers[: len(names)], strict=True))
        missing = missing_history(answers[-2], answers[-1], at - seconds) if keys else None
        born = [key for key, count in values["key_born"].items() if count > 0]
        if born:
            await self._count_born(series, seconds, at, born, values)
        return values, missing

    async def _count_born(
        self, series: PoolSeries, seconds: int, at: int, born: list[str], values: dict[str, dict[str, float]]
    ) -> None:
        """Count again, with `key_counter`, the keys with a series created in the window: the keys
        listed in the query when they are few, every key otherwise (as after a router restart)."""
        listed = born if len(born) <= MAX_LISTED_KEYS and all(PLAIN_KEY.fullmatch(k) for k in born) else None
        calls = [
            asyncio.to_thread(self._query, key_counter(series, metric, seconds, listed), at, "key")
            for metric in KEY_COUNTERS.values()
        ]
        for name, counted in zip(KEY_COUNTERS, await asyncio.gather(*calls), strict=True):
            if listed is None:
                values[name] = counted
                continue
            increases = values[name]
            for key in listed:
                increases.pop(key, None)
            increases.update(counted)


def _clipped(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short(exc: BaseException, limit: int = 300) -> str:
    return _clipped(str(exc) or type(exc).__name__, limit)
