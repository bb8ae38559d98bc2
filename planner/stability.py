"""Step 4 of a plan, stability: keep keys where the previous plan put them, move only what pays,
and count churn (`stabilise`).

A move costs a cold prefix on the new destination, so a re-plan keeps every key's previous
destinations unless re-balancing improves the objective by more than `min_gain`, and then moves
at most `max_churn` of the planned load, taken from the most overloaded destinations first.
Keys whose destination disappeared (or no longer has warm room for them) must move: those moves
are *forced*, reported, and not counted against the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cacheroute.planner.load import dot
from cacheroute.planner.placement import Assignment, KeptRoutes, Placer
from cacheroute.planner.plan import Plan
from cacheroute.planner.settings import Stability

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
B = npt.NDArray[np.bool_]

_BISECT_STEPS = 24
# Destination index stride when a (key, destination) pair is packed into one integer.
_PAIR_STRIDE = 1 << 16


def _ranges(starts: I64, counts: I64) -> I64:
    """Concatenation of arange(s, s + c) for each (s, c)."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return np.asarray(np.arange(total, dtype=np.int64) + shift, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class PreviousRoutes:
    """Previous destinations of some keys, CSR by key, as indexes into the current destinations.

    `dest` holds -1 where the previous destination is no longer in the pool.
    """

    offsets: I64
    dest: I64

    @property
    def count(self) -> I64:
        return np.diff(self.offsets)

    def key_of_entry(self) -> I64:
        return np.repeat(np.arange(len(self.offsets) - 1, dtype=np.int64), self.count)


