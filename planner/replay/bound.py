"""How much of a trace's prompts any router could serve from cache, given the fleet's total KV.

Routing only decides which destination's cache a prompt meets; what the caches keep is the
engines' business (vLLM evicts least recently used blocks). Two ceilings follow from the fleet's
total capacity alone, with no routing and no duplication:

- `unified_lru_hit`: one LRU cache as large as the whole fleet's, hits counted as the engines count
  them (the contiguous run of cached blocks from the start of the prompt). Routers that partition
  the same capacity into per-destination LRU caches approach it from below: a prefix kept on two
  destinations takes room twice, and a destination's cache ages by its own traffic only.
- `optimal_hit`: Belady's MIN on the same capacity (evict the block needed furthest in the
  future), every cached block counted: no eviction policy and no placement of blocks serves more.
  The gap between the two is what a better eviction policy in the engine could win.

A router does choose which requests each cache sees, and partitioned caches fed selectively can
beat one shared LRU cache (blocks that are never used again can be sent where they evict nothing
that is), so the first ceiling is not a proof. `routed_lru_hit` measures per-destination LRU
caches under a given routing, with two routings no router can beat at that game:
`key_sticky_routes` (every key always on the same destination: no prefix cached twice) and
`oracle_admission_routes`, which knows the future: requests of keys that come back later go to
destinations kept for them, the rest to `scratch` destinations where their blocks evict nothing
anyone needs again. Neither looks at load; each reports how unevenly it spreads the prefill.

Both replay the prompt blocks in arrival order with no time or concurrency (running requests
would pin blocks and lower both figures), and weigh a hit by the tokens of its block; the first
`warmup_fraction` of requests fill the cache and are not counted, as in the replay's metrics.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from cacheroute.planner.trace import RequestTrace


def _references(trace: RequestTrace, warmup_fraction: float) -> Iterator[tuple[int, int, bool]]:
    """Every prompt block in arrival order: (block id, its tokens, whether it is counted)."""
    bs = trace.block_size
    order = np.argsort(trace.arrival_s, kind="stable").tolist()
    warm = int(warmup_fraction * len(order))
    for rank, i in enumerate(order):
        tokens = int(trace.input_tokens[i])
        counted = rank >= warm
        for j, b in enumerate(trace.blocks(i).tolist()):
            yield b, max(0, min(bs, tokens - j * bs)), counted


def _capacity_blocks(trace: RequestTrace, capacity_tokens: int, warmup_fraction: float) -> int:
    if capacity_tokens < 0:
        raise ValueError(f"cache capacity must not be negative, got {capacity_tokens}")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warm-up fraction must be in [0, 1), got {warmup_fraction}")
    return capacity_tokens // trace.block_size


def unified_lru_hit(trace: RequestTrace, capacity_tokens: int, warmup_fraction: float = 0.1) -> float:
    """Token-weighted prefix hit of one LRU cache of `capacity_tokens` (module docstring)."""
    return routed_lru_hit(trace, [0] * len(trace), 1, capacity_tokens, warmup_fraction).hit


def optimal_hit(trace: RequestTrace, capacity_tokens: int, warmup_fraction: float = 0.1) -> float:
    """Token-weighted hit of Belady's MIN on `capacity_tokens`, any cached block counted."""
    capacity = _capacity_blocks(trace, capacity_tokens, warmup_fraction)
    refs: list[int] = []
    weights: list[int] = []
    counted: list[bool] = []
    for b, t, c in _references(trace, warmup_fraction):
        refs.append(b)
        weights.append(t)
        counted.append(c)
    never = len(refs)
    next_use = [never] * len(refs)
    seen: dict[int, int] = {}
    for k in range(len(refs) - 1, -1, -1):
        next_use[k] = seen.get(refs[k], never)
        seen[refs[k]] = k
    cache: dict[int, int] = {}  # block -> its next use
    furthest: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hit = total = 0
    for k, b in enumerate(refs):
        if counted[k]:
            total += weights[k]
            if b in cache:
                hit += weights[k]
        if not capacity:
            continue
        if b not in cache and len(cache) >= capacity:
            while True:
                use, victim = heapq.heappop(furthest)
                if cache.get(victim) == -use:
                    del cache[victim]
                    break
        cache[b] = next_use[k]
        heapq.heappush(furthest, (-next_use[k], b))
    return hit / total if total else 0.0


