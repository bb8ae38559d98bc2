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
  The gap between the two is what a better eviction policy in the engine could win, and is out of
  a router's reach.

Both replay the prompt blocks in arrival order with no time or concurrency (running requests
would pin blocks and lower both figures), and weigh a hit by the tokens of its block; the first
`warmup_fraction` of requests fill the cache and are not counted, as in the replay's metrics.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np

from cacheroute.planner.trace import RequestTrace


def _requests_in_order(trace: RequestTrace) -> list[int]:
    return np.argsort(trace.arrival_s, kind="stable").tolist()  # type: ignore[no-any-return]


def _block_tokens(input_tokens: int, j: int, block_size: int) -> int:
    return max(0, min(block_size, input_tokens - j * block_size))


def _check(capacity_tokens: int, warmup_fraction: float) -> None:
    if capacity_tokens < 0:
        raise ValueError(f"cache capacity must not be negative, got {capacity_tokens}")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warm-up fraction must be in [0, 1), got {warmup_fraction}")


def unified_lru_hit(trace: RequestTrace, capacity_tokens: int, warmup_fraction: float = 0.1) -> float:
    """Token-weighted prefix hit of one LRU cache of `capacity_tokens` (module docstring)."""
    _check(capacity_tokens, warmup_fraction)
    bs = trace.block_size
    capacity = capacity_tokens // bs
    order = _requests_in_order(trace)
    warm = int(warmup_fraction * len(order))
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for rank, i in enumerate(order):
        tokens = int(trace.input_tokens[i])
        counted = rank >= warm
        leading = True
        for j, b in enumerate(trace.blocks(i).tolist()):
            t = _block_tokens(tokens, j, bs)
            if counted:
                total += t
            if b in cache:
                cache.move_to_end(b)
                if leading and counted:
                    hit += t
                continue
            leading = False
            if capacity:
                cache[b] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hit / total if total else 0.0


def optimal_hit(trace: RequestTrace, capacity_tokens: int, warmup_fraction: float = 0.1) -> float:
    """Token-weighted hit of Belady's MIN on `capacity_tokens`, any cached block counted."""
    _check(capacity_tokens, warmup_fraction)
    bs = trace.block_size
    capacity = capacity_tokens // bs
    order = _requests_in_order(trace)
    warm = int(warmup_fraction * len(order))
    refs: list[int] = []
    weights: list[int] = []
    counted: list[bool] = []
    for rank, i in enumerate(order):
        tokens = int(trace.input_tokens[i])
        for j, b in enumerate(trace.blocks(i).tolist()):
            refs.append(b)
            weights.append(_block_tokens(tokens, j, bs))
            counted.append(rank >= warm)
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
