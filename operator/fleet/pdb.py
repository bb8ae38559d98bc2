"""The PodDisruptionBudget: voluntary evictions (node drains) take at most one replica at a time."""

from __future__ import annotations

from typing import Any

from cacheroute.operator.fleet import names


def build_pdb(pool: names.PoolRef) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": names.metadata(pool, pool.pdb, "engine"),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.selector(pool, "engine")},
            # A replica that never became ready may go: it serves nothing, and blocking its
            # eviction would stall node drains behind a broken pod.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
