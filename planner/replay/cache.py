"""The prefix KV cache of one destination: blocks with reference counts and an LRU of free ones.

It follows vLLM's prefix caching: a running sequence pins the blocks of its prompt (shared blocks
are counted once, by reference); when it finishes its blocks become free but keep their content,
and are reused by a later request with the same prefix until they are evicted, least recently
freed first. A hit counts only the contiguous run of cached blocks from the start of the prompt.
Blocks are released tail first, so the tail of a prompt is evicted before its head (vLLM frees in
reverse order for the same reason).

Capacity is in tokens: pinned blocks x block size + private tokens of running sequences (their
output, reserved at admission) + free cached blocks x block size never exceeds it.

Optionally a second tier in host memory (vLLM's native KV offloading, `--kv-offloading-backend
native --kv-offloading-size`): a block evicted from the GPU is kept in pinned CPU memory, least
recently used first out; a prompt whose cached run continues in host memory past the GPU's
blocks counts those blocks as hits too, and the engine pays for copying them back
(`Engine`, `EngineProfile.host_copy_s_per_token`). A block copied back stays in host memory as
well (the host tier is touched, not emptied, by a load).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class PrefixCache:
    """Reference-counted blocks plus an LRU of free blocks, in one dict.

    `state[block]` is the number of running sequences using the block (> 0), or minus the stamp
    of the release that freed it (< 0). The LRU order lives in a FIFO of releases, (stamp, the
    released prompt's blocks): a release frees its prompt tail first, so eviction walks each
    released prompt backwards, skipping blocks whose state no longer carries that stamp (still
    pinned by another request, reused since, or freed again later). One plain dict and one FIFO
    entry per release keep this, the replay's innermost loop, cheap.
    """

    __slots__ = ("_clock", "_cursor", "_fifo", "block_size", "capacity_tokens", "host", "host_blocks", "ideal",
                 "loaded", "n_free", "pinned_tokens", "state")

    def __init__(self, capacity_tokens: int, block_size: int, host_capacity_tokens: int = 0,
                 ideal: set[int] | None = None) -> None:
        if capacity_tokens <= 0 or block_size <= 0:
            raise ValueError("cache capacity and block size must be positive")
        if host_capacity_tokens < 0:
            raise ValueError("host cache capacity must not be negative")
        self.capacity_tokens = capacity_tokens
        self.block_size = block_size
        # The host tier: blocks in LRU order (oldest first); None when there is none.
        self.host_blocks = host_capacity_tokens // block_size
        self.host: OrderedDict[int, None] | None = OrderedDict() if self.host_blocks > 0 else None
        # Blocks the last `admit` found in host memory only (to be copied back).
        self.loaded = 0
        # The ideal cache (a bound, not a model): every block any destination ever computed, shared
        # by all destinations and never evicted; hits come from it alone.
        self.ideal = ideal
        self.state: dict[int, int] = {}
        self.n_free = 0
        self._fifo: deque[tuple[int, Sequence[int]]] = deque()
        # Blocks of the oldest release still to examine: its prompt is walked from the end.
        self._cursor = -1
        self._clock = 0
        self.pinned_tokens = 0

    def cached_tokens(self) -> int:
        return len(self.state) * self.block_size

    def host_tokens(self) -> int:
        return len(self.host) * self.block_size if self.host is not None else 0

    def usage(self) -> float:
        """Share of the capacity held by running sequences (vLLM's kv_cache_usage_perc / 100)."""
        return self.pinned_tokens / self.capacity_tokens

    def lookup(self, blocks: Sequence[int]) -> int:
        """Leading blocks of `blocks` present in the cache (pinned or free), without touching it."""
        state = self.state
        n = 0
        for b in blocks:
            if b in state:
                n += 1
            else:
                break
        return n

    def free_order(self) -> list[int]:
        """Free blocks, the next to be evicted first."""
        state = self.state
        order: list[int] = []
        for k, (t, blocks) in enumerate(self._fifo):
            start = self._cursor if k == 0 and self._cursor >= 0 else len(blocks) - 1
            order.extend(b for b in (blocks[j] for j in range(start, -1, -1)) if state.get(b) == -t)
        return order

    def admit(self, blocks: Sequence[int], private_tokens: int) -> int:
        """Pin a prompt's blocks plus `private_tokens`; return the number of leading hit blocks.

        Blocks of one prompt are distinct (prefix chaining guarantees it). Returns -1 and changes
        nothing when the request does not fit next to the pinned blocks. Hits include blocks found
        only in host memory; `loaded` says how many of them were (what has to be copied back).
        """
        state = self.state
        bs = self.block_size
        cap = self.capacity_tokens
        get = state.get
        if self.pinned_tokens + len(blocks) * bs + private_tokens > cap:
            # Might not fit: count exactly what would have to be pinned before touching anything.
            to_pin = 0
            for b in blocks:
                c = get(b)
                if c is None or c < 0:
                    to_pin += 1
            if self.pinned_tokens + to_pin * bs + private_tokens > cap:
                return -1
        hit = 0
        counting = True
        to_pin = 0
        revived = 0
        host = self.host
        loaded = 0
        for b in blocks:
            c = get(b)
            if c is None:
                state[b] = 1
                to_pin += 1
                if counting:
                    if host is not None and b in host:
                        host.move_to_end(b)
                        loaded += 1
                        hit += 1
                    else:
                        counting = False
            elif c > 0:
                state[b] = c + 1
                if counting:
                    hit += 1
            else:
                state[b] = 1
                to_pin += 1
                revived += 1
                if counting:
                    hit += 1
        self.loaded = loaded
        ideal = self.ideal
        if ideal is not None:
            hit = 0
            for b in blocks:
                if b not in ideal:
                    break
                hit += 1
            self.loaded = 0
            ideal.update(blocks)
        self.n_free -= revived
        self.pinned_tokens += to_pin * bs + private_tokens
        excess = self.pinned_tokens + self.n_free * bs - cap
        if excess > 0:
            self._evict(excess)
        return hit

    def _evict(self, excess: int) -> None:
        state = self.state
        get = state.get
        fifo = self._fifo
        bs = self.block_size
        evicted = 0
        j = self._cursor
        host = self.host
        while excess > 0:
            t, blocks = fifo[0]
            if j < 0:
                j = len(blocks) - 1
            stamp = -t
            while j >= 0:
                b = blocks[j]
                j -= 1
                if get(b) == stamp:
                    del state[b]
                    evicted += 1
                    excess -= bs
                    if host is not None:
                        # Offloaded: the most recently used block of the host tier.
                        if b in host:
                            host.move_to_end(b)
                        else:
                            host[b] = None
                    if excess <= 0:
                        break
            if j < 0:
                fifo.popleft()
        self._cursor = j
        self.n_free -= evicted
        if host is not None:
            over = len(host) - self.host_blocks
            popitem = host.popitem
            for _ in range(over):
                popitem(last=False)

    def release(self, blocks: Sequence[int], private_tokens: int) -> None:
        """Unpin what `admit` pinned; blocks nobody uses any more become free, tail first."""
        state = self.state
        t = self._clock + 1
        self._clock = t
        stamp = -t
        freed = 0
        for b in blocks:
            c = state[b]
            if c == 1:
                state[b] = stamp
                freed += 1
            else:
                state[b] = c - 1
        if freed:
            self._fifo.append((t, blocks))
        self.n_free += freed
        self.pinned_tokens -= freed * self.block_size + private_tokens