@dataclass(frozen=True)
class RoutedHit:
    """Served hit of per-destination LRU caches under one routing, and how evenly that routing
    spreads the work: prompt tokens each destination computes (not served from its cache)."""

    hit: float
    computed_tokens: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """Most computed tokens on one destination over the mean (1.0: perfectly even)."""
        mean = sum(self.computed_tokens) / len(self.computed_tokens) if self.computed_tokens else 0.0
        return max(self.computed_tokens) / mean if mean else 1.0


def routed_lru_hit(trace: RequestTrace, destination_of: Sequence[int], destinations: int,
                   capacity_tokens: int, warmup_fraction: float = 0.1) -> RoutedHit:
    """Per-destination LRU caches of `capacity_tokens` each, request i sent to `destination_of[i]`,
    hits counted as the engines count them (module docstring)."""
    capacity = _capacity_blocks(trace, capacity_tokens, warmup_fraction)
    if len(destination_of) != len(trace):
        raise ValueError(f"{len(destination_of)} destinations given for {len(trace)} requests")
    if destinations < 1 or any(not 0 <= d < destinations for d in destination_of):
        raise ValueError(f"every destination must be in [0, {destinations})")
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(destinations)]
    computed = [0] * destinations
    bs = trace.block_size
    offsets = trace.block_offsets.tolist()
    ids = trace.block_ids.tolist()
    tokens = trace.input_tokens.tolist()
    order = np.argsort(trace.arrival_s, kind="stable").tolist()
    warm = int(warmup_fraction * len(order))
    hit = total = 0
    for rank, i in enumerate(order):
        d = destination_of[i]
        cache = caches[d]
        served = 0
        leading = True
        for j in range(offsets[i], offsets[i + 1]):
            b = ids[j]
            if b in cache:
                cache.move_to_end(b)
                if leading:
                    served += max(0, min(bs, tokens[i] - (j - offsets[i]) * bs))
                continue
            leading = False
            if capacity:
                cache[b] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
        if rank >= warm:
            hit += served
            total += tokens[i]
            computed[d] += tokens[i] - served
    return RoutedHit(hit / total if total else 0.0, tuple(computed))


def _spread(key: int, request: int, n: int) -> int:
    """A destination in [0, n) for a key (keyless requests by their index), well mixed."""
    x = (key if key >= 0 else request) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
    return (x >> 32) % n


def key_sticky_routes(trace: RequestTrace, destinations: int) -> list[int]:
    """Every request of a key on one destination, keys spread by a hash."""
    keys = trace.key.tolist()
    return [_spread(k, i, destinations) for i, k in enumerate(keys)]


def oracle_admission_routes(trace: RequestTrace, destinations: int, scratch: int) -> list[int]:
    """Key-sticky over the first `destinations - scratch` destinations for requests whose key
    comes back later in the trace; the others key-sticky over the last `scratch` ones."""
    if not 0 < scratch < destinations:
        raise ValueError(f"scratch destinations must be in (0, {destinations}), got {scratch}")
    kept = destinations - scratch
    keys = trace.key.tolist()
    order = np.argsort(trace.arrival_s, kind="stable").tolist()
    comes_back = [False] * len(keys)
    seen: set[int] = set()
    for i in reversed(order):
        k = keys[i]
        comes_back[i] = k >= 0 and k in seen
        seen.add(k)
    return [_spread(k, i, kept) if comes_back[i] else kept + _spread(k, i, scratch) for i, k in enumerate(keys)]
