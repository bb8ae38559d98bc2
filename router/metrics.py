"""The router's Prometheus metrics.

Per-key series exist only for the keys the heavy-hitter sketch tracks (labelled with the 16-hex
key hash, or the clear key when configured), plus `__other__` for the rest and `__none__` for
requests without a key, so cardinality is bounded by the sketch size.

Counters touched on every request are plain integers owned by the event loop (no lock, a few
hundred nanoseconds less per request than a client-library counter) and exported by a
collector; the metrics thread only reads them.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cacheroute.router.envoystats import EnvoyStats, serve_with_envoy
from cacheroute.router.picker import OUTCOMES
from cacheroute.router.sketch import HeavyKeys

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from cacheroute.router.endpoints import EndpointPool
    from cacheroute.router.keys import Key

# Held here rather than looked up among the module's names at every observation.
_bisect_left: Final = bisect_left

PREFIX: Final = "cacheroute_router"
OTHER_KEY: Final = "__other__"
NO_KEY: Final = "__none__"
# Decision time is tens of microseconds; the upper buckets catch a stalled event loop. (Typed in
# full: mypyc leaves a Final tuple of floats with an inferred type unset when compiled.)
_DECISION_BUCKETS: Final[tuple[float, ...]] = (
    5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1,
)


def key_label(key: int, name: str | None) -> str:
    return name if name is not None else f"{key:016x}"


class _KeyCollector(Collector):
    def __init__(self, sketch: HeavyKeys, unkeyed: _Unkeyed) -> None:
        self._sketch = sketch
        self._unkeyed = unkeyed

    def collect(self) -> Iterator[Metric]:
        snap = self._sketch.snapshot()
        requests = CounterMetricFamily(
            f"{PREFIX}_key_requests",
            "Requests per affinity key (heaviest keys; the rest as __other__).",
            labels=["key"],
        )
        prompt = CounterMetricFamily(
            f"{PREFIX}_key_prompt_tokens",
            "Prompt tokens per affinity key: response usage when seen, else request body bytes / 4.",
            labels=["key"],
        )
        prefix = CounterMetricFamily(
            f"{PREFIX}_key_prefix_tokens",
            "Estimated reusable-prefix tokens per key: characters of all but the newest message / 4.",
            labels=["key"],
        )
        # The requests series carry their created timestamp (`…_key_requests_created`): the
        # operator counts a series created inside its window from zero (operator/control/promql.py).
        # One created series per key serves all three counters, which start together.
        for k in snap.keys:
            label = [key_label(k.key, k.name)]
            requests.add_metric(label, k.requests, created=k.created)
            prompt.add_metric(label, k.prompt_tokens)
            prefix.add_metric(label, k.prefix_tokens)
        requests.add_metric([OTHER_KEY], snap.other_requests, created=snap.started)
        prompt.add_metric([OTHER_KEY], snap.other_prompt_tokens)
        prefix.add_metric([OTHER_KEY], snap.other_prefix_tokens)
        none_requests, none_prompt = self._unkeyed.read()
        requests.add_metric([NO_KEY], none_requests, created=snap.started)
        prompt.add_metric([NO_KEY], none_prompt)
        yield requests
        yield prompt
        yield prefix
        yield GaugeMetricFamily(f"{PREFIX}_sketch_keys", "Keys tracked by the heavy-hitter sketch.", len(snap.keys))
        yield GaugeMetricFamily(
            f"{PREFIX}_sketch_error_bound",
            "Largest overcount of a tracked key's request estimate (total requests / sketch size).",
            snap.error_bound,
        )


class _Unkeyed:
    """Requests without a key; not worth a sketch slot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.prompt_tokens = 0

    def add(self, prompt_tokens: int) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens

    def read(self) -> tuple[int, int]:
        with self._lock:
            return self.requests, self.prompt_tokens


