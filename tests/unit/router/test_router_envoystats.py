"""The picker's /metrics with the pod's Envoy's statistics: without an Envoy to read, the picker's
own series are still served, and say so (the statistics of a real Envoy: the sidecar integration test)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.metrics import RouterMetrics


def test_without_envoy_the_pickers_series_are_served_at_once_and_envoy_up_is_0(tmp_path: Path) -> None:
    metrics = RouterMetrics(EndpointPool(scraping=False), sketch_size=16, export_key_names=False,
                            envoy_admin_socket=tmp_path / "no-envoy.sock")
    Counter("probe", "a series of the picker's", registry=metrics.registry).inc(3)
    server = metrics.serve("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        started = time.monotonic()
        # Asked for OpenMetrics, as Prometheus asks first: the text format Envoy's lines are valid in.
        reply = httpx.get(f"{url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert time.monotonic() - started < 1.0
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
        families = {f.name: f for f in text_string_to_metric_families(reply.text)}
        assert [s.value for s in families["cacheroute_router_envoy_up"].samples] == [0.0]
        assert [s.value for s in families["probe"].samples if s.name == "probe_total"] == [3.0]
        assert not [name for name in families if name.startswith("envoy_")]
        assert httpx.get(f"{url}/").status_code == 200
        assert httpx.get(f"{url}/debug").status_code == 404
    finally:
        server.shutdown()
        server.server_close()
        assert metrics.envoy is not None
        metrics.envoy.close()
