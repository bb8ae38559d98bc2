"""The guard step: shadow-replay the window under the candidate, the plan in effect and no plan.

The replay is synthesised from the window's statistics (`guard_from_stats`), on one simulated
destination per destination of the candidate, with the pool's KV capacity on GPU and in host
memory. The plan in effect may still name destinations that have since left the pool; the replay
routes by what is left of it, as the router does (keys of a vanished destination spill). Every
replay routes as the pool's routers do (`routing_of`): with or without prefix following, with their
prefix memory.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cacheroute.operator.api.pool import RouterSpec
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.load import CostModel
from cacheroute.planner.plan import Plan
from cacheroute.planner.replay.guard import GuardSettings, GuardVerdict, guard_from_stats
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE, EngineProfile
from cacheroute.planner.replay.planned import CACHEROUTE_ROUTING, RoutingSettings


def restrict_plan(plan: Plan, destination_ids: tuple[str, ...]) -> Plan:
    """`plan` with only the destinations in `destination_ids`; keys left without one are dropped."""
    wanted = set(destination_ids)
    kept = [i for i, d in enumerate(plan.destinations) if d.id in wanted]
    if len(kept) == len(plan.destinations):
        return plan
    remap = np.full(len(plan.destinations), -1, dtype=np.int64)
    remap[kept] = np.arange(len(kept))
    counts = np.diff(plan.route_offsets)
    new_dest = remap[plan.route_dests.astype(np.int64)]
    alive = new_dest >= 0
    key_of = np.repeat(np.arange(len(plan.route_keys)), counts)
    new_counts = np.bincount(key_of[alive], minlength=len(plan.route_keys))
    has = new_counts > 0
    offsets = np.zeros(int(has.sum()) + 1, dtype=np.int64)
    np.cumsum(new_counts[has], out=offsets[1:])
    return Plan(
        pool=plan.pool,
        destinations=tuple(plan.destinations[i] for i in kept),
        route_keys=plan.route_keys[has],
        route_offsets=offsets,
        route_dests=new_dest[alive].astype(np.uint16),
        generated_at=plan.generated_at,
        spill_threshold=plan.spill_threshold,
        key_extraction=plan.key_extraction,
        summary=plan.summary,
    )


def engine_profile(kv_capacity_tokens: int, host_kv_capacity_tokens: int = 0) -> EngineProfile:
    """The replay's engine: the default timing model with the pool's KV capacity when known, and
    its host-memory tier."""
    profile = DEFAULT_PROFILE.with_kv_capacity(kv_capacity_tokens) if kv_capacity_tokens > 0 else DEFAULT_PROFILE
    if host_kv_capacity_tokens > 0:
        profile = replace(profile, host_kv_capacity_tokens=host_kv_capacity_tokens)
    return profile


def plan_cost(kv_capacity_tokens: int, host_kv_capacity_tokens: int) -> CostModel:
    """The planner's cost model on the guard's engine: a prefix held in the host-memory tier is
    valued net of the copy back, as the replay's CacheRoute values it."""
    copy = engine_profile(kv_capacity_tokens, host_kv_capacity_tokens).host_copy_s_per_token
    return CostModel(host_copy_s_per_token=copy)


def run_guard(
    stats: KeyStats,
    candidate: Plan,
    current: Plan | None,
    *,
    settings: GuardSettings,
    duration_s: float,
    kv_capacity_tokens: int,
    host_kv_capacity_tokens: int = 0,
    routing: RoutingSettings = CACHEROUTE_ROUTING,
) -> GuardVerdict:
    """The verdict on `candidate` (blocking: run it off the event loop), every plan and the
    baseline without a plan routed by `routing`: the pool's routers' settings."""
    ids = tuple(d.id for d in candidate.destinations)
    current_here = restrict_plan(current, ids) if current is not None else None
    if current_here is not None and not current_here.destinations:
        current_here = None
    return guard_from_stats(
        stats,
        candidate,
        current_here,
        duration_s=duration_s,
        profile=engine_profile(kv_capacity_tokens, host_kv_capacity_tokens),
        settings=settings,
        routing=routing,
    )


def routing_of(router: RouterSpec) -> RoutingSettings:
    """The replay's routing rule for routers run with `router`'s settings."""
    return replace(CACHEROUTE_ROUTING, follow_prefixes=router.follow_prefixes,
                   prefix_memory_blocks=router.prefix_memory_blocks)
