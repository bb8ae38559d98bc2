"""One control period of planning: pinned routes, admission, placement, stability, the Plan.

    result = compute_plan(stats, destinations, pool="llama")
    payload = encode_plan(result.plan)

The planner is pure and deterministic: the same input gives the same plan bytes. Bad input
raises `PlanInputError`; input with nothing to plan (no keys, no warm budget) gives a plan with
the pinned routes only, and `summary.reason` says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from cacheroute.planner.admission import eligible_keys, greedy_admit, value_per_token
from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, affinity_key_hashes
from cacheroute.planner.load import (
    CostModel,
    cold_load,
    dot,
    replicas_needed,
    total_cold_load,
    unkeyed_load,
    warm_load,
)
from cacheroute.planner.placement import lpt_place, objective, predicted_load
from cacheroute.planner.plan import Destination, KeyExtraction, Plan, PlanSummary
from cacheroute.planner.settings import Budget, Stability
from cacheroute.planner.stability import (
    KeptRoutes,
    PreviousRoutes,
    choose_unstick,
    keep_previous,
    moved_replicas,
    previous_routes,
)

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
B = npt.NDArray[np.bool_]

# Destination indexes travel as uint16; one value is kept free as a sentinel.
MAX_DESTINATIONS = 65_535


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

    def destinations_of_key(self, row: int) -> tuple[str, ...]:
        """Destination ids of stats row `row` (empty when p2c routes it)."""
        lo, hi = int(self.assignment_offsets[row]), int(self.assignment_offsets[row + 1])
        return tuple(self.plan.destinations[int(d)].id for d in self.assignment_dests[lo:hi])


def _check_destinations(destinations: Sequence[Destination]) -> tuple[F64, F64]:
    if not len(destinations):
        raise PlanInputError("destinations is empty: a plan needs at least one destination")
    if len(destinations) > MAX_DESTINATIONS:
        raise PlanInputError(f"destinations has {len(destinations)} entries, at most {MAX_DESTINATIONS} are supported")
    seen: set[str] = set()
    for i, d in enumerate(destinations):
        if not isinstance(d, Destination):
            raise PlanInputError(f"destinations[{i}] is a {type(d).__name__}, expected Destination")
        if not d.id:
            raise PlanInputError(f"destinations[{i}].id is empty")
        if d.id in seen:
            raise PlanInputError(f"destinations[{i}].id {d.id!r} appears more than once")
        seen.add(d.id)
        if not (isinstance(d.weight, int | float) and math.isfinite(d.weight) and d.weight > 0):
            raise PlanInputError(f"destinations[{i}] ({d.id}) weight is {d.weight!r}: must be finite and > 0")
        cap = d.kv_capacity_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise PlanInputError(
                f"destinations[{i}] ({d.id}) kv_capacity_tokens is {d.kv_capacity_tokens!r}: must be an integer >= 0"
            )
    weights = np.array([float(d.weight) for d in destinations], dtype=np.float64)
    kv = np.array([float(d.kv_capacity_tokens) for d in destinations], dtype=np.float64)
    return weights, kv


def warm_budget(destinations: Sequence[Destination], budget: Budget) -> F64:
    """Warm KV tokens per destination: the fixed number (within KV capacity when known), or auto."""
    kv = np.array([float(d.kv_capacity_tokens) for d in destinations], dtype=np.float64)
    if budget.warm_tokens_per_destination == "auto":
        return np.floor(kv * budget.auto_fraction)
    fixed = float(budget.warm_tokens_per_destination)
    return np.where(kv > 0, np.minimum(kv, fixed), fixed)


@dataclass(frozen=True, eq=False)
class _Pinned:
    rows: I64  # stats row per pinned key, -1 when the key has no statistics
    hashes: U64
    dests: list[list[int]]
    load: F64  # per destination
    kv: F64  # per destination
    mask: B  # per stats row
    key_load: F64  # per pinned key


def _pinned(
    pinned: Mapping[str, Sequence[str]],
    stats: KeyStats,
    key_load: F64,
    dest_ids: list[str],
    budget: Budget,
) -> _Pinned:
    m = len(dest_ids)
    index = {d: i for i, d in enumerate(dest_ids)}
    names = list(pinned)
    rows = np.full(len(names), -1, dtype=np.int64)
    mask = np.zeros(len(stats), dtype=bool)
    load = np.zeros(m, dtype=np.float64)
    kv = np.zeros(m, dtype=np.float64)
    plist: list[list[int]] = []
    row_of = {k: i for i, k in enumerate(stats.names)} if names else {}
    pload = np.zeros(len(names), dtype=np.float64)
    for j, name in enumerate(names):
        ids = pinned[name]
        if not isinstance(name, str) or not name:
            raise PlanInputError(f"pinned key {name!r} must be a non-empty string")
        if isinstance(ids, str) or not len(ids):
            raise PlanInputError(f"pinned[{name!r}] must list at least one destination id, got {ids!r}")
        if len(ids) > budget.max_destinations_per_key:
            raise PlanInputError(
                f"pinned[{name!r}] lists {len(ids)} destinations, more than "
                f"budget.max_destinations_per_key={budget.max_destinations_per_key}"
            )
        unknown = [d for d in ids if d not in index]
        if unknown:
            raise PlanInputError(
                f"pinned[{name!r}] names destination {unknown[0]!r}, which is not in the pool "
                f"(known: {', '.join(dest_ids[:8])}{', ...' if m > 8 else ''})"
            )
        if len(set(ids)) != len(ids):
            raise PlanInputError(f"pinned[{name!r}] lists a destination twice: {list(ids)!r}")
        dl = [index[d] for d in ids]
        plist.append(dl)
        row = row_of.get(name, -1)
        rows[j] = row
        if row >= 0:
            mask[row] = True
            pload[j] = float(key_load[row])
            load[dl] += pload[j] / len(dl)
            kv[dl] += float(stats.prefix_tokens[row])
    return _Pinned(rows, affinity_key_hashes(names), plist, load, kv, mask, pload)


@dataclass(frozen=True, eq=False)
class _Admitted:
    """The admitted keys, by ascending stats row, with what placement needs of each."""

    rows: I64
    hashes: U64
    replicas: I64
    prefix: F64
    per_replica: F64  # load of one replica
    priority: F64  # value per KV token (who keeps warm room first)
    cold: F64  # load if routed by p2c instead

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def planned_load(self) -> float:
        return dot(self.replicas, self.per_replica)


@dataclass(frozen=True, eq=False)
class _Assignment:
    """Replica placements of admitted keys (`key` indexes `_Admitted`) and the fleet after them."""

    key: I64
    dest: I64
    planned: F64  # per destination, including pinned
    room: F64  # warm room left per destination


def _items(counts: I64) -> I64:
    """Group id of each item when group g needs counts[g] items."""
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


@dataclass(frozen=True, eq=False)
class _Placer:
    """Places admitted keys on top of the pinned routes, and scores the result."""

    adm: _Admitted
    weights: F64
    base: F64  # pinned load per destination
    room: F64  # warm room per destination after pinned routes
    unrouted_cold: float  # p2c load of keys that are neither admitted nor pinned
    unkeyed: float  # p2c load of traffic without a key

    def assign(self, kept: KeptRoutes, unstuck_rows: I64 | None = None) -> _Assignment:
        """Kept replicas stay; forced re-placements go first, then new and unstuck replicas."""
        adm = self.adm
        n_keys = len(adm)
        k_key, k_dest = kept.key, kept.dest
        missing = kept.missing.copy()
        if unstuck_rows is not None and len(unstuck_rows):
            stay = np.ones(len(k_key), dtype=bool)
            stay[unstuck_rows] = False
            missing += np.bincount(k_key[unstuck_rows], minlength=n_keys)
            k_key, k_dest = k_key[stay], k_dest[stay]
        m = len(self.weights)
        planned = self.base + np.bincount(k_dest, weights=adm.per_replica[k_key], minlength=m)
        left = self.room - np.bincount(k_dest, weights=adm.prefix[k_key], minlength=m)
        # Keys that keep some replicas and need more must avoid the destinations they keep.
        taken: dict[int, set[int]] = {}
        if len(k_key):
            partial = np.flatnonzero((missing > 0) & (np.bincount(k_key, minlength=n_keys) > 0))
            if len(partial):
                sel = np.isin(k_key, partial)
                for g, d in zip(k_key[sel].tolist(), k_dest[sel].tolist(), strict=True):
                    taken.setdefault(g, set()).add(d)
        first = np.where(kept.forced > 0, missing, 0)
        keys_out, dests_out = [k_key], [k_dest]
        for need in (first, missing - first):
            if not int(need.sum()):
                continue
            groups = _items(need)
            res = lpt_place(
                adm.per_replica[groups],
                adm.prefix[groups],
                groups,
                weights=self.weights,
                base_load=planned,
                room=left,
                taken=taken,
            )
            ok = res.dest >= 0
            keys_out.append(groups[ok])
            dests_out.append(res.dest[ok])
            planned, left = res.load, res.room
        return _Assignment(np.concatenate(keys_out), np.concatenate(dests_out), planned, left)

    def spread(self, a: _Assignment) -> float:
        """Load routed by p2c: unkeyed traffic, keys not routed, and admitted keys left unplaced."""
        placed = np.bincount(a.key, minlength=len(self.adm)) > 0
        return self.unkeyed + self.unrouted_cold + float(self.adm.cold[~placed].sum())

    def objective(self, a: _Assignment) -> float:
        return objective(a.planned, self.weights, self.spread(a))


def _no_previous(replicas: I64) -> KeptRoutes:
    empty = np.zeros(0, dtype=np.int64)
    return KeptRoutes(empty, empty, replicas.copy(), np.zeros(len(replicas), dtype=np.int64))


def _stabilise(
    placer: _Placer, kept: KeptRoutes, stability: Stability, churn_cap: float
) -> tuple[_Assignment, bool, list[str]]:
    """The keep-in-place assignment, or a re-balanced one when it gains more than `min_gain`."""
    keep = placer.assign(kept)
    if not len(kept.key):
        return keep, False, []
    share = _fmt_share
    obj_keep = placer.objective(keep)
    fresh = placer.assign(_no_previous(placer.adm.replicas))
    obj_fresh = placer.objective(fresh)
    gain = (obj_keep - obj_fresh) / obj_keep if obj_keep > 0 else 0.0
    if gain <= stability.min_gain:
        why = f"a fresh placement gains {share(max(gain, 0.0))}, below min gain {share(stability.min_gain)}"
        return keep, True, [f"kept previous placement: {why}"]
    if churn_cap <= 0:
        return keep, True, [f"kept previous placement: max churn is 0 (a fresh placement would gain {share(gain)})"]
    adm = placer.adm
    m = len(placer.weights)
    kept_load = placer.base + np.bincount(kept.dest, weights=adm.per_replica[kept.key], minlength=m)
    rows = choose_unstick(
        kept.dest,
        adm.per_replica[kept.key],
        kept_load=kept_load,
        weights=placer.weights,
        target=obj_fresh,
        ceiling=obj_keep,
        cap=churn_cap,
    )
    if len(rows):
        moved = placer.assign(kept, rows)
        obj_moved = placer.objective(moved)
        if obj_keep - obj_moved > stability.min_gain * obj_keep:
            note = f"re-balanced: max load {obj_keep:.3f} -> {obj_moved:.3f} (fresh placement: {obj_fresh:.3f})"
            return moved, False, [note]
    return (
        keep,
        True,
        [f"kept previous placement: moves within the churn cap would not gain {share(stability.min_gain)}"],
    )


def _lower_bound(planned: F64, pinned_load: F64, per_replica: F64, weights: F64, spread: float) -> float:
    total = float(planned.sum()) + spread
    lb = total / float(weights.sum())
    if len(per_replica):
        lb = max(lb, float(per_replica.max()) / float(weights.max()))
    return max(lb, float(np.max(pinned_load / weights)))


def _member(values: U64, sorted_keys: U64) -> B:
    """Which `values` occur in the sorted, unique `sorted_keys`."""
    if not len(sorted_keys):
        return np.zeros(len(values), dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_keys, values), len(sorted_keys) - 1)
    return np.asarray(sorted_keys[pos] == values)


def _fmt_share(x: float) -> str:
    return f"{100 * x:.1f}%"


def _admit(
    stats: KeyStats,
    *,
    key_load: F64,
    replicas: I64,
    room: F64,
    pinned: B,
    previous: Plan | None,
    stability: Stability,
    cost: CostModel,
) -> tuple[_Admitted, int]:
    """Admit keys into the warm room; returns them and the number of eligible candidates."""
    density = value_per_token(stats.rate, replicas)
    kv_cost = stats.prefix_tokens * replicas
    candidates = np.flatnonzero(eligible_keys(stats.rate, stats.prefix_tokens, replicas, room, pinned))
    total_room = float(room.sum())
    admitted = greedy_admit(candidates, density, kv_cost, total_room)
    if previous is not None and len(previous) and stability.min_gain > 0 and len(admitted):
        # Incumbents get a head start; only keys that could reach the cut with it need hashing.
        cut = float(density[admitted].min())
        band = candidates[density[candidates] >= cut / (1 + stability.min_gain)]
        band_hashes = stats.hashes_of(band)
        boosted = density.copy()
        boosted[band[_member(band_hashes, previous.route_keys)]] *= 1 + stability.min_gain
        admitted = np.sort(greedy_admit(band, boosted, kv_cost, total_room))
        # `band` is ascending, so each admitted row finds its hash by bisection.
        hashes = band_hashes[np.searchsorted(band, admitted)]
    else:
        admitted = np.sort(admitted)
        hashes = stats.hashes_of(admitted)
    reps = replicas[admitted]
    adm = _Admitted(
        rows=admitted,
        hashes=hashes,
        replicas=reps,
        prefix=stats.prefix_tokens[admitted],
        per_replica=key_load[admitted] / reps,
        priority=density[admitted],
        cold=cold_load(stats, cost, admitted),
    )
    return adm, len(candidates)


def _route_columns(pin: _Pinned, adm: _Admitted, a_key: I64, a_dest: I64) -> tuple[U64, I64, npt.NDArray[np.uint16]]:
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


def _row_assignments(n: int, pin: _Pinned, adm: _Admitted, a_key: I64, a_dest: I64) -> tuple[I64, I64, I64]:
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


def _check_inputs(
    stats: KeyStats,
    *,
    destinations: Sequence[Destination],
    pool: str,
    previous: Plan | None,
    pinned: object,
    spill_threshold: float,
) -> F64:
    if not isinstance(pool, str) or not pool:
        raise PlanInputError(f"pool is {pool!r}: a plan needs the pool name")
    if not isinstance(stats, KeyStats):
        raise PlanInputError(f"stats is a {type(stats).__name__}, expected KeyStats")
    if not (isinstance(spill_threshold, int | float) and math.isfinite(spill_threshold) and spill_threshold > 0):
        raise PlanInputError(f"spill_threshold is {spill_threshold!r}: must be finite and > 0")
    weights, _ = _check_destinations(destinations)
    if previous is not None and not isinstance(previous, Plan):
        raise PlanInputError(f"previous is a {type(previous).__name__}, expected Plan")
    if previous is not None and previous.pool != pool:
        raise PlanInputError(f"previous plan belongs to pool {previous.pool!r}, not {pool!r}")
    if not isinstance(pinned, Mapping):
        raise PlanInputError(f"pinned is a {type(pinned).__name__}, expected a mapping key -> destination ids")
    return weights


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
    spill_threshold: float = 1.5,
) -> PlanResult:
    """Plan one control period for `pool` (see the module docstring)."""
    budget = budget or Budget()
    stability = stability or Stability()
    cost = cost or CostModel()
    pinned = {} if pinned is None else pinned
    weights = _check_inputs(
        stats, destinations=destinations, pool=pool, previous=previous, pinned=pinned, spill_threshold=spill_threshold
    )
    m = len(destinations)
    dest_ids = [d.id for d in destinations]
    n = len(stats)
    notes: list[str] = []

    # 1. Load of every key, and pinned routes first: they take load and warm room before anyone.
    key_load = warm_load(stats, cost)
    pin = _pinned(pinned, stats, key_load, dest_ids, budget)
    wb = warm_budget(destinations, budget)
    room = np.maximum(wb - pin.kv, 0.0)
    if bool(np.any(pin.kv > wb)):
        notes.append(f"pinned prefixes exceed the warm budget on {dest_ids[int(np.argmax(pin.kv - wb))]}")
    cap = min(budget.max_destinations_per_key, m)
    replicas = replicas_needed(key_load, budget.max_key_share_of_destination, float(weights.min()), cap)

    # 2. Admission into the warm room.
    adm, n_candidates = _admit(
        stats,
        key_load=key_load,
        replicas=replicas,
        room=room,
        pinned=pin.mask,
        previous=previous,
        stability=stability,
        cost=cost,
    )
    if n == 0:
        notes.append("no keyed traffic in the window: nothing to admit")
    elif not float(wb.sum()) > 0:
        notes.append("the warm budget is zero (auto needs kvCapacityTokens of destinations)")
    elif not n_candidates:
        notes.append("no key has a reusable prefix that fits the warm budget")

    # 3 and 4. Placement, keeping what the previous plan placed unless moving pays.
    prev = (
        previous_routes(previous, adm.hashes, dest_ids)
        if previous is not None
        else PreviousRoutes(np.zeros(len(adm) + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    )
    kept = (
        keep_previous(prev, adm.replicas, adm.prefix, adm.priority, room)
        if len(prev.dest)
        else _no_previous(adm.replicas)
    )
    pinned_cold = float(cold_load(stats, cost, pin.rows[pin.rows >= 0]).sum())
    placer = _Placer(
        adm=adm,
        weights=weights,
        base=pin.load,
        room=room,
        unrouted_cold=max(total_cold_load(stats, cost) - float(adm.cold.sum()) - pinned_cold, 0.0),
        unkeyed=unkeyed_load(stats.unkeyed, cost),
    )
    planned_total = adm.planned_load + float(pin.key_load.sum())
    chosen, kept_previous, stability_notes = _stabilise(placer, kept, stability, stability.max_churn * planned_total)
    notes.extend(stability_notes)

    # Routes of admitted keys: kept destinations first (their previous order), then new ones.
    order = np.argsort(chosen.key, kind="stable")
    a_key, a_dest = chosen.key[order], chosen.dest[order]
    placed = np.bincount(a_key, minlength=len(adm))
    routed_adm = placed > 0
    unplaced = int(np.count_nonzero(~routed_adm))
    under = int(np.count_nonzero(routed_adm & (placed < adm.replicas)))
    if unplaced:
        notes.append(f"{unplaced} admitted keys found no destination with warm room and go to p2c")
    moved = moved_replicas(a_key, a_dest, prev, adm.replicas)
    forced = np.minimum(moved, kept.forced)
    denom = planned_total if planned_total > 0 else 1.0
    churn = dot(moved, adm.per_replica) / denom
    churn_forced = dot(forced, adm.per_replica) / denom

    route_keys, route_offsets, route_dests = _route_columns(pin, adm, a_key, a_dest)
    asg_offsets, asg_dests, rep_out = _row_assignments(n, pin, adm, a_key, a_dest)
    admitted_mask = np.zeros(n, dtype=bool)
    admitted_mask[adm.rows] = True
    routed = pin.mask.copy()
    routed[adm.rows[routed_adm]] = True

    # Loads as routed: a key's load split evenly over the destinations it actually has.
    share = adm.per_replica * adm.replicas / np.maximum(placed, 1)
    planned = pin.load + np.bincount(a_dest, weights=share[a_key], minlength=m)
    spread = placer.spread(chosen)
    dest_load = predicted_load(planned, weights, spread)
    obj = float(np.max(dest_load / weights))
    lb = _lower_bound(planned, pin.load, share[routed_adm], weights, spread)
    used = pin.kv + (room - chosen.room)

    total_rate = stats.total_rate
    total_tokens = dot(stats.rate, stats.prompt_tokens) + stats.unkeyed.rate * stats.unkeyed.prompt_tokens
    req_share = float(stats.rate[routed].sum()) / total_rate if total_rate > 0 else 0.0
    tok_share = dot(stats.rate[routed], stats.prompt_tokens[routed]) / total_tokens if total_tokens > 0 else 0.0
    hit = dot(stats.rate[routed], stats.prefix_tokens[routed]) / total_tokens if total_tokens > 0 else 0.0
    headline = (
        f"routed {len(route_keys)} keys ({len(pin.hashes)} pinned) of {n}: {_fmt_share(req_share)} of requests, "
        f"{_fmt_share(tok_share)} of prompt tokens; warm KV {float(used.sum()):.0f} of {float(wb.sum()):.0f} tokens; "
        f"max load {obj:.3f} (lower bound {lb:.3f}); churn {_fmt_share(churn)} (forced {_fmt_share(churn_forced)})"
    )
    if obj > 1.0:
        notes.append(f"predicted max destination load {obj:.2f} exceeds its capacity")
    reason = "; ".join([headline, *notes])
    plan = Plan(
        pool=pool,
        destinations=tuple(destinations),
        route_keys=route_keys,
        route_offsets=route_offsets,
        route_dests=route_dests,
        generated_at=generated_at,
        spill_threshold=spill_threshold,
        key_extraction=key_extraction or KeyExtraction(),
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
        key_load=key_load,
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
        kept_previous=kept_previous,
        unplaced_keys=unplaced,
        under_replicated_keys=under,
        reason=reason,
        pinned_hashes=pin.hashes,
    )
