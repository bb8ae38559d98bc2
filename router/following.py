"""The router's memory of the prefixes it routed, over its endpoints.

`planner/prefixes.py` holds the memory and the rule of thumb (shared with the replay); it names
destinations by small integers. This module gives each known endpoint such a number (a slot),
reuses the slot of an endpoint that left, and makes the memory forget what it sent there (a new
pod at the same address starts with an empty cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cacheroute.planner.prefixes import PrefixFollower
from cacheroute.router.endpoints import Endpoint
from cacheroute.router.prompts import BLOCK_TOKENS


class RoutedPrefixes:
    """Where prompts went, by endpoint; `sync` after every membership change."""

    __slots__ = ("_at", "_follower", "_slot")

    def __init__(self, capacity: int, per_token: float) -> None:
        self._follower = PrefixFollower(capacity, BLOCK_TOKENS, per_token)
        self._slot: dict[Endpoint, int] = {}
        self._at: list[Endpoint | None] = []

    def __len__(self) -> int:
        return len(self._follower.memory)

    @property
    def capacity(self) -> int:
        return self._follower.memory.capacity

    def resize(self, capacity: int) -> None:
        self._follower.memory.resize(capacity)

    def sync(self, endpoints: Mapping[str, Endpoint]) -> None:
        """Follow the pool's membership: forget endpoints that left, number new ones."""
        current = set(endpoints.values())
        for endpoint, slot in list(self._slot.items()):
            if endpoint not in current:
                del self._slot[endpoint]
                self._at[slot] = None
                self._follower.memory.forget(slot)
        for endpoint in endpoints.values():
            if endpoint not in self._slot:
                slot = next((i for i, e in enumerate(self._at) if e is None), len(self._at))
                if slot == len(self._at):
                    self._at.append(endpoint)
                else:
                    self._at[slot] = endpoint
                self._slot[endpoint] = slot

    def target(self, chain: Sequence[int], prompt_tokens: int) -> tuple[Endpoint | None, float]:
        """The endpoint to follow (None: none) and the load the request sheds there."""
        slot, gain = self._follower.target(chain, prompt_tokens)
        return (self._at[slot] if slot >= 0 else None), gain

    def held(self, chain: Sequence[int], prompt_tokens: int) -> dict[Endpoint, int]:
        """Endpoint -> the prompt tokens it is remembered to hold (endpoints holding none absent)."""
        at = self._at
        held: dict[Endpoint, int] = {}
        for slot, tokens in self._follower.held(chain, prompt_tokens).items():
            endpoint = at[slot]
            if endpoint is not None:
                held[endpoint] = tokens
        return held

    def settle(self, chain: Sequence[int], endpoint: Endpoint, prompt_tokens: int) -> int:
        """Record the decision; the prompt tokens the endpoint is expected to compute."""
        slot = self._slot.get(endpoint)
        if slot is None:
            return prompt_tokens
        return self._follower.settle(chain, slot, prompt_tokens)
