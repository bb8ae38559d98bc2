"""Step 2 of a plan, admission: fill the warm room with the keys that save the most prefill per KV
token (`admit`).

A key held warm on r destinations saves `rate x prefix` prompt tokens of prefill per second and
holds `prefix x r` tokens of KV, so its value per KV token is `rate / r` (times the prefill cost
per token, the same for every key): a long prefix costs more budget in proportion to what it
saves, so long and short prefixes compete on equal terms. Keys the previous plan routed get a
`1 + stability.min_gain` head start, so keys near the cut do not flip in and out on noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.load import CostModel, cold_load, dot
from cacheroute.planner.plan import Plan
from cacheroute.planner.settings import Stability

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
B = npt.NDArray[np.bool_]

# Each pass of the greedy skips one key that no longer fits; later passes only refill the
# remainder of the budget with small keys, so a few suffice.
DEFAULT_SKIP_PASSES = 32


def value_per_token(rate: F64, replicas: I64) -> F64:
    """Prefill tokens saved per second per KV token held (up to the common prefill cost)."""
    return rate / replicas


def eligible_keys(rate: F64, prefix_tokens: F64, replicas: I64, room: F64, excluded: B | None = None) -> B:
    """Keys that have something to save and fit on `replicas` distinct destinations' warm room."""
    ok = (rate > 0) & (prefix_tokens > 0)
    if excluded is not None:
        ok &= ~excluded
    # The key needs `replicas` destinations with room for its prefix: the r-th largest room must hold it.
    rooms_desc = np.sort(room)[::-1]
    r = np.minimum(replicas, len(rooms_desc))
    ok &= (replicas <= len(rooms_desc)) & (prefix_tokens <= rooms_desc[r - 1])
    return ok


def _by_density(items: I64, density: F64) -> I64:
    """`items` in descending density, ties in ascending index (a total, deterministic order)."""
    # `items` are ascending, so a stable sort breaks density ties by index.
    ordered = items if bool(np.all(items[1:] > items[:-1])) else np.sort(items)
    return ordered[np.argsort(-density[ordered], kind="stable")]


def _top_by_density(candidates: I64, density: F64, cost: F64, budget: float) -> tuple[I64, I64]:
    """Split candidates into the densest ones, sorted, whose total cost exceeds `budget` (or all
    of them), and the rest, unsorted. Every key of the rest is less dense than every key of the
    head, so a greedy pass over the head then the rest sees keys in full density order.
    """
    n = len(candidates)
    dens = density[candidates]
    mean_cost = float(cost[candidates].mean())
    guess = 1.25 * budget / mean_cost if mean_cost > 0 else float(n)
    k = n if guess >= n else max(64, int(guess))
    while True:
        if k >= n:
            return _by_density(candidates, density), candidates[:0]
        threshold = np.partition(dens, n - k)[n - k]
        # All keys tied with the threshold go to the head, so the split does not depend on ties.
        in_head = dens >= threshold
        head = candidates[in_head]
        if float(cost[head].sum()) > budget:
            return _by_density(head, density), candidates[~in_head]
        k *= 4


def greedy_admit(candidates: I64, density: F64, cost: F64, budget: float, passes: int = DEFAULT_SKIP_PASSES) -> I64:
    """Greedy knapsack by `density`: take keys in descending density while they fit, skipping
    those that no longer do; returns the admitted subset of `candidates` in admission order.

    Each pass takes the longest run that fits (a cumsum), skips the first key that does not,
    and continues after it: the same result as the one-key-at-a-time greedy, in at most
    `passes` vectorised steps (the rest of the budget stays unused after that). Only the keys
    that can matter are sorted: the densest ones down to the budget, then those of the rest that
    still fit what is left.
    """
    if not len(candidates) or budget <= 0:
        return np.zeros(0, dtype=np.int64)
    head, rest = _top_by_density(candidates, density, cost, budget)
    rem = float(budget)
    out: list[I64] = []
    stream = head
    left = passes
    while left > 0:
        c = cost[stream]
        pos = 0
        while left > 0:
            left -= 1
            idx = np.flatnonzero(c[pos:] <= rem) + pos
            if not len(idx):
                break
            cum = np.cumsum(c[idx])
            k = int(np.searchsorted(cum, rem, side="right"))
            out.append(stream[idx[:k]])
            if k:
                rem -= float(cum[k - 1])
            if k == len(idx):
                break
            pos = int(idx[k]) + 1
        if not len(rest) or rem <= 0:
            break
        # The rest, in density order, limited to keys that can still fit.
        stream = _by_density(rest[cost[rest] <= rem], density)
        rest = rest[:0]
        if not len(stream):
            break
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Admitted:
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
class Admission:
    keys: Admitted
    candidates: int  # keys eligible at all (something to save, fits the room)


def _member(values: U64, sorted_keys: U64) -> B:
    """Which `values` occur in the sorted, unique `sorted_keys`."""
    if not len(sorted_keys):
        return np.zeros(len(values), dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_keys, values), len(sorted_keys) - 1)
    return np.asarray(sorted_keys[pos] == values)


def admit(
    stats: KeyStats,
    *,
    key_load: F64,
    replicas: I64,
    room: F64,
    pinned: B,
    previous: Plan | None,
    stability: Stability,
    cost: CostModel,
) -> Admission:
    """Step 2: admit keys (not `pinned`) into the warm `room`, incumbents of `previous` first on ties."""
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
    keys = Admitted(
        rows=admitted,
        hashes=hashes,
        replicas=reps,
        prefix=stats.prefix_tokens[admitted],
        per_replica=key_load[admitted] / reps,
        priority=density[admitted],
        cold=cold_load(stats, cost, admitted),
    )
    return Admission(keys, len(candidates))


def nothing_admitted_because(keys: int, warm_budget: F64, candidates: int, prefixed: int) -> str | None:
    """Why a plan admits nothing, when the input says so (`prefixed`: keys with a reusable prefix)."""
    if keys == 0:
        return "no keyed traffic in the window: nothing to admit"
    if not float(warm_budget.sum()) > 0:
        return "the warm budget is zero (auto needs kvCapacityTokens of destinations)"
    if not prefixed:
        # The routers' estimate of a reusable prefix is what a follow-up chat turn resends; a
        # completions prompt has no such boundary, and nothing else says why such a plan is empty.
        return ("no key showed a reusable prefix: routers count the messages before a chat request's newest "
                "one, and a /v1/completions request shows none")
    if not candidates:
        return "no key has a reusable prefix that fits the warm budget"
    return None
