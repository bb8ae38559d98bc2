"""The per-key series as Prometheus scrapes them: counts, and when each series started."""

from __future__ import annotations

import time

from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.keys import HEADER, Key
from cacheroute.router.metrics import RouterMetrics


def test_key_series_say_when_they_started_in_both_exposition_formats() -> None:
    metrics = RouterMetrics(EndpointPool(scraping=False), sketch_size=4, export_key_names=False)
    before = time.time()
    tenant = Key(0xABC, HEADER, None)
    metrics.record_request(tenant, prompt_tokens=100, prefix_tokens=40)
    metrics.record_request(tenant, prompt_tokens=50, prefix_tokens=0)
    metrics.record_request(None, prompt_tokens=10, prefix_tokens=0)
    after = time.time()
    label = {"key": f"{0xABC:016x}"}
    sample = metrics.registry.get_sample_value
    assert sample("cacheroute_router_key_requests_total", label) == 2
    assert sample("cacheroute_router_key_prompt_tokens_total", label) == 150
    created = sample("cacheroute_router_key_requests_created", label)
    assert created is not None and before <= created <= after
    # `__other__` and `__none__` count from the router's start.
    for key in ("__other__", "__none__"):
        started = sample("cacheroute_router_key_requests_created", {"key": key})
        assert started is not None and started <= before
    # Prometheus asks for OpenMetrics first and takes the classic text format otherwise.
    openmetrics: bytes = generate_openmetrics(metrics.registry)  # type: ignore[no-untyped-call]
    series = f'cacheroute_router_key_requests_created{{key="{0xABC:016x}"}}'
    assert series in openmetrics.decode()
    assert series in generate_latest(metrics.registry).decode()
