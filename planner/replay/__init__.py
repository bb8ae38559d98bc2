"""Shadow replay: a discrete-event simulator of a vLLM fleet behind a routing policy.

    from cacheroute.planner.replay import SimConfig, make_policy, simulate, summarize
    metrics = summarize(simulate(trace, make_policy("cacheroute"), SimConfig(destinations=30)))

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
from cacheroute.planner.replay.simulator import SimConfig, SimResult, destination_ids, simulate
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
    "ReplayMetrics",
    "RouterView",
    "SimConfig",
    "SimResult",
    "destination_ids",
    "find_capacity",
    "get_profile",
    "guard",
    "guard_from_stats",
    "make_policy",
    "policy_names",
    "replay_at",
    "simulate",
    "summarize",
    "window_from_stats",
]
