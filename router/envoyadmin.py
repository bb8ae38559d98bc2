"""Envoy's admin API on the router pod's Unix socket (an emptyDir both containers mount).

The pod's preStop hooks drain Envoy through it (`drain.py`), and the picker's /metrics serves
Envoy's statistics read from it (`envoystats.py`); it listens on no port, so nothing outside the
pod reaches it.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

# The client listener's HTTP connection manager (`envoy.py`, stat_prefix "ingress").
ACTIVE_STAT = "http.ingress.downstream_rq_active"
_STAT_LINE = re.compile(rf"^{re.escape(ACTIVE_STAT)}: (\d+)$", re.MULTILINE)


class EnvoyAdmin:
    """A client of Envoy's admin API on `socket`; each call fails with `httpx.HTTPError` when
    Envoy does not answer within `timeout_s`."""

    def __init__(self, socket: Path, timeout_s: float = 2.0) -> None:
        self._client = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://envoy", timeout=timeout_s
        )

    def close(self) -> None:
        self._client.close()

    def drain_listeners(self) -> None:
        self._client.post("/drain_listeners", params={"graceful": ""}).raise_for_status()

    def in_flight(self) -> int:
        reply = self._client.get("/stats", params={"filter": f"^{re.escape(ACTIVE_STAT)}$"})
        reply.raise_for_status()
        found = _STAT_LINE.search(reply.text)
        return int(found.group(1)) if found else 0

    def prometheus_stats(self) -> bytes:
        """All of Envoy's statistics, in the Prometheus text format."""
        reply = self._client.get("/stats/prometheus")
        reply.raise_for_status()
        return reply.content
