"""Envoy's own statistics, served on the picker's /metrics: one scrape of a router pod sees both.

Requests Envoy answers itself never reach the picker: a body past its buffer (413), no endpoint
picked in fail-closed mode (503), an upstream reset or timeout. Only Envoy's statistics count
them, and its admin API listens on the pod's Unix socket alone. So each scrape of the picker reads
them there and serves them as Envoy names them (`envoy_*`; counters get the `_total` suffix
Prometheus' client library gives every counter). `cacheroute_router_envoy_up` is 1 when Envoy
answered that scrape, 0 when it did not (not started, restarting, or stopped): then no `envoy_*`
series is served, and the picker's own are, without delay past `timeout_s`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from cacheroute.router.envoyadmin import EnvoyAdmin

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

UP_METRIC = "cacheroute_router_envoy_up"


class EnvoyStats:
    """A Prometheus collector of the statistics of the Envoy whose admin socket is `socket`."""

    def __init__(self, socket: Path, timeout_s: float = 1.0) -> None:
        self._admin = EnvoyAdmin(socket, timeout_s=timeout_s)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(UP_METRIC, "1 when the pod's Envoy answered this scrape's read of its statistics.")
        try:
            families = list(text_string_to_metric_families(self._admin.prometheus_stats()))
        except (httpx.HTTPError, ValueError):
            # Refused, slow, or not parseable: the picker's own series are still worth serving.
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def close(self) -> None:
        self._admin.close()
