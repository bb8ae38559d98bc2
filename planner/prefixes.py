"""Where prompts went: a router's bounded memory of the prefixes it routed, and which one to follow.

A router that sends the next turn of a conversation where the previous turn went finds the
conversation's history in that destination's cache. This memory lets the routing rule do so
(`routing.RoutingRule.choose(..., follow=...)`) without any view of the engines' caches:

- the caller describes a prompt as a chain of prefix ids, each naming the whole prompt up to a
  boundary every `block_tokens` tokens (the replay: its prefix-chained block ids; the router: a
  hash chain over fixed-size pieces of the prompt's text, `router/prompts.py`);
- `match` finds the deepest prefix of the chain the memory holds and the destination the last
  request with that prefix went to;
- `held_by` counts the leading prefixes of the chain that were sent to a given destination (what
  that destination may still hold in its cache), `held_depths` the same for every destination;
- `record` notes that every prefix of the chain went to the chosen destination, forgetting the
  least recently used prefixes beyond `capacity`.

Destinations are small integers (the replay's indexes), so the
destinations a prefix went to are one bit mask.

`follow_target` applies the rule of thumb of per-request cache-aware routers (Preble, SGLang):
follow only when the remembered prefix covers more than half of the prompt, so a prefix common
to every request (a system prompt) does not herd traffic onto one destination.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from cacheroute.planner.tokenload import uncached_tokens

# Follow a remembered prefix only when it is more than this share of the prompt.
FOLLOW_MIN_SHARE = 0.5
# Prefix blocks a router remembers at most by default: 262,144 blocks of 256 tokens cover 67M
# tokens, more than 30 H100 replicas hold on GPU and in host memory, in about 46 MiB of router
# memory (183 bytes per block, measured with tracemalloc).
DEFAULT_PREFIX_MEMORY_BLOCKS = 262_144


def memory_blocks(fleet_kv_tokens: int, block_tokens: int, limit: int) -> int:
    """How many prefix blocks to remember: as many as the fleet's KV cache holds (GPU and host
    tiers; a prefix the caches have surely evicted is not worth following), at most `limit`;
    `limit` when the fleet's capacity is not known (0)."""
    if fleet_kv_tokens <= 0:
        return limit
    return max(1, min(limit, fleet_kv_tokens // block_tokens))


class PrefixMemory:
    """Prefix id -> (the last destination it went to, mask of the destinations it went to),
    least recently used out."""

    __slots__ = ("_entries", "capacity")

    def __init__(self, capacity: int) -> None:
        self._entries: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.resize(capacity)

    def __len__(self) -> int:
        return len(self._entries)

    def resize(self, capacity: int) -> None:
        """Hold at most `capacity` prefixes from now on (the least recently used go first)."""
        if capacity < 1:
            raise ValueError(f"prefix memory capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        entries = self._entries
        while len(entries) > capacity:
            entries.popitem(last=False)

    def match(self, prefixes: Sequence[int]) -> tuple[int, int]:
        """(number of leading prefixes held, the last destination of the deepest; -1 if none)."""
        get = self._entries.get
        depth = 0
        at = -1
        for p in prefixes:
            e = get(p)
            if e is None:
                break
            depth += 1
            at = e[0]
        return depth, at

    def held_by(self, prefixes: Sequence[int], destination: int) -> int:
        """Leading prefixes of the chain that went to `destination`."""
        get = self._entries.get
        bit = 1 << destination
        depth = 0
        for p in prefixes:
            e = get(p)
            if e is None or not e[1] & bit:
                break
            depth += 1
        return depth

    def held_depths(self, prefixes: Sequence[int]) -> dict[int, int]:
        """`held_by` for every destination in one pass over the chain: destination -> leading
        prefixes it was sent (destinations sent none are absent)."""
        get = self._entries.get
        depths: dict[int, int] = {}
        running = 0
        depth = 0
        for p in prefixes:
            e = get(p)
            mask = 0 if e is None else e[1]
            if depth:
                # The destinations this prefix did not go to hold the chain up to here only.
                dropped = running & ~mask
                while dropped:
                    low = dropped & -dropped
                    depths[low.bit_length() - 1] = depth
                    dropped ^= low
                running &= mask
            else:
                running = mask
            if not running:
                return depths
            depth += 1
        while running:
            low = running & -running
            depths[low.bit_length() - 1] = depth
            running ^= low
        return depths

    def record(self, prefixes: Sequence[int], destination: int) -> None:
        entries = self._entries
        pop = entries.pop
        bit = 1 << destination
        for p in prefixes:
            e = pop(p, None)
            entries[p] = (destination, bit if e is None else e[1] | bit)
        over = len(entries) - self.capacity
        if over > 0:
            popitem = entries.popitem
            for _ in range(over):
                popitem(last=False)

    def forget(self, destination: int) -> None:
        """Drop `destination` from every prefix (it left the pool); prefixes only it had go."""
        entries = self._entries
        keep = ~(1 << destination)
        for p, (last, was) in list(entries.items()):
            mask = was & keep
            if not mask:
                del entries[p]
            elif last == destination:
                entries[p] = (mask.bit_length() - 1, mask)
            else:
                entries[p] = (last, mask)


def follow_target(matched_tokens: int, prompt_tokens: int, at: int) -> int | None:
    """The destination to follow, when the remembered prefix is worth it (module docstring)."""
    if at < 0 or matched_tokens <= FOLLOW_MIN_SHARE * prompt_tokens:
        return None
    return at


class PrefixFollower:
    """The memory and the rule of thumb as the router and the replay use them, in one place.

    `target` says where a prompt should follow its prefix and what it weighs less there (the
    routing rule's `follow` and `follow_gain`); `settle` records where it went and returns the
    prompt tokens that destination still has to compute (its charge under token-aware load).
    """

    __slots__ = ("block_tokens", "memory", "per_token")

    def __init__(self, capacity: int, block_tokens: int, per_token: float) -> None:
        if block_tokens < 1:
            raise ValueError(f"tokens per prefix block must be at least 1, got {block_tokens}")
        self.memory = PrefixMemory(capacity)
        self.block_tokens = block_tokens
        # Load units per prompt token (0: load counts requests only).
        self.per_token = per_token

    def target(self, chain: Sequence[int], prompt_tokens: int) -> tuple[int, float]:
        """(the destination to follow or -1, the load the request sheds by going there)."""
        depth, at = self.memory.match(chain)
        # Only whole blocks count: a prompt shorter than one block has nothing worth following, and
        # two short prompts that happen to be equal (a greeting) must not pull keys off their plan.
        matched = min(depth, prompt_tokens // self.block_tokens) * self.block_tokens
        follow = follow_target(matched, prompt_tokens, at)
        if follow is None:
            return -1, 0.0
        return follow, matched * self.per_token

    def held(self, chain: Sequence[int], prompt_tokens: int) -> dict[int, int]:
        """Destination -> the prompt tokens it is remembered to hold, in whole blocks of the prompt
        (destinations holding none are absent): what the routing rule scores unplanned requests by."""
        size = self.block_tokens
        whole = prompt_tokens // size
        return {d: min(depth, whole) * size for d, depth in self.memory.held_depths(chain).items()
                if depth and whole}

    def settle(self, chain: Sequence[int], destination: int, prompt_tokens: int) -> int:
        """Record the decision; the prompt tokens `destination` is expected to compute."""
        memory = self.memory
        held = memory.held_by(chain, destination) * self.block_tokens
        memory.record(chain, destination)
        return uncached_tokens(prompt_tokens, held)
