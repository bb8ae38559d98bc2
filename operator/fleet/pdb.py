"""The PodDisruptionBudgets: voluntary evictions (node drains) take at most one replica, and one
router, at a time."""

from __future__ import annotations

from typing import Any

from cacheroute.operator.fleet import names


def build_pdb(pool: names.PoolRef) -> dict[str, Any]:
    return _one_at_a_time(pool, pool.pdb, "engine")


def build_router_pdb(pool: names.PoolRef) -> dict[str, Any]:
    """The other routers keep the pool routable (with one router, it may go, as a rollout of one would)."""
    return _one_at_a_time(pool, pool.router, "router")


def _one_at_a_time(pool: names.PoolRef, name: str, component: names.Component) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": names.metadata(pool, name, component),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.selector(pool, component)},
            # A pod that never became ready may go: it serves nothing, and blocking its eviction
            # would stall node drains behind a broken pod.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
