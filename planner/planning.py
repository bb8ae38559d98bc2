"""One control period of planning, in the method's four steps.

    result = compute_plan(stats, destinations, pool="llama")
    payload = encode_plan(result.plan)

1. Load and replicas (`load.py`): what each key costs warm and on how many destinations; pinned
   routes take their load and warm room first.
2. Admission (`admission.py`): the keys that save the most prefill per KV token, into the room left.
3. Placement (`placement.py`): admitted replicas onto destinations, longest first.
4. Stability (`stability.py`): the previous plan's placement stays unless moving pays.

The planner is pure and deterministic: the same input gives the same plan bytes. Bad input
raises `PlanInputError`; input with nothing to plan (no keys, no warm budget) gives a plan with
the pinned routes only, and `summary.reason` says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cacheroute.planner.admission import admit
from cacheroute.planner.inputs import checked_weights
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.load import CostModel, key_demand
from cacheroute.planner.placement import placer_for
from cacheroute.planner.plan import Destination, KeyExtraction, Plan
from cacheroute.planner.result import PlanResult, plan_result
from cacheroute.planner.routing import DEFAULT_SPILL_THRESHOLD
from cacheroute.planner.settings import Budget, Stability
from cacheroute.planner.stability import stabilise

__all__ = ["PlanResult", "compute_plan"]


def compute_plan(
    stats: KeyStats,
    destinations: Sequence[Destination],
    *,
    pool: str,
    budget: Budget | None = None,
    stability: Stability | None = None,
    cost: CostModel | None = None,
    previous: Plan | None = None,
    pinned: Mapping[str, Sequence[str]] | None = None,
    generated_at: str = "",
    key_extraction: KeyExtraction | None = None,
    spill_threshold: float = DEFAULT_SPILL_THRESHOLD,
    credit: float | None = None,
) -> PlanResult:
    """Plan one control period for `pool` (see the module docstring)."""
    budget, stability, cost = budget or Budget(), stability or Stability(), cost or CostModel()
    pinned = {} if pinned is None else pinned
    weights = checked_weights(
        stats, destinations=destinations, pool=pool, previous=previous, pinned=pinned, spill_threshold=spill_threshold
    )
    demand = key_demand(stats, destinations, weights=weights, pinned=pinned, budget=budget, cost=cost)
    admission = admit(
        stats,
        key_load=demand.key_load,
        replicas=demand.replicas,
        room=demand.room,
        pinned=demand.pinned.mask,
        previous=previous,
        stability=stability,
        cost=cost,
    )
    placer = placer_for(admission.keys, demand, stats, cost, weights)
    dest_ids = [d.id for d in destinations]
    stable = stabilise(placer, previous, dest_ids, stability, pinned_load=float(demand.pinned.key_load.sum()))
    return plan_result(
        stats,
        destinations,
        weights,
        pool=pool,
        demand=demand,
        admission=admission,
        placer=placer,
        stable=stable,
        generated_at=generated_at,
        spill_threshold=spill_threshold,
        key_extraction=key_extraction or KeyExtraction(),
        credit=credit,
    )
