"""Per-key request and token counts for the heaviest keys only (Space-Saving).

The sketch holds at most `capacity` keys. A new key takes the slot of the key with the smallest
estimate and inherits that estimate as its error, so after N requests:

- every tracked key's estimate is within [true count, true count + N / capacity];
- every key with more than N / capacity requests is tracked.

What is exported is not the estimate but what the key did *since it entered the sketch* (exact,
and monotonic while it stays); everything else is `__other__`, so the exported series always
add up to the true totals and never decrease while they exist. Each tracked key carries the wall
time it entered (its series' created timestamp), so a reader can tell a series that started
inside its window, whose first sample already holds requests, from one that was there before.

Updates come from the event loop; the metrics endpoint reads from its own thread, hence the lock.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class _Entry:
    __slots__ = ("created", "error", "estimate", "name", "prefix_tokens", "prompt_tokens", "requests")

    def __init__(self, estimate: int, error: int, name: str | None, created: float) -> None:
        self.estimate = estimate
        self.error = error
        self.created = created
        self.requests = 0
        self.prompt_tokens = 0
        self.prefix_tokens = 0
        self.name = name


@dataclass(frozen=True)
class KeyCounts:
    key: int
    name: str | None
    requests: int
    prompt_tokens: int
    prefix_tokens: int
    estimate: int
    error: int
    created: float  # unix seconds the key entered the sketch (its counts start from zero there)


@dataclass(frozen=True)
class SketchSnapshot:
    keys: tuple[KeyCounts, ...]
    total_requests: int
    total_prompt_tokens: int
    total_prefix_tokens: int
    capacity: int
    started: float  # unix seconds the sketch was made (`__other__` counts from there)

    @property
    def other_requests(self) -> int:
        return self.total_requests - sum(k.requests for k in self.keys)

    @property
    def other_prompt_tokens(self) -> int:
        return self.total_prompt_tokens - sum(k.prompt_tokens for k in self.keys)

    @property
    def other_prefix_tokens(self) -> int:
        return self.total_prefix_tokens - sum(k.prefix_tokens for k in self.keys)

    @property
    def error_bound(self) -> float:
        """No tracked estimate exceeds its key's true request count by more than this."""
        return self.total_requests / self.capacity


class HeavyKeys:
    def __init__(self, capacity: int, *, keep_names: bool = False, clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"sketch capacity {capacity} must be >= 1")
        self.capacity = capacity
        self._keep_names = keep_names
        self._clock = clock
        self.started = clock()
        self._entries: dict[int, _Entry] = {}
        # (estimate when pushed, key); an estimate only grows, so a stale entry is a lower bound.
        self._heap: list[tuple[int, int]] = []
        self._total_requests = 0
        self._total_prompt = 0
        self._total_prefix = 0
        self._lock = threading.Lock()

    def add(self, key: int, prompt_tokens: int = 0, prefix_tokens: int = 0, name: str | None = None) -> None:
        """Count one request of `key` with its token counts."""
        # Acquired and released by name: compiled, a with statement looks up the lock's two special
        # methods on every request.
        lock = self._lock
        lock.acquire()
        try:
            self._total_requests += 1
            self._total_prompt += prompt_tokens
            self._total_prefix += prefix_tokens
            entry = self._entries.get(key)
            if entry is None:
                entry = self._admit(key, name if self._keep_names else None)
            entry.estimate += 1
            entry.requests += 1
            entry.prompt_tokens += prompt_tokens
            entry.prefix_tokens += prefix_tokens
        finally:
            lock.release()

    def _admit(self, key: int, name: str | None) -> _Entry:
        if len(self._entries) < self.capacity:
            entry = _Entry(0, 0, name, self._clock())
        else:
            floor = self._evict_min()
            entry = _Entry(floor, floor, name, self._clock())
        self._entries[key] = entry
        # Pushed with the estimate it will have after this request: a lower bound from now on.
        heapq.heappush(self._heap, (entry.estimate + 1, key))
        return entry

    def _evict_min(self) -> int:
        heap = self._heap
        while True:
            estimate, key = heap[0]
            current = self._entries[key].estimate
            if current == estimate:
                heapq.heappop(heap)
                del self._entries[key]
                return estimate
            heapq.heapreplace(heap, (current, key))

    def estimate(self, key: int) -> tuple[int, int] | None:
        """(estimate, error) of a tracked key; None when the key is not tracked."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else (entry.estimate, entry.error)

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self) -> SketchSnapshot:
        with self._lock:
            rows = [
                (k, e.name, e.requests, e.prompt_tokens, e.prefix_tokens, e.estimate, e.error, e.created)
                for k, e in self._entries.items()
            ]
            totals = (self._total_requests, self._total_prompt, self._total_prefix)
        return SketchSnapshot(
            keys=tuple(KeyCounts(*row) for row in rows),
            total_requests=totals[0],
            total_prompt_tokens=totals[1],
            total_prefix_tokens=totals[2],
            capacity=self.capacity,
            started=self.started,
        )
