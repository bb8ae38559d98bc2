"""Envoy's own statistics, served on the picker's /metrics: one scrape of a router pod sees both.

Requests Envoy answers itself never reach the picker: a body past its buffer (413), no endpoint
picked in fail-closed mode (503), an upstream reset or timeout. Only Envoy's statistics count
them, and its admin API listens on the pod's Unix socket alone. So each scrape of the picker reads
them there and appends them, as Envoy writes them (`envoy_*`, Envoy's own names, as its dashboards
expect), to the picker's series in the Prometheus text format. Every statistic is read, not only
those Envoy has used: a counter that first appeared at its first count (a rare 413) would not be
counted by `rate` or `increase`. `cacheroute_router_envoy_up` is 1 when Envoy answered that scrape,
0 when it did not (not started, restarting, stopped): then no `envoy_*` series is served, and the
picker's own are, within `timeout_s`.

The text is passed on, not parsed: about 100 KB (1,000 samples) per scrape, which parsing would
cost the picker's process about 12 ms of interpreter time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer

from cacheroute.router.envoyadmin import EnvoyAdmin

UP_METRIC = "cacheroute_router_envoy_up"
_UP_HEAD = (f"# HELP {UP_METRIC} 1 when the pod's Envoy answered this scrape's read of its statistics.\n"
            f"# TYPE {UP_METRIC} gauge\n")

# The format Envoy writes, named whatever the client library's latest is.
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class EnvoyStats:
    """The statistics of the Envoy whose admin socket is `socket`, as exposition text."""

    def __init__(self, socket: Path, timeout_s: float = 1.0) -> None:
        self._admin = EnvoyAdmin(socket, timeout_s=timeout_s)

    def exposition(self) -> bytes:
        """`cacheroute_router_envoy_up` and, when Envoy answered, its statistics."""
        try:
            text = self._admin.prometheus_stats()
        except httpx.HTTPError:
            # Refused or slow: the picker's own series are still worth serving.
            return f"{_UP_HEAD}{UP_METRIC} 0\n".encode()
        ending = b"" if text.endswith(b"\n") or not text else b"\n"
        return f"{_UP_HEAD}{UP_METRIC} 1\n".encode() + text + ending

    def close(self) -> None:
        self._admin.close()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


def serve_with_envoy(registry: CollectorRegistry, envoy: EnvoyStats, host: str, port: int) -> WSGIServer:
    """Serve `registry` and `envoy`'s statistics on /metrics (and /) from a daemon thread, in the
    Prometheus text format; the server's address tells the port bound."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: /metrics\n"]
        body = generate_latest(registry) + envoy.exposition()
        start_response("200 OK", [("Content-Type", TEXT_FORMAT), ("Content-Length", str(len(body)))])
        return [body]

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
