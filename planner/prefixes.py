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
- `record` notes that every prefix of the chain went to the chosen destination, forgetting what
  was sent there least recently beyond `capacity` prefixes per destination (the estimate of each
  destination's LRU cache that GIE's prefix scorer keeps too).

Destinations are small integers (the replay's indexes), so the
destinations a prefix went to are one bit mask.

`follow_target` applies the rule of thumb of per-request cache-aware routers (Preble, SGLang):
follow only when the remembered prefix covers more than half of the prompt. `PrefixFollower` also
asks that the destination followed hold more of the prompt than any other: a system prompt that
has gone everywhere is no reason to send a new conversation to the last destination it went to
(the routing rule scores every destination by what it holds instead, step 6), and following it
would herd every new conversation that starts with a long shared system prompt onto one
destination, up to the load bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import chain

from cacheroute.planner.tokenload import uncached_tokens

# Follow a remembered prefix only when it is more than this share of the prompt.
FOLLOW_MIN_SHARE = 0.5
# Prefix blocks a router remembers at most by default: 262,144 blocks of 256 tokens cover 67M
# tokens, more than 30 H100 replicas hold on GPU and in host memory, in about 55 MiB of router
# memory (220 bytes per block, measured with tracemalloc over 8 destinations).
DEFAULT_PREFIX_MEMORY_BLOCKS = 262_144


def memory_blocks(fleet_kv_tokens: int, destinations: int, block_tokens: int, limit: int) -> int:
    """How many prefix blocks to remember per destination: its share of what the fleet's KV cache
    holds (GPU and host tiers; a prefix its cache has surely evicted is not worth following), the
    whole memory `limit` blocks at most; `limit` shared out when the fleet's capacity is not
    known (0)."""
    total = limit if fleet_kv_tokens <= 0 else min(limit, fleet_kv_tokens // block_tokens)
    return max(1, total // max(1, destinations))


def leading_depths(masks: Iterable[int]) -> dict[int, int]:
    """Destination -> how many leading prefixes of a prompt it holds, from the masks of the
    destinations holding each prefix in turn (bit d: destination d); those holding none are
    absent. Stops at the first prefix nobody holds."""
    depths: dict[int, int] = {}
    rest = iter(masks)
    running = next(rest, 0)
    depth = 1
    # A final empty mask ends the prompt: whoever still holds it holds all of it.
    for mask in chain(rest, (0,)):
        if not running:
            break
        # The destinations this prefix is not on hold the prompt up to the one before only.
        dropped = running & ~mask
        while dropped:
            low = dropped & -dropped
            depths[low.bit_length() - 1] = depth
            dropped ^= low
        running &= mask
        depth += 1
    return depths


class PrefixMemory:
    """Prefix id -> (the last destination it went to, mask of the destinations that may still
    hold it). Each destination holds at most `capacity` prefixes: what was sent there least
    recently goes first, as its engine's LRU cache evicts, and within one prompt the end before
    the start (vLLM frees a finished request's blocks tail first)."""

    __slots__ = ("_entries", "_sent", "capacity")

    def __init__(self, capacity: int) -> None:
        self._entries: dict[int, tuple[int, int]] = {}
        # Destination -> the prefixes it holds, least recently sent first.
        self._sent: dict[int, OrderedDict[int, None]] = {}
        self.resize(capacity)

    def __len__(self) -> int:
        return len(self._entries)

    def resize(self, capacity: int) -> None:
        """Hold at most `capacity` prefixes per destination from now on."""
        if capacity < 1:
            raise ValueError(f"prefix memory capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        for destination, sent in self._sent.items():
            self._drop(destination, sent, len(sent) - capacity)

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
        return leading_depths(0 if e is None else e[1] for e in map(self._entries.get, prefixes))

    def record(self, prefixes: Sequence[int], destination: int) -> None:
        entries = self._entries
        get = entries.get
        sent = self._sent.get(destination)
        if sent is None:
            sent = self._sent[destination] = OrderedDict()
        touch = sent.move_to_end
        bit = 1 << destination
        # The start of the prompt last: it is the most recently used, the last to go.
        for p in reversed(prefixes):
            e = get(p)
            if e is None:
                entries[p] = (destination, bit)
                sent[p] = None
            else:
                entries[p] = (destination, e[1] | bit)
                if e[1] & bit:
                    touch(p)
                else:
                    sent[p] = None
        over = len(sent) - self.capacity
        if over > 0:
            self._drop(destination, sent, over)

    def _drop(self, destination: int, sent: OrderedDict[int, None], count: int) -> None:
        """Forget the `count` prefixes sent to `destination` least recently."""
        entries = self._entries
        keep = ~(1 << destination)
        popitem = sent.popitem
        for _ in range(count):
            p, _ = popitem(last=False)
            last, was = entries[p]
            mask = was & keep
            if not mask:
                del entries[p]
            elif last == destination:
                entries[p] = (mask.bit_length() - 1, mask)
            else:
                entries[p] = (last, mask)

    def forget(self, destination: int) -> None:
        """Drop `destination` from every prefix (it left the pool); prefixes only it had go."""
        sent = self._sent.pop(destination, None)
        if sent is not None:
            self._drop(destination, sent, len(sent))


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
    A decision asks them in that order, `held` in between when it scores the request.
    """

    __slots__ = ("_walked", "block_tokens", "memory", "per_token")

    def __init__(self, capacity: int, block_tokens: int, per_token: float) -> None:
        if block_tokens < 1:
            raise ValueError(f"tokens per prefix block must be at least 1, got {block_tokens}")
        self.memory = PrefixMemory(capacity)
        self.block_tokens = block_tokens
        # Load units per prompt token (0: load counts requests only).
        self.per_token = per_token
        # The chain `target` last declined and what every destination holds of it: `held` and
        # `settle` of the same decision read it instead of walking the chain again.
        self._walked: tuple[Sequence[int], dict[int, int]] | None = None

    def target(self, chain: Sequence[int], prompt_tokens: int) -> tuple[int, float]:
        """(the destination to follow or -1, the load the request sheds by going there)."""
        self._walked = None
        memory = self.memory
        depth, at = memory.match(chain)
        # Only whole blocks count: a prompt shorter than one block has nothing worth following, and
        # two short prompts that happen to be equal (a greeting) must not pull keys off their plan.
        matched = min(depth, prompt_tokens // self.block_tokens)
        follow = follow_target(matched * self.block_tokens, prompt_tokens, at)
        if follow is None:
            return -1, 0.0
        # Only a prompt worth following pays for a look at what the others hold (docstring).
        depths = memory.held_depths(chain)
        for destination, held in depths.items():
            if destination != follow and held >= matched:
                self._walked = (chain, depths)
                return -1, 0.0
        return follow, matched * self.block_tokens * self.per_token

    def held(self, chain: Sequence[int], prompt_tokens: int) -> dict[int, int]:
        """Destination -> the prompt tokens it is remembered to hold, in whole blocks of the prompt
        (destinations holding none are absent): what the routing rule scores unplanned requests by."""
        size = self.block_tokens
        whole = prompt_tokens // size
        if not whole:
            return {}
        return {d: min(depth, whole) * size for d, depth in self._depths(chain).items()}

    def settle(self, chain: Sequence[int], destination: int, prompt_tokens: int) -> int:
        """Record the decision; the prompt tokens `destination` is expected to compute."""
        walked = self._walked
        if walked is not None and walked[0] is chain:
            held = walked[1].get(destination, 0)
        else:
            held = self.memory.held_by(chain, destination)
        self._walked = None
        self.memory.record(chain, destination)
        return uncached_tokens(prompt_tokens, held * self.block_tokens)

    def _depths(self, chain: Sequence[int]) -> dict[int, int]:
        walked = self._walked
        if walked is not None and walked[0] is chain:
            return walked[1]
        return self.memory.held_depths(chain)
