"""Choosing the endpoint of one request.

- A planned key goes to the least-loaded ready destination of its plan entry; ties go to the
  destination a hash of the key points at, so every router replica with the same view of load
  picks the same one.
- Bounded affinity: when that destination's load exceeds `spill_threshold x mean + slack` (mean
  over ready endpoints), the request spills to power-of-two-choices among the other endpoints.
- An unplanned key goes to key-seeded p2c (`unplanned="key-p2c"`, the default): the less loaded
  of two candidates derived from the key's hash on a consistent-hash ring of all endpoints
  (`cacheroute.planner.keyring`), so the next turns of a conversation whose key is not planned
  find its prefix on one of two endpoints; a candidate that is not ready is skipped, and with
  neither ready the request goes to plain p2c. `unplanned="p2c"` draws both at random.
- Everything else (no key, planned destinations all unready) goes to p2c.

Load is the router's own in-flight count for the endpoint plus the queue depth the endpoint
reports on /metrics: the first reacts within a request, the second sees other router replicas.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import NamedTuple

from cacheroute.planner.keyring import DEFAULT_UNPLANNED, KeyRing, check_unplanned_mode
from cacheroute.planner.plan import KeyExtraction
from cacheroute.router.endpoints import Endpoint, EndpointPool
from cacheroute.router.settings import KeyOverrides
from cacheroute.router.table import RoutingTable, resolve_groups

PLANNED = "planned"
SPILLED = "spilled"
P2C = "p2c"
NONE = "none"
OUTCOMES = (PLANNED, SPILLED, P2C, NONE)


class Decision(NamedTuple):
    outcome: str
    # Primary first, then fallbacks; empty when no endpoint is ready.
    endpoints: tuple[Endpoint, ...]


_NO_ENDPOINT = Decision(NONE, ())


class _View(NamedTuple):
    table: RoutingTable
    groups: tuple[tuple[Endpoint, ...], ...]
    spill_threshold: float
    key_extraction: KeyExtraction
    # Request headers worth reading: the key and session headers, and the body size.
    headers: frozenset[str]
    # Key-seeded p2c: the ring over every known endpoint, and the endpoint of each ring member.
    ring: KeyRing | None
    ring_endpoints: tuple[Endpoint, ...]


class Picker:
    def __init__(
        self,
        pool: EndpointPool,
        *,
        spill_threshold: float | None = None,
        spill_slack: float = 2.0,
        fallbacks: int = 0,
        keys: KeyOverrides | None = None,
        seed: int | None = None,
        unplanned: str = DEFAULT_UNPLANNED,
    ) -> None:
        self.pool = pool
        self._key_seeded = check_unplanned_mode(unplanned) == "key-p2c"
        self._threshold_override = spill_threshold
        self._slack = spill_slack
        self._fallbacks = fallbacks
        self._keys = keys or KeyOverrides()
        self._random = random.Random(seed).random
        self._view = self._make_view(RoutingTable.empty())
        pool.on_change(self.refresh)

    # --- plan -------------------------------------------------------------------------------------

    def _make_view(self, table: RoutingTable) -> _View:
        threshold = self._threshold_override if self._threshold_override is not None else table.spill_threshold
        extraction = self._keys.apply(table.key_extraction)
        headers = frozenset(h for h in (extraction.header, extraction.session_header, "content-length") if h)
        ring, ring_endpoints = self._make_ring() if self._key_seeded else (None, ())
        return _View(table, resolve_groups(table, self.pool), threshold, extraction, headers, ring, ring_endpoints)

    def _make_ring(self) -> tuple[KeyRing | None, tuple[Endpoint, ...]]:
        # Members are named by destination id where known (what every replica agrees on), else by
        # address; readiness is checked per decision, so a flapping endpoint does not move keys.
        endpoints = tuple(self.pool.by_address.values())
        if not endpoints:
            return None, ()
        names = [e.destination or e.address for e in endpoints]
        if len(set(names)) != len(names):
            names = [e.address for e in endpoints]
        return KeyRing(names), endpoints

    def install(self, table: RoutingTable) -> None:
        """Follow a new plan; the pool must already know its destinations."""
        # One reference assignment: a decision sees either the old view or the new one.
        self._view = self._make_view(table)

    def refresh(self) -> None:
        """Re-resolve destinations after the endpoint membership changed."""
        self._view = self._make_view(self._view.table)

    @property
    def table(self) -> RoutingTable:
        return self._view.table

    @property
    def key_extraction(self) -> KeyExtraction:
        return self._view.key_extraction

    @property
    def wanted_headers(self) -> frozenset[str]:
        return self._view.headers

    @property
    def spill_threshold(self) -> float:
        return self._view.spill_threshold

    # --- decisions --------------------------------------------------------------------------------

    def pick(self, key_hash: int | None, allowed: Collection[str] | None = None) -> Decision:
        """Decide for one request; `allowed` is the data plane's subset hint (addresses)."""
        view = self._view
        pool = self.pool
        ready = pool.ready
        if allowed is not None:
            ready = tuple(e for e in ready if e.address in allowed)
        if not ready:
            return _NO_ENDPOINT
        outcome = P2C
        planned: tuple[Endpoint, ...] = ()
        exclude: Endpoint | None = None
        if key_hash is not None:
            group = view.table.routes.get(key_hash)
            if group is not None:
                planned = view.groups[group]
                if allowed is not None:
                    planned = tuple(e for e in planned if e.address in allowed)
                best = _least_loaded(planned, key_hash)
                if best is not None:
                    overloaded = best.in_flight + best.waiting > view.spill_threshold * pool.mean_load() + self._slack
                    # With nowhere else to go, an overloaded destination is still the best choice.
                    if not overloaded or (len(ready) == 1 and ready[0] is best):
                        return self._with_fallbacks(PLANNED, best, planned, ready)
                    exclude = best
                outcome = SPILLED
            elif view.ring is not None:
                return self._with_fallbacks(P2C, self._key_p2c(view, key_hash, ready, allowed), planned, ready)
        choice = self._p2c(ready, exclude)
        return self._with_fallbacks(outcome, choice, planned, ready)

    def _key_p2c(
        self, view: _View, key_hash: int, ready: tuple[Endpoint, ...], allowed: Collection[str] | None
    ) -> Endpoint:
        assert view.ring is not None
        i, j = view.ring.pair(key_hash)
        a, b = view.ring_endpoints[i], view.ring_endpoints[j]
        a_ok = a.ready and (allowed is None or a.address in allowed)
        b_ok = b is not a and b.ready and (allowed is None or b.address in allowed)
        if a_ok and b_ok:
            return b if b.in_flight + b.waiting < a.in_flight + a.waiting else a
        if a_ok:
            return a
        if b_ok:
            return b
        return self._p2c(ready, None)

    def _p2c(self, ready: tuple[Endpoint, ...], exclude: Endpoint | None) -> Endpoint:
        if exclude is not None and len(ready) > 1:
            ready = tuple(e for e in ready if e is not exclude)
        n = len(ready)
        if n == 1:
            return ready[0]
        rnd = self._random
        i = int(rnd() * n)
        j = int(rnd() * (n - 1))
        if j >= i:
            j += 1
        a, b = ready[i], ready[j]
        return b if b.in_flight + b.waiting < a.in_flight + a.waiting else a

    def _with_fallbacks(
        self, outcome: str, primary: Endpoint, planned: tuple[Endpoint, ...], ready: tuple[Endpoint, ...]
    ) -> Decision:
        if not self._fallbacks:
            return Decision(outcome, (primary,))
        chosen = [primary]
        for e in planned:
            if e is not primary and e.ready and len(chosen) <= self._fallbacks:
                chosen.append(e)
        if len(chosen) <= self._fallbacks:
            rest = sorted((e for e in ready if e not in chosen), key=lambda e: e.in_flight + e.waiting)
            chosen.extend(rest[: self._fallbacks + 1 - len(chosen)])
        return Decision(outcome, tuple(chosen))


def _least_loaded(candidates: tuple[Endpoint, ...], key_hash: int) -> Endpoint | None:
    """The ready candidate with the least load; ties go to the first at or after `key_hash % n`."""
    n = len(candidates)
    if n == 1:
        only = candidates[0]
        return only if only.ready else None
    best: Endpoint | None = None
    best_load = 0
    start = key_hash % n if n else 0
    for step in range(n):
        e = candidates[(start + step) % n]
        if e.ready:
            load = e.in_flight + e.waiting
            if best is None or load < best_load:
                best, best_load = e, load
    return best
