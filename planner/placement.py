"""Step 3 of a plan, placement: LPT (longest processing time first) of admitted keys onto weighted
destinations, on top of the pinned routes and of the replicas kept in place (`Placer`).

Every replica of an admitted key is one item with a load and a KV footprint. Items are taken in
descending load; each goes to the destination where it would finish lowest relative to that
destination's weight, among those with warm-KV room left and not already holding the same key.

Large items (or every item of a small instance) are placed one at a time, exactly as LPT does.
The many small items of a large instance are placed in chunks: each chunk's total load is
water-filled onto the least-loaded destinations (capped by their KV room) and the chunk's items,
in descending load, are dealt out along the cumulative quotas. A destination then ends within
one small item of its quota, so the chunked tail keeps LPT's guarantee for items free to go
anywhere, `max normalised load <= total / sum(weights) + largest item / smallest weight`, and with items
below 1/8 of the mean it stays within LPT's 4/3 - 1/(3m) factor of the optimum on identical
destinations.

Traffic that is not planned (unkeyed requests, keys not admitted) is spread by p2c, which keeps
sending to the least-loaded destinations: in expectation a water-filling of the planned levels.
It only lifts the lowest levels to a common water line, so the destination where an item
finishes lowest on planned load stays a best choice once the water is added; LPT therefore
places against planned load, and
`predicted_load`/`objective` add the water-filled share to judge and report the result.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cacheroute.planner.admission import Admitted
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.load import CostModel, Demand, cold_load, total_cold_load, unkeyed_load

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

# Instances up to this many items are placed item by item.
EXACT_LIMIT = 256
# Items above 1/HEAD_RATIO of the mean normalised load are placed item by item.
HEAD_RATIO = 8.0
# A large tail is cut into about this many chunks (each at least 16 items per destination).
TAIL_CHUNKS = 16


def water_fill(level: F64, weights: F64, amount: float) -> F64:
    """Load added to each destination when `amount` fills the lowest normalised levels first.

    This is how power-of-two-choices spreads unplanned traffic in expectation: it keeps sending
    to the least-loaded destinations until they catch up.
    """
    add = np.zeros(len(level), dtype=np.float64)
    if amount <= 0 or not len(level):
        return add
    order = np.argsort(level, kind="stable")
    lv = level[order]
    w = weights[order]
    cw = np.cumsum(w)
    cwl = np.cumsum(w * lv)
    # Cost of raising the j+1 lowest destinations to the level of the (j+1)-th one.
    raise_cost = lv * cw - cwl
    j = int(np.searchsorted(raise_cost, amount, side="right")) - 1
    lam = (amount + cwl[j]) / cw[j]
    add[order[: j + 1]] = w[: j + 1] * (lam - lv[: j + 1])
    return np.maximum(add, 0.0)


def capped_water_fill(level: F64, weights: F64, amount: float, caps: F64) -> F64:
    """`water_fill` where destination d takes at most `caps[d]`.

    The filled amount is piecewise linear in the water level: destination d joins at its level
    (slope +w_d) and leaves when full (slope -w_d). Walking the sorted breakpoints gives the
    level that holds `amount` exactly.
    """
    total_cap = float(caps.sum())
    if amount >= total_cap:
        return caps.copy()
    if amount <= 0:
        return np.zeros(len(level), dtype=np.float64)
    live = caps > 0
    lv, w, c = level[live], weights[live], caps[live]
    full = lv + c / w
    finite = np.isfinite(full)
    x = np.concatenate([lv, full[finite]])
    slope = np.concatenate([w, -w[finite]])
    order = np.argsort(x, kind="stable")
    x, slope = x[order], slope[order]
    running = np.cumsum(slope)
    filled = np.concatenate([[0.0], np.cumsum(running[:-1] * np.diff(x))])
    k = int(np.searchsorted(filled, amount, side="right")) - 1
    lam = x[k] + (amount - filled[k]) / running[k] if running[k] > 0 else x[k]
    return np.asarray(np.clip(weights * (lam - level), 0.0, caps), dtype=np.float64)


@dataclass(frozen=True, eq=False)
class PlacementResult:
    """Where each item went (-1: no destination had room) and the destinations afterwards."""

    dest: I64
    load: F64
    room: F64


class _Fleet:
    """Mutable destination state during one placement."""

    def __init__(self, weights: F64, load: F64, room: F64) -> None:
        self.w = weights
        self.load = load.astype(np.float64, copy=True)
        self.room = room.astype(np.float64, copy=True)

    def best(self, p: float, kv: float, avoid: set[int]) -> int:
        score = (self.load + p) / self.w
        score[self.room < kv] = np.inf
        if avoid:
            score[list(avoid)] = np.inf
        d = int(np.argmin(score))
        return d if math.isfinite(float(score[d])) else -1

    def put(self, d: int, p: float, kv: float) -> None:
        self.load[d] += p
        self.room[d] -= kv


def _groups(items: I64, group: I64) -> list[tuple[int, int]]:
    """(start, end) of each run of equal `group` along `items`."""
    if not len(items):
        return []
    g = group[items]
    cut = np.flatnonzero(g[1:] != g[:-1]) + 1
    starts = np.concatenate([[0], cut]).tolist()
    ends = np.concatenate([cut, [len(items)]]).tolist()
    return list(zip(starts, ends, strict=True))


def _place_exact(
    items: I64, load: F64, kv: F64, group: I64, *, fleet: _Fleet, dest: I64, taken: Mapping[int, set[int]]
) -> None:
    """Item-by-item LPT; the replicas of a group (adjacent in `items`) land all or none."""
    if not len(items):
        return
    if bool(np.all(fleet.w == fleet.w[0])):
        _place_exact_heap(items, load, kv, group, fleet=fleet, dest=dest, taken=taken)
        return
    p_all = load[items].tolist()
    k_all = kv[items].tolist()
    it_all = items.tolist()
    for i, j in _groups(items, group):
        g = int(group[it_all[i]])
        avoid = set(taken.get(g, ()))
        placed: list[tuple[int, int]] = []
        for t in range(i, j):
            d = fleet.best(p_all[t], k_all[t], avoid)
            if d < 0:
                break
            fleet.put(d, p_all[t], k_all[t])
            avoid.add(d)
            placed.append((t, d))
        if len(placed) == j - i:
            for t, d in placed:
                dest[it_all[t]] = d
        else:
            for t, d in placed:
                fleet.put(d, -p_all[t], -k_all[t])


def _place_exact_heap(
    items: I64, load: F64, kv: F64, group: I64, *, fleet: _Fleet, dest: I64, taken: Mapping[int, set[int]]
) -> None:
    """`_place_exact` on identical destinations: least load first is then a heap pop.

    Heap entries are (load, destination); an entry whose load is no longer the destination's
    is stale and skipped. A destination whose room is below every remaining item's KV is
    dropped for good.
    """
    loads = fleet.load.tolist()
    rooms = fleet.room.tolist()
    p_all = load[items].tolist()
    k_all = kv[items].tolist()
    it_all = items.tolist()
    # Smallest KV footprint among the items from position t on.
    floor_kv = np.minimum.accumulate(kv[items][::-1])[::-1].tolist()
    heap = [(loads[d], d) for d in range(len(loads))]
    heapq.heapify(heap)
    for i, j in _groups(items, group):
        g = int(group[it_all[i]])
        avoid = set(taken.get(g, ()))
        placed: list[tuple[int, int]] = []
        for t in range(i, j):
            p, k = p_all[t], k_all[t]
            aside: list[tuple[float, int]] = []
            chosen = -1
            while heap:
                entry = heapq.heappop(heap)
                ld, d = entry
                if ld != loads[d]:
                    continue
                if rooms[d] < floor_kv[t]:
                    continue
                if rooms[d] >= k and d not in avoid:
                    chosen = d
                    break
                aside.append(entry)
            for entry in aside:
                heapq.heappush(heap, entry)
            if chosen < 0:
                break
            loads[chosen] += p
            rooms[chosen] -= k
            heapq.heappush(heap, (loads[chosen], chosen))
            avoid.add(chosen)
            placed.append((t, chosen))
        if len(placed) == j - i:
            for t, d in placed:
                dest[it_all[t]] = d
        else:
            for t, d in placed:
                loads[d] -= p_all[t]
                rooms[d] += k_all[t]
                heapq.heappush(heap, (loads[d], d))
    fleet.load[:] = loads
    fleet.room[:] = rooms


def _place_chunk(chunk: I64, load: F64, kv: F64, fleet: _Fleet, dest: I64) -> I64:
    """Water-fill one chunk of single items; returns the items that found no KV room."""
    p = load[chunk]
    k = kv[chunk]
    open_ = fleet.room >= float(k.min())
    density = float(p.sum()) / float(k.sum()) if float(k.sum()) > 0 else math.inf
    caps = np.where(open_, fleet.room * density, 0.0) if math.isfinite(density) else np.where(open_, np.inf, 0.0)
    level = fleet.load / fleet.w
    quota = capped_water_fill(level, fleet.w, float(p.sum()), caps)
    ranked = np.argsort(level, kind="stable")
    ranked = ranked[quota[ranked] > 0]
    if not len(ranked):
        return chunk
    bounds = np.cumsum(quota[ranked])
    mid = np.cumsum(p) - 0.5 * p
    slot = np.minimum(np.searchsorted(bounds, mid, side="right"), len(ranked) - 1)
    d = ranked[slot]
    # Items of one destination are a contiguous run (slots only grow): accept the prefix of each
    # run that fits the destination's KV room.
    ck = np.cumsum(k)
    run_start = np.ones(len(d), dtype=bool)
    run_start[1:] = d[1:] != d[:-1]
    before = np.maximum.accumulate(np.where(run_start, ck - k, 0.0))
    accept = (ck - before) <= fleet.room[d] * (1 + 1e-12)
    m = len(fleet.w)
    fleet.load += np.bincount(d[accept], weights=p[accept], minlength=m)
    fleet.room -= np.bincount(d[accept], weights=k[accept], minlength=m)
    dest[chunk[accept]] = d[accept]
    return chunk[~accept]


def lpt_place(
    load: F64,
    kv: F64,
    group: I64,
    *,
    weights: F64,
    base_load: F64,
    room: F64,
    taken: Mapping[int, set[int]] | None = None,
    exact_limit: int = EXACT_LIMIT,
) -> PlacementResult:
    """Place items (replicas) onto destinations already carrying `base_load`, within `room`.

    `group[i]` names the key of item i; replicas of one key go to distinct destinations, and
    also avoid `taken[group]` (destinations already holding that key).
    """
    n = len(load)
    m = len(weights)
    fleet = _Fleet(weights, base_load, room)
    dest = np.full(n, -1, dtype=np.int64)
    if not n or not m:
        return PlacementResult(dest, fleet.load, fleet.room)
    taken = taken or {}
    order = np.lexsort((group, -load))
    gcount = np.bincount(group, minlength=int(group.max()) + 1)
    multi = gcount[group] > 1
    if taken:
        multi |= np.isin(group, np.fromiter(taken.keys(), dtype=np.int64, count=len(taken)))
    if n <= exact_limit:
        head_mask = np.ones(n, dtype=bool)
    else:
        mean = (float(base_load.sum()) + float(load.sum())) / float(weights.sum())
        head_mask = multi | (load / float(weights.min()) >= mean / HEAD_RATIO)
    head = order[head_mask[order]]
    _place_exact(head, load, kv, group, fleet=fleet, dest=dest, taken=taken)
    tail = order[~head_mask[order]]
    size = max(16 * m, math.ceil(len(tail) / TAIL_CHUNKS))
    ptr = 0
    retry = np.zeros(0, dtype=np.int64)
    while ptr < len(tail) or len(retry):
        fresh = tail[ptr : ptr + max(size - len(retry), 0)]
        ptr += len(fresh)
        chunk = np.concatenate([retry, fresh])
        chunk = chunk[kv[chunk] <= float(fleet.room.max())]
        if not len(chunk):
            retry = chunk
            continue
        rejected = _place_chunk(chunk, load, kv, fleet, dest)
        if len(rejected) == len(chunk):
            # No progress by chunks: settle these items one at a time.
            _place_exact(rejected, load, kv, group, fleet=fleet, dest=dest, taken=taken)
            rejected = rejected[:0]
        retry = rejected
    return PlacementResult(dest, fleet.load, fleet.room)


def predicted_load(planned: F64, weights: F64, spread: float) -> F64:
    """Expected load per destination: the planned load plus unplanned traffic water-filled."""
    return planned + water_fill(planned / weights, weights, spread)


def objective(planned: F64, weights: F64, spread: float) -> float:
    """The largest normalised load once unplanned traffic is spread (what placement minimises)."""
    if not len(planned):
        return 0.0
    return float(np.max(predicted_load(planned, weights, spread) / weights))


@dataclass(frozen=True, eq=False)
class KeptRoutes:
    """Replicas that stay on their previous destination, and what each key still lacks."""

    key: I64  # key of each kept replica
    dest: I64  # its destination
    missing: I64  # per key: replicas still to place
    forced: I64  # per key: of those, replicas that had a destination which vanished or lost its room

    @classmethod
    def nothing(cls, replicas: I64) -> KeptRoutes:
        """Nothing kept: every replica is to place."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, replicas.copy(), np.zeros(len(replicas), dtype=np.int64))


