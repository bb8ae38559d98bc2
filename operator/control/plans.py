"""Plans the loop builds or compares: Manual plans from `spec.pinned`, routing equality, and the
check that a payload decodes back to the plan it encodes before any router can read it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from cacheroute.operator.api.plan import AffinityPlanSpec
from cacheroute.planner.plan import Destination, KeyExtraction, Plan, PlanError, PlanSummary, affinity_key_hash
from cacheroute.planner.plan import plan_from_routes as _plan_from_routes
from cacheroute.planner.plan_format import PlanPayload, decode_plan


def manual_plan(
    spec: AffinityPlanSpec,
    destinations: Sequence[Destination],
    *,
    pool: str,
    generated_at: str,
    key_extraction: KeyExtraction,
    spill_threshold: float,
) -> Plan:
    """Exactly the pinned routes of `spec`, keys hashed (never in clear)."""
    return pinned_plan(
        {p.key: list(p.destinations) for p in spec.pinned},
        destinations,
        pool=pool,
        generated_at=generated_at,
        key_extraction=key_extraction,
        spill_threshold=spill_threshold,
        reason=f"{len(spec.pinned)} pinned routes from spec.pinned (mode Manual)",
    )


def pinned_plan(
    pins: Mapping[str, Sequence[str]],
    destinations: Sequence[Destination],
    *,
    pool: str,
    generated_at: str,
    key_extraction: KeyExtraction,
    spill_threshold: float,
    reason: str,
) -> Plan:
    """A plan of these pinned routes alone (clear key -> destination ids), keys hashed."""
    routes = {affinity_key_hash(key): list(ids) for key, ids in pins.items()}
    if len(routes) != len(pins):
        raise PlanError("two pinned keys share one affinity hash; rename one of them")
    summary = PlanSummary(admitted_keys=len(routes), reason=reason)
    return _plan_from_routes(
        pool,
        destinations,
        routes,
        # Pinned in the header too: routers hold these keys to their routes rather than follow a
        # key's earlier prompts to wherever they went.
        pinned=True,
        generated_at=generated_at,
        spill_threshold=spill_threshold,
        key_extraction=key_extraction,
        summary=summary,
    )


def _route_ids(plan: Plan) -> np.ndarray:
    ids = np.array([d.id for d in plan.destinations] or [""], dtype=object)
    return ids[plan.route_dests.astype(np.int64)] if len(plan.route_dests) else np.zeros(0, dtype=object)


def same_routing(a: Plan | None, b: Plan | None, *, addresses: bool = True) -> bool:
    """Whether two plans route every request alike (summaries and generation times aside);
    with `addresses=False`, alike but for the destinations' addresses."""
    if a is None or b is None:
        return a is b
    if addresses:
        a_dests = {(d.id, d.address) for d in a.destinations}
        b_dests = {(d.id, d.address) for d in b.destinations}
    else:
        a_dests, b_dests = {(d.id, "") for d in a.destinations}, {(d.id, "") for d in b.destinations}
    if (
        a.pool != b.pool
        or a.spill_threshold != b.spill_threshold
        or a.key_extraction != b.key_extraction
        or a_dests != b_dests
        or len(a) != len(b)
    ):
        return False
    return bool(
        np.array_equal(a.route_keys, b.route_keys)
        and np.array_equal(a.route_offsets, b.route_offsets)
        and np.array_equal(_route_ids(a), _route_ids(b))
        and np.array_equal(a.pinned_keys, b.pinned_keys)
    )


def check_payload(plan: Plan, payload: PlanPayload) -> None:
    """Raise PlanError unless `payload` decodes (hashes verified) to exactly `plan`'s routes."""
    decoded = decode_plan(payload.files)
    if not same_routing(plan, decoded):
        raise PlanError(f"plan {payload.version} does not decode back to the routes it encodes")


def pins_alone(plan: Plan | None) -> bool:
    """Whether `plan` routes no key but pinned ones (or none): replacing it loses no computed route."""
    return plan is None or len(plan.pinned_keys) == len(plan)


def pinned_only(plan: Plan, reason: str) -> Plan:
    """`plan` with its pinned routes alone (the routers route every other key as without a plan)."""
    pinned = set(plan.pinned_keys.tolist())
    return _plan_from_routes(
        plan.pool,
        plan.destinations,
        {k: v for k, v in plan.routes().items() if k in pinned},
        pinned=True,
        generated_at=plan.generated_at,
        spill_threshold=plan.spill_threshold,
        key_extraction=plan.key_extraction,
        summary=PlanSummary(admitted_keys=len(pinned), reason=reason),
    )