class _EndpointCollector(Collector):
    def __init__(self, pool: EndpointPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        labels = ["endpoint", "destination"]
        in_flight = GaugeMetricFamily(
            f"{PREFIX}_endpoint_in_flight", "Requests in flight per endpoint.", labels=labels
        )
        waiting = GaugeMetricFamily(
            f"{PREFIX}_endpoint_waiting", "Queue depth scraped from the endpoint.", labels=labels
        )
        running = GaugeMetricFamily(
            f"{PREFIX}_endpoint_running", "Running requests scraped from the endpoint.", labels=labels
        )
        pending = GaugeMetricFamily(
            f"{PREFIX}_endpoint_pending_prompt_tokens",
            "Estimated prompt tokens of this router's requests still to prefill there (token-aware load).",
            labels=labels,
        )
        ready = GaugeMetricFamily(f"{PREFIX}_endpoint_ready", "1 when the endpoint may be picked.", labels=labels)
        # A shallow copy: the event loop may add or drop endpoints while this thread reads.
        for e in list(self._pool.by_address.values()):
            label = [e.address, e.destination]
            in_flight.add_metric(label, e.in_flight)
            waiting.add_metric(label, e.waiting)
            running.add_metric(label, e.running)
            pending.add_metric(label, e.in_flight_tokens)
            ready.add_metric(label, 1.0 if e.ready else 0.0)
        yield in_flight
        yield waiting
        yield running
        yield pending
        yield ready


class LoopHistogram:
    """A histogram updated from the event loop only: one bisect and two additions per sample."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[_bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        counts = list(self.counts)
        buckets = []
        running = 0
        for bound, count in zip(self.bounds, counts, strict=False):
            running += count
            buckets.append((repr(bound), running))
        buckets.append(("+Inf", running + counts[-1]))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.total)


class _LoopCounters(Collector):
    """Per-request counters (plain ints on the event loop), exported on scrape."""

    def __init__(self) -> None:
        self.decisions = dict.fromkeys(OUTCOMES, 0)
        self.body_fallbacks = {"too_large": 0, "malformed": 0}
        self.token_sources = {"usage": 0, "estimate": 0}
        # Messages whose handling raised: answered with the p2c fallback or a pass-through reply.
        self.stream_errors = {"handled": 0}
        self.decision_seconds = LoopHistogram(_DECISION_BUCKETS)

    def collect(self) -> Iterator[Metric]:
        for name, doc, label, values in (
            ("decisions", "Routing decisions by outcome.", "outcome", self.decisions),
            ("body_key_fallbacks", "Requests whose body could not give a key (p2c instead), by reason.", "reason",
             self.body_fallbacks),
            ("prompt_token_counts", "Where per-key prompt token counts came from.", "source", self.token_sources),
            ("stream_errors", "ext_proc messages whose handling failed and got the fallback reply instead.",
             "result", self.stream_errors),
        ):
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=[label])
            for key, value in list(values.items()):
                family.add_metric([key], value)
            yield family
        yield self.decision_seconds.family(
            f"{PREFIX}_decision_seconds", "Time to find the key and pick an endpoint for one request."
        )


class RouterMetrics:
    def __init__(self, pool: EndpointPool, *, sketch_size: int, export_key_names: bool,
                 envoy_admin_socket: Path | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.sketch = HeavyKeys(sketch_size, keep_names=export_key_names)
        self.unkeyed = _Unkeyed()
        r = self.registry
        self.loop = _LoopCounters()
        self.decisions = self.loop.decisions
        self.body_fallbacks = self.loop.body_fallbacks
        self.token_sources = self.loop.token_sources
        self.decision_seconds = self.loop.decision_seconds
        self.stream_errors = self.loop.stream_errors
        self.plan_info = Info(f"{PREFIX}_plan", "The plan in effect (pool, version, generation time).", registry=r)
        self.build_info = Info(f"{PREFIX}_build", "How the request path runs: compiled (mypyc) or interpreted.",
                               registry=r)
        self.plan_routes = Gauge(f"{PREFIX}_plan_routes", "Routes in the plan in effect.", registry=r)
        self.plan_applied = Gauge(f"{PREFIX}_plan_applied_timestamp_seconds",
                                  "When the plan in effect was applied.", registry=r)
        loads = Counter(f"{PREFIX}_plan_loads", "Plan payloads seen, by result (applied or rejected).", ["result"],
                        registry=r)
        self.plan_applied_total = loads.labels("applied")
        self.plan_rejected_total = loads.labels("rejected")
        self.scrape_failures = Counter(f"{PREFIX}_scrape_failures", "Failed /metrics scrapes of endpoints.",
                                       ["endpoint"], registry=r)
        self.task_up = Gauge(f"{PREFIX}_task_up", "1 while a background task runs, 0 while it waits to restart.",
                             ["task"], registry=r)
        self.task_restarts = Counter(f"{PREFIX}_task_restarts", "Restarts of background tasks after a failure.",
                                     ["task"], registry=r)
        r.register(self.loop)
        r.register(_KeyCollector(self.sketch, self.unkeyed))
        r.register(_EndpointCollector(pool))
        # The pod's Envoy, read at each scrape (`envoystats.py`).
        self.envoy = EnvoyStats(envoy_admin_socket) if envoy_admin_socket is not None else None

    def record_request(self, key: Key | None, prompt_tokens: int, prefix_tokens: int) -> None:
        if key is None:
            self.unkeyed.add(prompt_tokens)
        else:
            self.sketch.add(key.hash, prompt_tokens, prefix_tokens, key.name)

    def serve(self, host: str, port: int) -> WSGIServer:
        """Serve /metrics from a daemon thread; the server's address tells the port bound."""
        if self.envoy is not None:
            return serve_with_envoy(self.registry, self.envoy, host, port)
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
