"""The sandbox Prometheus scrapes what tests add to it and answers queries on it."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from cacheroute.sandbox.process import free_port
from cacheroute.sandbox.prometheus import ScrapeJob
from tests.support.sandbox import ScopedPrometheus

pytestmark = pytest.mark.integration


def test_scraped_exporter_value_is_queryable(prometheus: ScopedPrometheus) -> None:
    registry = CollectorRegistry()
    gauge = Gauge("cacheroute_sandbox_probe", "A value the test exports", ["pool"], registry=registry)
    gauge.labels(pool="llama").set(42.5)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        prometheus.add_scrape_job(ScrapeJob("sandbox-probe", [f"127.0.0.1:{port}"]))
        assert "sandbox-probe" in prometheus.scrape_jobs()
        result = prometheus.wait_for('cacheroute_sandbox_probe{job="sandbox-probe"}', timeout=30)
        assert result[0]["metric"]["pool"] == "llama"
        assert float(result[0]["value"][1]) == 42.5
        gauge.labels(pool="llama").set(7)
        prometheus.wait_for('cacheroute_sandbox_probe{job="sandbox-probe"} == 7', timeout=30)
    finally:
        server.shutdown()
        thread.join(5)
    prometheus.close()
    assert "sandbox-probe" not in prometheus.scrape_jobs()


def test_invalid_scrape_target_is_refused_before_prometheus_sees_it() -> None:
    with pytest.raises(ValueError, match="not host:port"):
        ScrapeJob("broken", ["localhost"])


def test_remote_write_receiver_is_enabled(prometheus: ScopedPrometheus) -> None:
    # An empty body is not a snappy-compressed WriteRequest: the receiver rejects it as a bad
    # request, whereas a Prometheus without the receiver answers 404.
    response = httpx.post(prometheus.remote_write_url, content=b"", timeout=10)
    assert response.status_code == 400
