"""Shadow replay: a trace replayed, event by event, through a routing policy onto a modelled vLLM fleet.

    from cacheroute.planner.replay import ReplayConfig, make_policy, replay_trace, summarize
    metrics = summarize(replay_trace(trace, make_policy("cacheroute"), ReplayConfig(destinations=30)))

The operator's guard is `guard(window_trace, candidate_plan, current_plan)`, or
`guard_from_stats(key_stats, candidate_plan, current_plan)` from Prometheus statistics; capacity searches
are `find_capacity(trace, lambda: make_policy(name), config)`. See docs/replay.md.
"""

from cacheroute.planner.replay.capacity import CapacityResult, Probe, find_capacity, replay_at
from cacheroute.planner.replay.guard import GuardSettings, GuardVerdict, guard, guard_from_stats
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE, PROFILES, EngineProfile, get_profile
from cacheroute.planner.replay.metrics import ReplayMetrics, summarize
from cacheroute.planner.replay.planned import CacheRoute, Planned, PlannerSettings
from cacheroute.planner.replay.policy import Policy, RouterView
from cacheroute.planner.replay.registry import POLICIES, make_policy, policy_names
from cacheroute.planner.replay.run import ReplayConfig, ReplayResult, destination_ids, replay_trace
from cacheroute.planner.replay.window import window_from_stats

__all__ = [
    "DEFAULT_PROFILE",
    "POLICIES",
    "PROFILES",
    "CacheRoute",
    "CapacityResult",
    "EngineProfile",
    "GuardSettings",
    "GuardVerdict",
    "Planned",
    "PlannerSettings",
    "Policy",
    "Probe",
    "ReplayConfig",
    "ReplayMetrics",
    "ReplayResult",
    "RouterView",
    "destination_ids",
    "find_capacity",
    "get_profile",
    "guard",
    "guard_from_stats",
    "make_policy",
    "policy_names",
    "replay_at",
    "replay_trace",
    "summarize",
    "window_from_stats",
]
