"""An Envoy bootstrap that puts the router in front of a pool (the standalone deployment).

A GIE gateway builds the equivalent itself from an InferencePool. Without one, this is the
Envoy to run: the ext_proc filter asks the router for an endpoint, an ORIGINAL_DST cluster
sends the request to the address in `x-gateway-destination-endpoint`, and a request that comes
through without that header (the router unreachable, `failure_mode_allow`) is routed to a
plain least-request cluster over the pool instead, so traffic keeps flowing.

ORIGINAL_DST takes a single address from the header: run the router with `--fallbacks 0`
behind this Envoy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from cacheroute.planner.plan import host_port

DESTINATION_HEADER = "x-gateway-destination-endpoint"
BODY_MODES = ("NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED")
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
# The router's gRPC server takes ext_proc messages up to this: a whole buffered body and its frame.
MAX_REQUEST_BYTES = 64 << 20


@dataclass(frozen=True)
class GatewayOptions:
    listen_address: str = "0.0.0.0"
    listen_port: int = 8080
    request_body_mode: str = "BUFFERED"
    response_body_mode: str = "NONE"
    response_header_mode: str = "SEND"
    # How long Envoy waits for one router reply before it fails open (in full-duplex mode the
    # headers reply waits for the whole request body).
    message_timeout: str = "5s"
    route_timeout: str = "600s"
    with_ext_proc: bool = True
    # When the router does not answer: let the request through (True) or fail it (False).
    failure_mode_allow: bool = True
    # Envoy's buffer per connection, the largest request body it holds for the picker in the
    # buffered body modes (past it Envoy answers 413). Envoy's own default, 1 MiB, refuses long
    # prompts a model accepts.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def _socket(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {"address": host.strip("[]"), "port_value": int(port)}


def _cluster(name: str, addresses: Sequence[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": _socket(a)}}} for a in addresses]}
            ],
        },
        **extra,
    }


def _ext_proc(options: GatewayOptions) -> dict[str, Any]:
    full_duplex_request = options.request_body_mode == "FULL_DUPLEX_STREAMED"
    full_duplex_response = options.response_body_mode == "FULL_DUPLEX_STREAMED"
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "cacheroute_router"}, "timeout": "10s"},
            "failure_mode_allow": options.failure_mode_allow,
            "message_timeout": options.message_timeout,
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": options.response_header_mode,
                "request_body_mode": options.request_body_mode,
                "response_body_mode": options.response_body_mode,
                # Envoy requires trailers to be sent in full-duplex streaming.
                "request_trailer_mode": "SEND" if full_duplex_request else "SKIP",
                "response_trailer_mode": "SEND" if full_duplex_response else "SKIP",
            },
        },
    }


def gateway_bootstrap(router: str, endpoints: Sequence[str], options: GatewayOptions | None = None) -> dict[str, Any]:
    """Bootstrap for an Envoy that routes through the router at `router` (ip:port) to `endpoints`."""
    options = options or GatewayOptions()
    for mode in (options.request_body_mode, options.response_body_mode):
        if mode not in BODY_MODES:
            raise ValueError(f"body mode {mode!r} is not one of {', '.join(BODY_MODES)}")
    if not 0 < options.max_request_bytes <= MAX_REQUEST_BYTES:
        raise ValueError(f"max request bytes {options.max_request_bytes} is not between 1 and {MAX_REQUEST_BYTES}")
    if not endpoints:
        raise ValueError("the fail-open cluster needs at least one endpoint")
    routes: list[dict[str, Any]] = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
            "route": {"cluster": "original_destination", "timeout": options.route_timeout},
        },
        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": options.route_timeout}},
    ]
    router_filter = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }
    clusters: list[dict[str, Any]] = [
        {
            "name": "original_destination",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "2s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        },
        _cluster("pool", endpoints, lb_policy="LEAST_REQUEST"),
    ]
    filters = [router_filter]
    if options.with_ext_proc:
        filters.insert(0, _ext_proc(options))
        http2 = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
        clusters.append(_cluster("cacheroute_router", [router], typed_extension_protocol_options=http2))
    else:
        routes = routes[1:]
        clusters = clusters[1:]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": filters,
    }
    listener = {
        "name": "ingress",
        "address": {"socket_address": {"address": options.listen_address, "port_value": options.listen_port}},
        "per_connection_buffer_limit_bytes": options.max_request_bytes,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}],
    }
    return {"static_resources": {"listeners": [listener], "clusters": clusters}}


@dataclass(frozen=True)
class PodEnvoyOptions:
    """The Envoy beside the picker in a router pod: everything binds the pod IP."""

    pod_ip: str
    listen_port: int = 8080
    health_port: int = 8081
    ext_proc_port: int = 9002
    # host:port resolved by DNS (the pool's headless Service) for requests that pass the
    # picker without a destination (failure_mode_allow); None answers those with 503.
    fallback: str | None = None
    admin_socket: str | None = None
    gateway: GatewayOptions = GatewayOptions()


def _health_listener(address: str, port: int) -> dict[str, Any]:
    """A listener answering GET /ready: Envoy has initialised and serves listeners."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "health",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "health",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"path": "/ready"},
                            "direct_response": {"status": 200, "body": {"inline_string": "ok"}},
                        },
                        {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    return {
        "name": "health",
        "address": {"socket_address": {"address": address, "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}],
    }


def pod_bootstrap(options: PodEnvoyOptions) -> dict[str, Any]:
    """Bootstrap of a router pod's Envoy: HTTP on the pod IP, ext_proc to the picker on the same IP.

    Built on `gateway_bootstrap`; the static fail-open cluster is replaced by DNS resolution of
    the pool's headless Service (pod addresses change), or dropped for a 503 when none is given.
    """
    ip = options.pod_ip
    gateway = replace(options.gateway, listen_address=ip, listen_port=options.listen_port)
    router = host_port(ip, options.ext_proc_port)
    document = gateway_bootstrap(router, ["127.0.0.1:1"], gateway)
    resources = document["static_resources"]
    clusters = [c for c in resources["clusters"] if c["name"] != "pool"]
    listener = resources["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    if options.fallback:
        host, _, port = options.fallback.rpartition(":")
        clusters.append(
            {
                "name": "pool",
                "type": "STRICT_DNS",
                "dns_lookup_family": "V4_PREFERRED",
                "lb_policy": "LEAST_REQUEST",
                "connect_timeout": "2s",
                "load_assignment": {
                    "cluster_name": "pool",
                    "endpoints": [
                        {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                            "address": host, "port_value": int(port)}}}}]}
                    ],
                },
            }
        )
    else:
        routes[-1] = {
            "match": {"prefix": "/"},
            "direct_response": {"status": 503, "body": {"inline_string": "no endpoint picked\n"}},
        }
    resources["clusters"] = clusters
    resources["listeners"].append(_health_listener(ip, options.health_port))
    if options.admin_socket:
        document["admin"] = {"address": {"pipe": {"path": options.admin_socket}}}
    return document
