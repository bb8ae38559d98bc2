"""The PodDisruptionBudgets: voluntary evictions (node drains) take at most one replica, and one
router, at a time."""

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


def build_router_pdb(pool: names.PoolRef) -> dict[str, Any]:
    """A drain takes one router at a time: the others keep the pool routable (with one router,
    it may go, as a rollout of one would)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": names.metadata(pool, pool.router, "router"),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.selector(pool, "router")},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