def previous_routes(previous: Plan, hashes: U64, dest_ids: list[str]) -> PreviousRoutes:
    """Look the keys (by hash) up in the previous plan and map its destinations by id."""
    n = len(hashes)
    if not len(previous) or not n:
        return PreviousRoutes(np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    pos = np.searchsorted(previous.route_keys, hashes)
    pos_c = np.minimum(pos, len(previous) - 1)
    found = (pos < len(previous)) & (previous.route_keys[pos_c] == hashes)
    lo = previous.route_offsets[pos_c]
    counts = np.where(found, previous.route_offsets[pos_c + 1] - lo, 0).astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    index = {d: i for i, d in enumerate(dest_ids)}
    remap = np.array([index.get(d.id, -1) for d in previous.destinations], dtype=np.int64)
    old = previous.route_dests[_ranges(lo, counts)].astype(np.int64)
    return PreviousRoutes(offsets, remap[old])


def keep_previous(prev: PreviousRoutes, replicas: I64, prefix: F64, priority: F64, room: F64) -> KeptRoutes:
    """Keep each key's first `replicas` surviving previous destinations, as far as warm room allows.

    When a destination's room no longer holds all its kept prefixes, the keys of lowest
    `priority` there are displaced (a forced move).
    """
    n = len(replicas)
    key = prev.key_of_entry()
    dest = prev.dest
    entry = np.arange(len(dest), dtype=np.int64)
    alive = dest >= 0
    key, dest, entry = key[alive], dest[alive], entry[alive]
    # Rank of each surviving entry within its key, in previous preference order.
    starts = np.searchsorted(key, np.arange(n, dtype=np.int64), side="left")
    rank = np.arange(len(key), dtype=np.int64) - starts[key] if len(key) else key
    within = rank < replicas[key]
    key, dest, entry = key[within], dest[within], entry[within]
    if len(key):
        order = np.lexsort((key, -priority[key], dest))
        key, dest, entry = key[order], dest[order], entry[order]
        kv = prefix[key]
        cum = np.cumsum(kv)
        first = np.ones(len(dest), dtype=bool)
        first[1:] = dest[1:] != dest[:-1]
        before = np.maximum.accumulate(np.where(first, cum - kv, 0.0))
        fits = (cum - before) <= room[dest] * (1 + 1e-12)
        key, dest, entry = key[fits], dest[fits], entry[fits]
        # Back to the previous plan's order: by key, then preference.
        back = np.argsort(entry, kind="stable")
        key, dest = key[back], dest[back]
    kept = np.bincount(key, minlength=n).astype(np.int64)
    had = np.minimum(prev.count, replicas)
    return KeptRoutes(
        key=key,
        dest=dest,
        missing=replicas - kept,
        forced=np.maximum(had - kept, 0),
    )


def choose_unstick(
    pair_dest: I64, pair_load: F64, *, kept_load: F64, weights: F64, target: float, ceiling: float, cap: float
) -> I64:
    """Kept replicas to move so the most loaded destinations fall towards `target`.

    `kept_load` is each destination's load from what stays put (pinned and kept replicas). On
    each destination above a level T the fewest replicas covering its excess over T are chosen
    (the smallest single replica that covers it, else the largest ones first); T is the lowest
    level in [target, ceiling] whose chosen replicas carry at most `cap` of load (bisection).
    Returns indexes into the pairs.
    """
    none = np.zeros(0, dtype=np.int64)
    if cap <= 0 or not len(pair_dest):
        return none
    m = len(weights)
    order = np.lexsort((-pair_load, pair_dest))
    sd = pair_dest[order]
    sl = pair_load[order]
    seg_start = np.searchsorted(sd, np.arange(m))
    csum = np.cumsum(sl)
    before = np.concatenate([[0.0], csum])[seg_start]
    within = csum - before[sd]
    rank = np.arange(len(sd)) - seg_start[sd]

    def chosen(level: float) -> tuple[npt.NDArray[np.bool_], float]:
        excess = np.maximum(kept_load - level * weights, 0.0)
        e = excess[sd]
        covers = np.bincount(sd[sl >= e], minlength=m)
        short = np.bincount(sd[within < e], minlength=m)
        pick = np.where(covers[sd] > 0, rank == covers[sd] - 1, rank <= short[sd]) & (e > 0)
        return pick, float(sl[pick].sum())

    lo, hi = target, max(ceiling, target)
    pick, total = chosen(lo)
    if total > cap:
        pick, total = chosen(hi)
        for _ in range(_BISECT_STEPS):
            mid = 0.5 * (lo + hi)
            p_mid, t_mid = chosen(mid)
            if t_mid > cap:
                lo = mid
            else:
                hi, pick, total = mid, p_mid, t_mid
    if total > cap:
        return none
    return np.sort(order[pick])


def moved_replicas(new_key: I64, new_dest: I64, prev: PreviousRoutes, replicas: I64) -> I64:
    """Per key: replicas now on a destination that did not hold the key before, beyond growth."""
    n = len(replicas)
    old_codes = prev.key_of_entry() * _PAIR_STRIDE + np.where(prev.dest >= 0, prev.dest, _PAIR_STRIDE - 1)
    new_codes = new_key * _PAIR_STRIDE + new_dest
    fresh = ~np.isin(new_codes, old_codes)
    landed_new = np.bincount(new_key[fresh], minlength=n).astype(np.int64)
    growth = np.maximum(replicas - prev.count, 0)
    incumbent = prev.count > 0
    return np.where(incumbent, np.maximum(landed_new - growth, 0), 0)


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


def _choose(placer: Placer, kept: KeptRoutes, stability: Stability, churn_cap: float) -> tuple[Assignment, bool, str]:
    """The keep-in-place assignment, or a re-balanced one when it gains more than `min_gain`."""
    keep = placer.assign(kept)
    if not len(kept.key):
        return keep, False, ""
    obj_keep = placer.objective(keep)
    fresh = placer.assign(KeptRoutes.nothing(placer.adm.replicas))
    obj_fresh = placer.objective(fresh)
    gain = (obj_keep - obj_fresh) / obj_keep if obj_keep > 0 else 0.0
    if gain <= stability.min_gain:
        why = f"a fresh placement gains {_share(max(gain, 0.0))}, below min gain {_share(stability.min_gain)}"
        return keep, True, f"kept previous placement: {why}"
    if churn_cap <= 0:
        return keep, True, f"kept previous placement: max churn is 0 (a fresh placement would gain {_share(gain)})"
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
            return moved, False, note
    note = f"kept previous placement: moves within the churn cap would not gain {_share(stability.min_gain)}"
    return keep, True, note


@dataclass(frozen=True, eq=False)
class Stabilised:
    """The placement a plan routes by, and how much of the planned load it moved."""

    placement: Assignment
    key: I64  # the placed replicas' keys, by key (`Assignment.by_key`)
    dest: I64  # their destinations, kept ones first within a key
    kept_previous: bool  # the keep-in-place placement was chosen over a re-balance
    churn: float  # share of planned load on a destination that did not hold it before
    churn_forced: float  # part of `churn` caused by vanished destinations or lost room
    note: str


def stabilise(
    placer: Placer, previous: Plan | None, dest_ids: list[str], stability: Stability, pinned_load: float
) -> Stabilised:
    """Step 4: place the admitted keys, keeping the previous plan's placement unless moving pays
    more than `min_gain`, and then at most `max_churn` of the planned load (pinned included)."""
    adm = placer.adm
    prev = (
        previous_routes(previous, adm.hashes, dest_ids)
        if previous is not None
        else PreviousRoutes(np.zeros(len(adm) + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    )
    kept = (
        keep_previous(prev, adm.replicas, adm.prefix, adm.priority, placer.room)
        if len(prev.dest)
        else KeptRoutes.nothing(adm.replicas)
    )
    planned_total = adm.planned_load + pinned_load
    chosen, kept_previous, note = _choose(placer, kept, stability, stability.max_churn * planned_total)
    a_key, a_dest = chosen.by_key()
    moved = moved_replicas(a_key, a_dest, prev, adm.replicas)
    forced = np.minimum(moved, kept.forced)
    denom = planned_total if planned_total > 0 else 1.0
    churn = dot(moved, adm.per_replica) / denom
    churn_forced = dot(forced, adm.per_replica) / denom
    return Stabilised(chosen, a_key, a_dest, kept_previous, churn, churn_forced, note)
