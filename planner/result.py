"""A plan and the figures behind it (`PlanResult`), assembled from the four steps' outcomes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from cacheroute.planner.admission import Admission, Admitted, nothing_admitted_because
from cacheroute.planner.credit import entry_credit
from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.load import Demand, PinnedRoutes, dot
from cacheroute.planner.placement import Placer, predicted_load
from cacheroute.planner.plan import Destination, KeyExtraction, Plan, PlanSummary
from cacheroute.planner.stability import Stabilised

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
B = npt.NDArray[np.bool_]


@dataclass(frozen=True, eq=False)
class PlanResult:
    """A plan and the figures behind it, for the operator's status and the CLI.

    Per-key arrays are aligned with the rows of the input `KeyStats`; destination arrays with the
    input destinations. Loads are in destination-seconds per second (see `load.CostModel`);
    `objective` and `lower_bound` are normalised (load / weight).
    """

    plan: Plan
    routed: B  # per key: the plan routes it (admitted or pinned)
    admitted: B  # per key: admitted into the warm budget (routed unless no destination had room)
    pinned: B  # per key: routed because it is pinned
    replicas: I64  # per key: destinations wanted (0 when not routed)
    key_load: F64  # per key: expected load when served warm
    assignment_offsets: I64  # per key CSR into assignment_dests (empty when not routed)
    assignment_dests: I64  # destination indexes, preference order
    planned_load: F64  # per destination: load of routed keys
    spread_load: float  # load of everything routed by p2c (unkeyed and unrouted keys)
    destination_load: F64  # per destination: planned load plus the water-filled p2c share
    warm_budget: F64  # per destination: warm KV tokens available to planned keys
    warm_used: F64  # per destination: warm KV tokens the plan uses
    objective: float  # max normalised destination load
    lower_bound: float  # a lower bound on `objective` for the routed keys
    churn: float  # share of planned load on a destination that did not hold it before
    churn_forced: float  # part of `churn` caused by vanished destinations or lost room
    churn_voluntary: float  # part of `churn` chosen for balance (capped by stability.max_churn)
    kept_previous: bool  # the keep-in-place placement was chosen over a re-balance
    unplaced_keys: int  # admitted keys that found no destination with room
    under_replicated_keys: int  # routed keys on fewer destinations than wanted
    reason: str
    pinned_hashes: U64 = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    nothing_admitted: str | None = None  # why no key was admitted, when the input says so

    def destinations_of_key(self, row: int) -> tuple[str, ...]:
        """Destination ids of stats row `row` (empty when p2c routes it)."""
        lo, hi = int(self.assignment_offsets[row]), int(self.assignment_offsets[row + 1])
        return tuple(self.plan.destinations[int(d)].id for d in self.assignment_dests[lo:hi])


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


def _lower_bound(planned: F64, pinned_load: F64, per_replica: F64, weights: F64, spread: float) -> float:
    total = float(planned.sum()) + spread
    lb = total / float(weights.sum())
    if len(per_replica):
        lb = max(lb, float(per_replica.max()) / float(weights.max()))
    return max(lb, float(np.max(pinned_load / weights)))


def _route_columns(
    pin: PinnedRoutes, adm: Admitted, a_key: I64, a_dest: I64
) -> tuple[U64, I64, npt.NDArray[np.uint16]]:
    """The plan's columns (sorted hashes, CSR offsets, destinations) for pinned and placed keys.

    `a_key`/`a_dest` are the placed replicas sorted by key, each key's destinations in order.
    """
    placed = np.bincount(a_key, minlength=len(adm))
    routed = np.flatnonzero(placed > 0)
    hashes = np.concatenate([pin.hashes, adm.hashes[routed]])
    counts = np.concatenate([np.array([len(d) for d in pin.dests], dtype=np.int64), placed[routed].astype(np.int64)])
    flat = np.concatenate([np.array([d for ds in pin.dests for d in ds], dtype=np.int64), a_dest])
    srt = np.argsort(hashes, kind="stable")
    hs = hashes[srt]
    if len(hs) > 1 and bool(np.any(hs[1:] == hs[:-1])):
        i = int(np.flatnonzero(hs[1:] == hs[:-1])[0])
        raise PlanInputError(f"two keys share the affinity hash {int(hs[i]):016x}; rename one of them")
    starts = (np.cumsum(counts) - counts).astype(np.int64)
    route_counts = counts[srt]
    offsets = np.zeros(len(hs) + 1, dtype=np.int64)
    np.cumsum(route_counts, out=offsets[1:])
    gather = np.repeat(starts[srt] - offsets[:-1], route_counts) + np.arange(int(offsets[-1]), dtype=np.int64)
    return hs.astype(np.uint64), offsets, flat[gather].astype(np.uint16)


def _row_assignments(n: int, pin: PinnedRoutes, adm: Admitted, a_key: I64, a_dest: I64) -> tuple[I64, I64, I64]:
    """Per stats row: destinations (CSR offsets and indexes) and replicas wanted (0: p2c)."""
    placed = np.bincount(a_key, minlength=len(adm))
    replicas = np.zeros(n, dtype=np.int64)
    replicas[adm.rows[placed > 0]] = adm.replicas[placed > 0]
    count = np.zeros(n, dtype=np.int64)
    count[adm.rows] = placed
    keys = [adm.rows[a_key]]
    dests = [a_dest]
    for j, row in enumerate(pin.rows.tolist()):
        if row >= 0:
            replicas[row] = count[row] = len(pin.dests[j])
            keys.append(np.full(len(pin.dests[j]), row, dtype=np.int64))
            dests.append(np.array(pin.dests[j], dtype=np.int64))
    order = np.argsort(np.concatenate(keys), kind="stable")
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(count, out=offsets[1:])
    return offsets, np.concatenate(dests)[order], replicas


def plan_result(
    stats: KeyStats,
    destinations: Sequence[Destination],
    weights: F64,
    *,
    pool: str,
    demand: Demand,
    admission: Admission,
    placer: Placer,
    stable: Stabilised,
    generated_at: str,
    spill_threshold: float,
    key_extraction: KeyExtraction,
    credit: float | None = None,
) -> PlanResult:
    """The plan's routes, the loads as routed, and the summary saying what the steps did; the
    plan's entry credit is `credit`, or the planner's (`credit.entry_credit`) when None."""
    m = len(destinations)
    n = len(stats)
    dest_ids = [d.id for d in destinations]
    pin, adm = demand.pinned, admission.keys
    notes = list(demand.notes)
    prefixed = int(np.count_nonzero(stats.prefix_tokens > 0))
    empty = nothing_admitted_because(n, demand.warm_budget, admission.candidates, prefixed)
    notes += [text for text in (empty, stable.note) if text]

    a_key, a_dest = stable.key, stable.dest
    placed = np.bincount(a_key, minlength=len(adm))
    routed_adm = placed > 0
    unplaced = int(np.count_nonzero(~routed_adm))
    under = int(np.count_nonzero(routed_adm & (placed < adm.replicas)))
    if unplaced:
        notes.append(f"{unplaced} admitted keys found no destination with warm room and go to p2c")

    route_keys, route_offsets, route_dests = _route_columns(pin, adm, a_key, a_dest)
    asg_offsets, asg_dests, rep_out = _row_assignments(n, pin, adm, a_key, a_dest)
    admitted_mask = np.zeros(n, dtype=bool)
    admitted_mask[adm.rows] = True
    routed = pin.mask.copy()
    routed[adm.rows[routed_adm]] = True

    # Loads as routed: a key's load split evenly over the destinations it actually has.
    share = adm.per_replica * adm.replicas / np.maximum(placed, 1)
    planned = pin.load + np.bincount(a_dest, weights=share[a_key], minlength=m)
    spread = placer.spread(stable.placement)
    dest_load = predicted_load(planned, weights, spread)
    obj = float(np.max(dest_load / weights))
    lb = _lower_bound(planned, pin.load, share[routed_adm], weights, spread)
    used = pin.kv + (demand.room - stable.placement.room)
    wb = demand.warm_budget
    churn, churn_forced = stable.churn, stable.churn_forced

    total_rate = stats.total_rate
    total_tokens = stats.total_prompt_token_rate
    req_share = float(stats.rate[routed].sum()) / total_rate if total_rate > 0 else 0.0
    tok_share = dot(stats.rate[routed], stats.prompt_tokens[routed]) / total_tokens if total_tokens > 0 else 0.0
    hit = dot(stats.rate[routed], stats.prefix_tokens[routed]) / total_tokens if total_tokens > 0 else 0.0
    headline = (
        f"routed {len(route_keys)} keys ({len(pin.hashes)} pinned) of {n}: {_share(req_share)} of requests, "
        f"{_share(tok_share)} of prompt tokens; warm KV {float(used.sum()):.0f} of {float(wb.sum()):.0f} tokens; "
        f"max load {obj:.3f} (lower bound {lb:.3f}); churn {_share(churn)} (forced {_share(churn_forced)})"
    )
    if obj > 1.0:
        notes.append(f"predicted max destination load {obj:.2f} exceeds its capacity")
    if credit is None:
        credit = entry_credit(stats, destinations, admitted_mask)
    if credit < 1.0:
        notes.append(f"entries credited with {credit:.2f} of a prompt: most of what the plan saves comes from "
                     "keys cached wherever they go, so the router scores planned requests too")
    reason = "; ".join([headline, *notes])
    plan = Plan(
        pool=pool,
        destinations=tuple(destinations),
        route_keys=route_keys,
        route_offsets=route_offsets,
        route_dests=route_dests,
        generated_at=generated_at,
        spill_threshold=spill_threshold,
        key_extraction=key_extraction,
        pinned_keys=np.unique(pin.hashes).astype(np.uint64),
        entry_credit=credit,
        summary=PlanSummary(
            admitted_keys=len(route_keys),
            admitted_request_share=req_share,
            admitted_token_share=tok_share,
            churn=churn,
            predicted_load={dest_ids[i]: float(dest_load[i] / weights[i]) for i in range(m)},
            predicted_kv_hit=hit,
            reason=reason,
        ),
    )
    return PlanResult(
        plan=plan,
        routed=routed,
        admitted=admitted_mask,
        pinned=pin.mask,
        replicas=rep_out,
        key_load=demand.key_load,
        assignment_offsets=asg_offsets,
        assignment_dests=asg_dests,
        planned_load=planned,
        spread_load=spread,
        destination_load=dest_load,
        warm_budget=wb,
        warm_used=used,
        objective=obj,
        lower_bound=lb,
        churn=churn,
        churn_forced=churn_forced,
        churn_voluntary=churn - churn_forced,
        kept_previous=stable.kept_previous,
        unplaced_keys=unplaced,
        under_replicated_keys=under,
        reason=reason,
        pinned_hashes=pin.hashes,
        nothing_admitted=empty,
    )
