"""Cache-blind and hash-based routing policies.

- `round-robin` (Flat-LB): destinations in turn.
- `random`: uniform choice.
- `least-loaded`: fewest router-tracked in-flight requests (ties: first found from a rotating start).
- `p2c`: power of two choices on in-flight requests (SGLang `power_of_two.rs`: two distinct random
  destinations, the less loaded wins).
- `sticky-hash`: hash(affinity key) mod N; requests without a key go p2c.
- `chwbl`: KubeAI's consistent hashing with bounded loads (`internal/loadbalancer/balance_chwbl.go`):
  `replication` virtual nodes per destination, walk clockwise from hash(key) and take the first
  destination whose `in_flight + 1 <= (total_in_flight + 1) / N * load_factor` (any destination when
  nothing is in flight); when none qualifies, the first one on the walk.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Callable
from typing import ClassVar

from cacheroute.planner.replay.policy import Policy, RouterView
from cacheroute.planner.trace import NO_KEY


def p2c_pick(inflight: list[int], n: int, random: Callable[[], float]) -> int:
    """Power of two choices: the less loaded of two distinct uniformly drawn destinations
    (`random` draws uniformly from [0, 1); its C implementation is much faster than randrange)."""
    if n == 1:
        return 0
    a = int(random() * n)
    b = int(random() * (n - 1))
    if b >= a:
        b += 1
    return a if inflight[a] <= inflight[b] else b


class RoundRobin(Policy):
    name: ClassVar[str] = "round-robin"

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        self._next = 0

    def route(self, i: int, now: float) -> int:
        d = self._next
        self._next = d + 1 if d + 1 < self.view.n else 0
        return d


class RandomChoice(Policy):
    name: ClassVar[str] = "random"

    def route(self, i: int, now: float) -> int:
        return self.rng.randrange(self.view.n)


class LeastLoaded(Policy):
    name: ClassVar[str] = "least-loaded"

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        self._start = 0

    def route(self, i: int, now: float) -> int:
        inflight = self.view.inflight
        n = len(inflight)
        s = self._start
        self._start = s + 1 if s + 1 < n else 0
        best = s
        low = inflight[s]
        for d in range(s + 1, n):
            if inflight[d] < low:
                low = inflight[d]
                best = d
        for d in range(s):
            if inflight[d] < low:
                low = inflight[d]
                best = d
        return best


class PowerOfTwo(Policy):
    name: ClassVar[str] = "p2c"

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        self._inflight = view.inflight
        self._n = view.n
        self._random = self.rng.random

    def route(self, i: int, now: float) -> int:
        n = self._n
        if n == 1:
            return 0
        rnd = self._random
        a = int(rnd() * n)
        b = int(rnd() * (n - 1))
        if b >= a:
            b += 1
        inflight = self._inflight
        return a if inflight[a] <= inflight[b] else b


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class StickyHash(Policy):
    name: ClassVar[str] = "sticky-hash"

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        self._dest_of_key = (view.key_hashes() % view.n).astype(int).tolist() if view.n else []

    def route(self, i: int, now: float) -> int:
        k = self.view.key[i]
        if k == NO_KEY:
            return p2c_pick(self.view.inflight, self.view.n, self.rng.random)
        d: int = self._dest_of_key[k]
        return d


class BoundedConsistentHash(Policy):
    name: ClassVar[str] = "chwbl"

    def __init__(self, replication: int = 256, load_factor: float = 1.25) -> None:
        if replication < 1:
            raise ValueError("chwbl replication must be at least 1")
        if load_factor < 1.0:
            raise ValueError("chwbl load factor must be at least 1.0")
        self.replication = replication
        self.load_factor = load_factor

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "replication": self.replication, "load_factor": self.load_factor}

    def bind(self, view: RouterView, seed: int) -> None:
        super().bind(view, seed)
        ring = sorted(
            (_hash64(f"{dest}{r}"), d)
            for d, dest in enumerate(view.destination_ids)
            for r in range(self.replication)
        )
        self._ring = [h for h, _ in ring]
        self._owners = [d for _, d in ring]
        self._walks: dict[int, tuple[int, ...]] = {}
        hashes = view.key_hashes()
        self._key_hash: list[int] = [int(h) for h in hashes]

    def _walk_from(self, start: int) -> tuple[int, ...]:
        """Distinct destinations met walking clockwise from a ring position. A destination met
        again later on the walk passes or fails the load check exactly as the first time, so
        checking each once gives the same answer as walking every virtual node."""
        owners = self._owners
        n = self.view.n
        size = len(owners)
        seen: list[int] = []
        flags = [False] * n
        pos = start
        while len(seen) < n:
            d = owners[pos]
            if not flags[d]:
                flags[d] = True
                seen.append(d)
            pos = pos + 1 if pos + 1 < size else 0
        walk = tuple(seen)
        self._walks[start] = walk
        return walk

    def route(self, i: int, now: float) -> int:
        view = self.view
        k = view.key[i]
        if k == NO_KEY:
            return p2c_pick(view.inflight, view.n, self.rng.random)
        pos = bisect_left(self._ring, self._key_hash[k])
        if pos == len(self._ring):
            pos = 0
        walk = self._walks.get(pos)
        if walk is None:
            walk = self._walk_from(pos)
        total = view.total_inflight
        if total == 0:
            return walk[0]
        inflight = view.inflight
        threshold = (total + 1) / view.n * self.load_factor
        for d in walk:
            if inflight[d] + 1 <= threshold:
                return d
        return walk[0]
