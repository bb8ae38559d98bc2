"""The pool's Services: a headless one listing the destinations, one in front of the routers."""

from __future__ import annotations

from typing import Any

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet import names


def build_headless_service(pool: names.PoolRef, spec: InferencePoolSpec) -> dict[str, Any]:
    """Its EndpointSlices are the routers' view of destination addresses and readiness."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(pool, pool.headless_service, "engine"),
        "spec": {
            "clusterIP": "None",
            "selector": names.selector(pool, "engine"),
            "publishNotReadyAddresses": False,
            "ports": [
                {
                    "name": names.ENGINE_PORT_NAME,
                    "port": spec.engine.port,
                    "targetPort": names.ENGINE_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def build_router_service(pool: names.PoolRef) -> dict[str, Any]:
    """Clients send HTTP to 8080; GIE gateways call the picker's ext_proc on 9002 directly."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(pool, pool.router, "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector(pool, "router"),
            "ports": [
                {"name": "http", "port": names.ROUTER_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": "grpc-ext-proc",
                    "port": names.ROUTER_GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
            ],
        },
    }