@dataclass(frozen=True, eq=False)
class Assignment:
    """Replica placements of admitted keys (`key` indexes `Admitted`) and the fleet after them."""

    key: I64
    dest: I64
    planned: F64  # per destination, including pinned
    room: F64  # warm room left per destination

    def by_key(self) -> tuple[I64, I64]:
        """(key, destination) of every replica, by key; kept destinations first, then new ones."""
        order = np.argsort(self.key, kind="stable")
        return self.key[order], self.dest[order]


def _items(counts: I64) -> I64:
    """Group id of each item when group g needs counts[g] items."""
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


@dataclass(frozen=True, eq=False)
class Placer:
    """Places admitted keys on top of the pinned routes, and scores the result."""

    adm: Admitted
    weights: F64
    base: F64  # pinned load per destination
    room: F64  # warm room per destination after pinned routes
    unrouted_cold: float  # p2c load of keys that are neither admitted nor pinned
    unkeyed: float  # p2c load of traffic without a key

    def assign(self, kept: KeptRoutes, unstuck_rows: I64 | None = None) -> Assignment:
        """Kept replicas stay (but `unstuck_rows` of them); forced re-placements go first, then new
        and unstuck replicas."""
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
        return Assignment(np.concatenate(keys_out), np.concatenate(dests_out), planned, left)

    def spread(self, a: Assignment) -> float:
        """Load routed by p2c: unkeyed traffic, keys not routed, and admitted keys left unplaced."""
        placed = np.bincount(a.key, minlength=len(self.adm)) > 0
        return self.unkeyed + self.unrouted_cold + float(self.adm.cold[~placed].sum())

    def objective(self, a: Assignment) -> float:
        return objective(a.planned, self.weights, self.spread(a))


def placer_for(adm: Admitted, demand: Demand, stats: KeyStats, cost: CostModel, weights: F64) -> Placer:
    """Step 3: the placer of the admitted keys, over the pinned routes, with p2c spreading the rest."""
    pin = demand.pinned
    pinned_cold = float(cold_load(stats, cost, pin.rows[pin.rows >= 0]).sum())
    return Placer(
        adm=adm,
        weights=weights,
        base=pin.load,
        room=demand.room,
        unrouted_cold=max(total_cold_load(stats, cost) - float(adm.cold.sum()) - pinned_cold, 0.0),
        unkeyed=unkeyed_load(stats.unkeyed, cost),
    )
