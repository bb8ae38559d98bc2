"""Per-request cache-aware routers, rebuilt from their public code (reference/routers.md).

They all keep a router-side, approximate record of which prompt blocks were sent where (never the
engines' real cache), at the granularity of the trace's blocks:

- `prefix-tree` — SGLang model gateway `cache_aware` (sgl-model-gateway/src/policies/cache_aware.rs,
  tree.rs). Load = router-tracked in-flight. If `max - min > balance_abs_threshold (64)` and
  `max > balance_rel_threshold (1.5) * min`: shortest queue (the prompt is still inserted in the
  tree). Otherwise longest prefix match over all workers' trees; if `matched / prompt >
  cache_threshold (0.3)`: the worker holding the deepest matched node (its most recent tenant),
  else the least-loaded worker (current code; older releases took the smallest tree). Every
  `eviction_interval (120 s)` each worker's tree is cut to `max_tree_size` (2^26 characters,
  ~4 characters per token) by evicting least recently used leaves.
- `gie-prefix` — Gateway API Inference Extension EPP default profile (pkg/epp/config/loader/
  defaults.go v1.5.0): score = 3 * prefix + 2 * queue + 2 * kv; prefix = consecutive matched blocks
  from the start / prompt blocks on that pod, from the approximate prefix index (per-pod LRU whose
  capacity auto-tunes to the pod's KV blocks), queue = (max_q - q) / (max_q - min_q) on the scraped
  waiting-queue depth (1 when all equal), kv = 1 - KV usage; max-score picker, random among ties;
  the chosen pod's index gets the prompt's blocks.
- `preble` — Preble E2 (arXiv 2407.00023; WukLab/preble multi_node/global_scheduler_with_time.py).
  A global prefix index remembers, per block, the GPUs requests holding it were sent to within the
  last 3 minutes. Exploit when the matched (already seen) prefix is longer than the new part: send
  to the least-loaded GPU among those the deepest matched prefix was sent to. Explore otherwise:
  the GPU minimising L + P (+ M): L = windowed load (prefill time of the uncached part of every
  request sent there in the last 3 minutes, plus decode time of its in-flight requests at its
  observed time per output token), P = prefill time of this request's part not cached there,
  M = eviction cost (off by default, as `enable_eviction=False` in the reference scheduler).
  Load rebalancing by prefix stealing is disabled in the reference scheduler and here.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import ClassVar

from cacheroute.planner.prefixes import leading_depths
from cacheroute.planner.replay.policy import Policy, RouterView

# SGLang's tree counts characters; Mooncake-style token counts convert at ~4 characters per token
# (the same ratio GIE's hashing assumes).
CHARS_PER_TOKEN = 4


class ApproxIndex:
    """Router-side record of the blocks sent to each destination.

    `owners[block]` is a bitmask of destinations; each destination has an LRU of its blocks.
    With `capacity_blocks`, a destination's LRU is trimmed on every insert (GIE); without, only
    when `trim` is called (SGLang's periodic eviction).
    """

    __slots__ = ("capacity_blocks", "last", "lru", "owners")

    def __init__(self, n: int, capacity_blocks: int | None = None) -> None:
        self.owners: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
        self.capacity_blocks = capacity_blocks

    def insert(self, blocks: list[int], d: int, tail_first: bool) -> None:
        """Record `blocks` on destination d. `tail_first` touches the tail before the head, so
        the head stays most recent and eviction removes leaves first (radix-tree LRU)."""
        owners = self.owners
        last = self.last
        lru = self.lru[d]
        bit = 1 << d
        for b in reversed(blocks) if tail_first else blocks:
            m = owners.get(b, 0)
            if m & bit:
                lru.move_to_end(b)
            else:
                owners[b] = m | bit
                lru[b] = None
            last[b] = d
        cap = self.capacity_blocks
        if cap is not None and len(lru) > cap:
            self._evict(d, len(lru) - cap)

    def _evict(self, d: int, count: int) -> None:
        owners = self.owners
        lru = self.lru[d]
        clear = ~(1 << d)
        for _ in range(count):
            b, _ = lru.popitem(last=False)
            m = owners[b] & clear
            if m:
                owners[b] = m
            else:
                del owners[b]
                self.last.pop(b, None)

    def trim(self, d: int, max_blocks: int) -> None:
        excess = len(self.lru[d]) - max_blocks
        if excess > 0:
            self._evict(d, excess)

    def size(self, d: int) -> int:
        return len(self.lru[d])

    def longest(self, blocks: list[int]) -> tuple[int, int]:
        """Blocks matched by any destination, and the owners' mask of the deepest matched block."""
        owners = self.owners
        depth = 0
        mask = 0
        for b in blocks:
            m = owners.get(b, 0)
            if not m:
                break
            depth += 1
            mask = m
        return depth, mask

    def depths(self, blocks: list[int], n: int) -> list[int]:
        """Consecutive blocks from the start each destination holds."""
        out = [0] * n
        for d, depth in leading_depths(map(self.owners.get, blocks, repeat(0))).items():
            out[d] = depth
        return out


class PrefixTree(Policy):
    name: ClassVar[str] = "prefix-tree"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval_s: float = 120.0,
                 max_tree_size_chars: int = 2**26) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size_chars = max_tree_size_chars

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name, "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "eviction_interval_s": self.eviction_interval_s,
            "max_tree_size_chars": self.max_tree_size_chars,
        }

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        self.index = ApproxIndex(view.n)
        self._max_blocks = max(1, self.max_tree_size_chars // (CHARS_PER_TOKEN * view.block_size))
        self._next_eviction = self.eviction_interval_s

    def _min_load(self) -> int:
        inflight = self.view.inflight
        best = 0
        low = inflight[0]
        for d in range(1, len(inflight)):
            if inflight[d] < low:
                low = inflight[d]
                best = d
        return best

    def route(self, i: int, now: float) -> int:
        view = self.view
        if now >= self._next_eviction:
            for d in range(view.n):
                self.index.trim(d, self._max_blocks)
            while self._next_eviction <= now:
                self._next_eviction += self.eviction_interval_s
        blocks = view.blocks(i)
        inflight = view.inflight
        hi = max(inflight)
        lo = min(inflight)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            d = self._min_load()
        else:
            depth, _ = self.index.longest(blocks)
            tokens = view.input_tokens[i]
            matched = min(depth * view.block_size, tokens)
            if tokens and matched / tokens > self.cache_threshold:
                d = self.index.last[blocks[depth - 1]]
            else:
                d = self._min_load()
        self.index.insert(blocks, d, tail_first=True)
        return d


class GiePrefixScorer(Policy):
    name: ClassVar[str] = "gie-prefix"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0,
                 index_capacity_blocks: int | None = None) -> None:
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.index_capacity_blocks = index_capacity_blocks

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "weights": [self.prefix_weight, self.queue_weight, self.kv_weight]}

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        cap = self.index_capacity_blocks
        if cap is None:
            # autoTune: the index holds as many blocks as the pod's KV cache (num_gpu_blocks).
            cap = max(1, view.profile.kv_capacity_tokens // view.block_size)
        self.index = ApproxIndex(view.n, cap)

    def route(self, i: int, now: float) -> int:
        view = self.view
        n = view.n
        blocks = view.blocks(i)
        depths = self.index.depths(blocks, n)
        total_blocks = len(blocks) or 1
        queues = view.queue_depths()
        qmax = max(queues)
        qmin = min(queues)
        span = qmax - qmin
        engines = view.engines
        wp = self.prefix_weight / total_blocks
        wq = self.queue_weight
        wk = self.kv_weight
        best: list[int] = []
        best_score = -1.0
        for d in range(n):
            q = 1.0 if span == 0 else (qmax - queues[d]) / span
            cache = engines[d].cache
            score = wp * depths[d] + wq * q + wk * (1.0 - cache.pinned_tokens / cache.capacity_tokens)
            if score > best_score + 1e-12:
                best_score = score
                best = [d]
            elif score >= best_score - 1e-12:
                best.append(d)
        d = best[0] if len(best) == 1 else best[self.rng.randrange(len(best))]
        self.index.insert(blocks, d, tail_first=False)
        return d


class Preble(Policy):
    name: ClassVar[str] = "preble"
    wants_finish: ClassVar[bool] = True

    def __init__(self, window_s: float = 180.0, tree_ttl_s: float = 1800.0) -> None:
        self.window_s = window_s
        # The reference scheduler never evicts its global tree; here a prefix nobody sent for
        # `tree_ttl_s` is forgotten, which bounds memory on hour-long traces.
        self.tree_ttl_s = max(tree_ttl_s, window_s)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "window_s": self.window_s, "eviction_cost": False,
                "tree_ttl_s": self.tree_ttl_s}

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        n = view.n
        # block -> mask of GPUs requests holding it were sent to, and when it was last sent
        self._mask: dict[int, int] = {}
        self._when: dict[int, float] = {}
        self._sent: deque[tuple[float, list[int]]] = deque()
        self._window: list[deque[tuple[float, float]]] = [deque() for _ in range(n)]
        self._window_load = [0.0] * n
        # Time per output token per GPU, measured from finished requests (EWMA), seeded with the
        # profile's decode step at a small batch, as Preble seeds it with a profiled constant.
        prof = view.profile
        self._tpot = [prof.step_overhead_s + prof.weight_read_s] * n
        self._mean_out = 256.0
        # Router-side copy of what each GPU holds, for P (prefill cost of the uncached part).
        self._held = ApproxIndex(n, max(1, prof.kv_capacity_tokens // view.block_size))

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        load = self._window_load
        for d, q in enumerate(self._window):
            while q and q[0][0] < horizon:
                load[d] -= q.popleft()[1]
        sent = self._sent
        forget = now - self.tree_ttl_s
        when = self._when
        masks = self._mask
        while sent and sent[0][0] < forget:
            t, blocks = sent.popleft()
            for b in blocks:
                if when.get(b) == t:
                    del when[b]
                    del masks[b]

    def route(self, i: int, now: float) -> int:
        view = self.view
        n = view.n
        blocks = view.blocks(i)
        bs = view.block_size
        tokens = view.input_tokens[i]
        prof = view.profile
        self._expire(now)
        masks = self._mask
        when = self._when
        horizon = now - self.window_s
        matched = 0
        mask = 0
        for b in blocks:
            m = masks.get(b)
            if m is None:
                break
            matched += 1
            if when[b] >= horizon:
                mask = m
        matched_tokens = min(matched * bs, tokens)
        inflight = view.inflight
        load = self._window_load
        tpot = self._tpot
        mean_out = self._mean_out
        held = self._held.depths(blocks, n)
        if matched_tokens > tokens - matched_tokens:
            candidates = [d for d in range(n) if mask >> d & 1] if mask else list(range(n))
            best = candidates[0]
            best_cost = load[best] + inflight[best] * mean_out * tpot[best]
            for d in candidates[1:]:
                c = load[d] + inflight[d] * mean_out * tpot[d]
                if c < best_cost:
                    best_cost = c
                    best = d
        else:
            best = 0
            best_cost = float("inf")
            for d in range(n):
                cached = min(held[d] * bs, tokens)
                c = load[d] + inflight[d] * mean_out * tpot[d] + prof.prefill_time(tokens - cached, cached)
                if c < best_cost:
                    best_cost = c
                    best = d
        cached = min(held[best] * bs, tokens)
        cost = prof.prefill_time(tokens - cached, cached)
        self._window[best].append((now, cost))
        load[best] += cost
        bit = 1 << best
        for b in blocks:
            m = masks.get(b)
            masks[b] = bit if m is None or when[b] < horizon else m | bit
            when[b] = now
        self._sent.append((now, blocks))
        self._held.insert(blocks, best, tail_first=True)
        return best

    def on_finish(self, i: int, dest: int, now: float) -> None:
        req = self.view.req
        out = req.out[i]
        self._mean_out += (out - self._mean_out) * 0.01
        if out > 1:
            tpot = (req.finish[i] - req.first[i]) / (out - 1)
            self._tpot[dest] += (tpot - self._tpot[dest]) * 0.1
