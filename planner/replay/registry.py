"""Policies by name, as the CLI and the benchmark select them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from cacheroute.planner.replay.guard import GuardSettings, ReplayGuard
from cacheroute.planner.replay.planned import (
    CACHEROUTE_ROUTING,
    CacheRoute,
    KeySeededP2C,
    PlannerSettings,
    RoutingSettings,
)
from cacheroute.planner.replay.policies import (
    BoundedConsistentHash,
    LeastLoaded,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
    StickyHash,
)
from cacheroute.planner.replay.policy import Policy
from cacheroute.planner.replay.prefix_policies import GiePrefixScorer, Preble, PrefixTree

PolicyFactory = Callable[[], Policy]
# The routing of the report (planned keys pinned, the rest on random p2c), and this project's routing
# before token-aware load (planned keys pinned, unplanned keys on key-seeded p2c); load in requests.
REPORT_ROUTING = RoutingSettings()
BEFORE_ROUTING = RoutingSettings()


def _variant(name: str) -> PolicyFactory:
    """The factory of a CacheRoute variant: `make_policy` builds it from `_CACHEROUTE_VARIANTS`."""
    return lambda: make_policy(name)


# name -> (factory, what it is)
POLICIES: dict[str, tuple[PolicyFactory, str]] = {
    "round-robin": (RoundRobin, "Flat-LB: destinations in turn"),
    "random": (RandomChoice, "uniform random"),
    "least-loaded": (LeastLoaded, "fewest in-flight requests"),
    "p2c": (PowerOfTwo, "power of two choices on in-flight requests"),
    "sticky-hash": (StickyHash, "hash(affinity key) mod N"),
    "key-p2c": (KeySeededP2C, "key-seeded p2c alone: the less loaded of the key's two ring candidates, no plan"),
    "chwbl": (BoundedConsistentHash, "KubeAI consistent hashing with bounded loads (256 replicas, 1.25)"),
    "prefix-tree": (PrefixTree, "SGLang cache_aware approximate prefix tree"),
    "gie-prefix": (GiePrefixScorer, "GIE EPP default scorers: prefix 3, queue 2, KV usage 2"),
    "preble": (Preble, "Preble E2 exploit/explore on a global prefix index"),
    "cacheroute": (
        CacheRoute,
        "planned prefix affinity, re-planned every control period; token-aware load; requests follow their "
        "longest routed prefix",
    ),
    "cacheroute-p2c": (
        _variant("cacheroute-p2c"),
        "planned keys pinned to their plan entry, everything else on random p2c, load in requests: as the report",
    ),
    "cacheroute-noplan": (
        lambda: CacheRoute(PlannerSettings(control_period_s=math.inf)),
        "cacheroute's routing with no plan ever (key-seeded p2c, following and scoring): what its guard degrades to",
    ),
    "cacheroute-guard": (
        _variant("cacheroute-guard"),
        "cacheroute, falling back to p2c for a period when the guard predicts no gain",
    ),
    "cacheroute-requests": (
        _variant("cacheroute-requests"),
        "cacheroute with load in requests only (no prompt tokens; router --tokens-per-load-unit 0)",
    ),
    "cacheroute-inflight": (
        _variant("cacheroute-inflight"),
        "cacheroute with a request in flight weighing as much as a queued one (router --in-flight-weight 1; "
        "the load before)",
    ),
    "cacheroute-widen": (
        _variant("cacheroute-widen"),
        "cacheroute with planned keys widened to their ring pair plus planned destinations (router --widen-planned)",
    ),
    "cacheroute-nofollow": (
        _variant("cacheroute-nofollow"),
        "cacheroute without the memory of routed prefixes (router --no-follow-prefixes)",
    ),
    "cacheroute-noscore": (
        _variant("cacheroute-noscore"),
        "cacheroute with unplanned requests kept to key-seeded p2c and following, never scored (the router "
        "before scoring)",
    ),
    "cacheroute-pinned": (
        _variant("cacheroute-pinned"),
        "cacheroute with planned keys held to their entry up to the spill bound whatever the plan's entry "
        "credit (before entry credits)",
    ),
    "cacheroute-before": (
        _variant("cacheroute-before"),
        "cacheroute as routed before token-aware load: load in requests, planned keys pinned, no prefix memory",
    ),
}
ALIASES = {"flat-lb": "round-robin", "rr": "round-robin", "sglang": "prefix-tree", "gie": "gie-prefix",
           "kubeai": "chwbl", "power-of-two": "p2c"}
BASELINES = ("round-robin", "random", "least-loaded", "p2c", "sticky-hash", "key-p2c", "chwbl", "prefix-tree",
             "gie-prefix", "preble")
CACHE_AWARE = ("prefix-tree", "gie-prefix", "preble")
# CacheRoute policies: (guarded, how unplanned keys are routed when not the settings' own, routing).
_CACHEROUTE_VARIANTS: dict[str, tuple[bool, str | None, RoutingSettings]] = {
    "cacheroute": (False, None, CACHEROUTE_ROUTING),
    "cacheroute-guard": (True, None, CACHEROUTE_ROUTING),
    "cacheroute-p2c": (False, "p2c", REPORT_ROUTING),
    "cacheroute-requests": (False, None, replace(CACHEROUTE_ROUTING, tokens_per_unit=0.0)),
    "cacheroute-inflight": (False, None, replace(CACHEROUTE_ROUTING, in_flight_weight=1.0)),
    "cacheroute-nofollow": (False, None, replace(CACHEROUTE_ROUTING, follow_prefixes=False)),
    "cacheroute-widen": (False, None, replace(CACHEROUTE_ROUTING, widen_planned=True)),
    "cacheroute-noscore": (False, None, replace(CACHEROUTE_ROUTING, score_unplanned=False)),
    "cacheroute-pinned": (False, None, replace(CACHEROUTE_ROUTING, credit_entries=False)),
    "cacheroute-before": (False, None, BEFORE_ROUTING),
}


def policy_names(spec: str) -> list[str]:
    """Parse a comma-separated policy list (`all` for every policy)."""
    raws = [raw.strip() for raw in spec.split(",")]
    if any(raws) and not all(raws):
        raise ValueError(f"policy list {spec!r} has an empty item (two commas in a row, or one at an end)")
    out: list[str] = []
    for raw in raws:
        name = raw.lower()
        if not name:
            continue
        if name == "all":
            out.extend(n for n in POLICIES if n not in out)
            continue
        name = ALIASES.get(name, name)
        if name not in POLICIES:
            raise ValueError(f"unknown policy {raw!r}; known: {', '.join(POLICIES)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("no policy given")
    return out


def make_policy(name: str, planner: PlannerSettings | None = None, guard: GuardSettings | None = None, *,
                slo_p99_ttft_s: float | None = None) -> Policy:
    """A fresh policy instance (policies keep per-run state). A guarded policy's guard holds plans
    to `slo_p99_ttft_s` when given, as the operator's holds them to the AffinityPlan's
    `spec.guard.p99Ttft`: judged against another objective than the one measured, a plan that
    triples p99 TTFT stays in effect while it is under the guard's default."""
    name = ALIASES.get(name, name)
    if name in _CACHEROUTE_VARIANTS:
        guarded, unplanned, routing = _CACHEROUTE_VARIANTS[name]
        settings = planner or PlannerSettings()
        if unplanned is not None:
            settings = replace(settings, unplanned=unplanned)
        guard_settings = guard or (GuardSettings() if guarded else None)
        if guard_settings is not None and slo_p99_ttft_s is not None:
            guard_settings = replace(guard_settings, slo_p99_ttft_s=slo_p99_ttft_s)
        return CacheRoute(settings=settings, guard=ReplayGuard(guard_settings) if guard_settings is not None else None,
                          routing=routing)
    try:
        factory = POLICIES[name][0]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory()
