"""A Gateway API Inference Extension `InferencePool` pointing at our router, for GIE gateways.

Same name as our pool, different group (`inference.networking.k8s.io`). Its `status.parents` belong
to the gateway controller; the operator writes only spec.
"""

from __future__ import annotations

from typing import Any

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet import names

GIE_GROUP = "inference.networking.k8s.io"
GIE_VERSION = "v1"
GIE_PLURAL = "inferencepools"


def build_gie_pool(pool: names.PoolRef, spec: InferencePoolSpec) -> dict[str, Any]:
    return {
        "apiVersion": f"{GIE_GROUP}/{GIE_VERSION}",
        "kind": "InferencePool",
        "metadata": names.metadata(pool, pool.name, "router"),
        "spec": {
            "selector": {"matchLabels": names.selector(pool, "engine")},
            "targetPorts": [{"number": spec.engine.port}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": pool.router,
                "port": {"number": names.ROUTER_GRPC_PORT},
                "failureMode": spec.gie.failure_mode,
            },
        },
    }
