"""Choosing the endpoint of one request: the routing rule (`cacheroute.planner.routing`) applied to
the router's endpoints.

The rule decides planned, spilled, key-seeded p2c or p2c; this module supplies what it decides
from: the ready endpoints (narrowed by the data plane's subset hint), each key's planned endpoints,
the ring of every known endpoint for key-seeded p2c, and the load. Load is the router's own
in-flight count for the endpoint (each request weighing `in_flight_weight`) plus the queue depth
the endpoint reports on /metrics (the first reacts within a request, the second sees other router
replicas) plus the prompt tokens of the
router's requests in flight there over `tokens_per_unit` (`planner/tokenload.py`: a few long
prompts weigh as much as many short ones; the exchange estimates each request's tokens from its
body size and charges them with `EndpointPool.acquire`). With `follow_prefixes`, it also
supplies where the longest routed prefix of the prompt went (`following.RoutedPrefixes`: the
next turn of a conversation goes where its history is cached, within the rule's load bound) and
charges the request only the tokens that endpoint is not expected to hold; an unplanned request
with no prefix worth following is scored over every usable endpoint by what each holds of its
prompt and by load (the rule's step 6, outcome `scored`). It adds the router's
own part: fallback endpoints for the data plane to retry.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from operator import attrgetter
from typing import Final, NamedTuple

from cacheroute.planner.keyring import DEFAULT_UNPLANNED, KeyRing, check_unplanned_mode
from cacheroute.planner.plan import KeyExtraction
from cacheroute.planner.prefixes import DEFAULT_PREFIX_MEMORY_BLOCKS, memory_blocks
from cacheroute.planner.routing import (
    DEFAULT_SPILL_SLACK,
    FOLLOWED,
    KEY_P2C,
    P2C,
    PLANNED,
    SCORED,
    SPILLED,
    RoutingRule,
    ring_candidates,
)
from cacheroute.planner.tokenload import (
    DEFAULT_IN_FLIGHT_WEIGHT,
    DEFAULT_TOKENS_PER_LOAD_UNIT,
    check_in_flight_weight,
    check_tokens_per_unit,
)
from cacheroute.router.endpoints import Endpoint, EndpointPool
from cacheroute.router.following import RoutedPrefixes
from cacheroute.router.prompts import BLOCK_TOKENS
from cacheroute.router.settings import KeyOverrides
from cacheroute.router.table import RoutingTable, resolve_groups
from cacheroute.router.wire import header_patterns

NONE: Final = "none"
OUTCOMES: Final = (PLANNED, SPILLED, P2C, FOLLOWED, SCORED, NONE)


class Decision(NamedTuple):
    outcome: str
    # Primary first, then fallbacks; empty when no endpoint is ready.
    endpoints: tuple[Endpoint, ...]
    # Prompt tokens to charge the primary while the request is in flight (token-aware load).
    charge: int = 0


_NO_ENDPOINT: Final = Decision(NONE, ())
_new_decision: Final = tuple.__new__


class _View(NamedTuple):
    table: RoutingTable
    groups: tuple[tuple[Endpoint, ...], ...]
    spill_threshold: float
    key_extraction: KeyExtraction
    # Request headers worth reading: the key and session headers, and the body size.
    headers: frozenset[str]
    rule: RoutingRule[Endpoint]


class _EndpointLoads:
    """The rule's view of load (`planner/tokenload.py`): in flight times `in_flight_weight` plus
    scraped queue plus prompt tokens in flight over `tokens_per_unit` (0: requests only); the mean
    over ready endpoints."""

    __slots__ = ("load", "mean")

    def __init__(self, pool: EndpointPool, tokens_per_unit: float, in_flight_weight: float) -> None:
        per_token = pool.per_token = 1.0 / tokens_per_unit if tokens_per_unit > 0 else 0.0
        per_request = pool.per_request = in_flight_weight
        self.mean = pool.mean_load

        # A plain function (no bound-method lookup): called for every candidate of every decision.
        def load(endpoint: Endpoint, /) -> float:
            return endpoint.in_flight * per_request + endpoint.waiting + endpoint.in_flight_tokens * per_token

        self.load = load


_is_ready: Final[Callable[[Endpoint], bool]] = attrgetter("ready")


def _ready_within(allowed: Collection[str]) -> Callable[[Endpoint], bool]:
    def usable(e: Endpoint) -> bool:
        return e.ready and e.address in allowed

    return usable


class Picker:
    def __init__(
        self,
        pool: EndpointPool,
        *,
        spill_threshold: float | None = None,
        spill_slack: float = DEFAULT_SPILL_SLACK,
        fallbacks: int = 0,
        keys: KeyOverrides | None = None,
        seed: int | None = None,
        unplanned: str = DEFAULT_UNPLANNED,
        tokens_per_unit: float = DEFAULT_TOKENS_PER_LOAD_UNIT,
        in_flight_weight: float = DEFAULT_IN_FLIGHT_WEIGHT,
        widen_planned: bool = False,
        follow_prefixes: bool = False,
        prefix_memory_blocks: int = DEFAULT_PREFIX_MEMORY_BLOCKS,
        endpoint_kv_tokens: int = 0,
    ) -> None:
        check_tokens_per_unit(tokens_per_unit)
        check_in_flight_weight(in_flight_weight)
        self.pool = pool
        # Prompt tokens a request brings are charged to its endpoint only when load counts them.
        self.token_aware = tokens_per_unit > 0
        self._key_seeded = check_unplanned_mode(unplanned) == "key-p2c"
        self._threshold_override = spill_threshold
        self._slack = spill_slack
        self._fallbacks = fallbacks
        self._keys = keys or KeyOverrides()
        self._random = random.Random(seed).random
        self._loads = _EndpointLoads(pool, tokens_per_unit, in_flight_weight)
        self._widen = widen_planned
        self._prefix_limit = prefix_memory_blocks
        # KV tokens one endpoint holds (GPU and host tiers; 0: not known): sizes the memory of
        # routed prefixes while no plan says what its destinations hold.
        self._endpoint_kv_tokens = endpoint_kv_tokens
        self._prefixes = RoutedPrefixes(prefix_memory_blocks, pool.per_token) if follow_prefixes else None
        # Whether decisions want the prompt's prefix chain (`pick(..., chain=...)`).
        self.follows_prefixes = follow_prefixes
        self._set_view(RoutingTable.empty())
        pool.on_change(self.refresh)
        if self._prefixes is not None:
            self._prefixes.sync(pool.by_address)
            self._size_prefix_memory(self._view.table)

    # --- plan -------------------------------------------------------------------------------------

    def _make_view(self, table: RoutingTable) -> _View:
        threshold = self._threshold_override if self._threshold_override is not None else table.spill_threshold
        extraction = self._keys.apply(table.key_extraction)
        headers = frozenset(h for h in (extraction.header, extraction.session_header, "content-length") if h)
        rule = RoutingRule(
            self._loads,
            self._random,
            spill_threshold=threshold,
            spill_slack=self._slack,
            key_candidates=self._ring_candidates() if self._key_seeded else None,
            widen_planned=self._widen,
            entry_credit=table.entry_credit,
        )
        return _View(table, resolve_groups(table, self.pool), threshold, extraction, headers, rule)

    def _ring_candidates(self) -> Callable[[int], tuple[Endpoint, Endpoint]] | None:
        # Members are every known endpoint, named by destination id where known (what every replica
        # agrees on), else by address; readiness is checked per decision, so a flapping endpoint
        # does not move keys.
        endpoints = tuple(self.pool.by_address.values())
        if not endpoints:
            return None
        names = [e.destination or e.address for e in endpoints]
        if len(set(names)) != len(names):
            names = [e.address for e in endpoints]
        return ring_candidates(KeyRing(names), endpoints)

    def install(self, table: RoutingTable) -> None:
        """Follow a new plan; the pool must already know its destinations."""
        if self._prefixes is not None:
            self._size_prefix_memory(table)
        self._set_view(table)

    def refresh(self) -> None:
        """Re-resolve destinations after the endpoint membership changed."""
        if self._prefixes is not None:
            self._prefixes.sync(self.pool.by_address)
            self._size_prefix_memory(self._view.table)
        self._set_view(self._view.table)

    def _set_view(self, table: RoutingTable) -> None:
        view = self._make_view(table)
        # What the exchange reads of the view before it picks, as plain attributes (it reads
        # them for every request): the key's sources, the headers worth reading and how to find
        # them in a message's bytes (`wire.py`).
        self.key_extraction = view.key_extraction
        self.wanted_headers = view.headers
        self.header_patterns = header_patterns(view.headers)
        # One reference assignment: a decision sees either the old view or the new one.
        self._view = view

    def _kv_share(self, table: RoutingTable) -> tuple[int, int]:
        """What the fleet's KV caches hold, GPU and host, and over how many destinations: the plan's
        destinations' capacities, else every known endpoint at `endpoint_kv_tokens` (0 tokens: not
        known)."""
        planned = sum(d.kv_capacity_tokens + d.host_kv_capacity_tokens for d in table.destinations)
        if planned > 0:
            return planned, len(table.destinations)
        endpoints = len(self.pool.by_address)
        return endpoints * self._endpoint_kv_tokens, endpoints

    def _size_prefix_memory(self, table: RoutingTable) -> None:
        # Remember per endpoint as many prefixes as its cache holds (`prefixes.memory_blocks`): a
        # memory larger than the caches follows prefixes they have evicted, trading balance for
        # nothing.
        assert self._prefixes is not None
        fleet, destinations = self._kv_share(table)
        self._prefixes.resize(memory_blocks(fleet, destinations, BLOCK_TOKENS, self._prefix_limit))

    @property
    def prefix_memory_capacity(self) -> int:
        """Prefix blocks the memory holds at most: per endpoint, times the endpoints."""
        if self._prefixes is None:
            return 0
        return self._prefixes.capacity * max(1, self._kv_share(self._view.table)[1])

    @property
    def remembered_prefixes(self) -> int:
        return len(self._prefixes) if self._prefixes is not None else 0

    @property
    def table(self) -> RoutingTable:
        return self._view.table

    @property
    def spill_threshold(self) -> float:
        return self._view.spill_threshold

    # --- decisions --------------------------------------------------------------------------------

    def pick(
        self,
        key_hash: int | None,
        allowed: Collection[str] | None = None,
        prompt_tokens: int = 0,
        chain: Sequence[int] = (),
    ) -> Decision:
        """Decide for one request; `allowed` is the data plane's subset hint (addresses),
        `prompt_tokens` the request's estimated size and `chain` its prompt's prefix ids
        (`prompts.prefix_chain`; empty: unknown)."""
        view = self._view
        ready = self.pool.ready
        is_usable = _is_ready
        if allowed is not None:
            ready = tuple(e for e in ready if e.address in allowed)
            is_usable = _ready_within(allowed)
        if not ready:
            return _NO_ENDPOINT
        planned: tuple[Endpoint, ...] | None = None
        pinned = False
        if key_hash is not None:
            group = view.table.routes.get(key_hash)
            if group is not None:
                planned = view.groups[group]
                pinned = key_hash in view.table.pinned
                if allowed is not None:
                    planned = tuple(e for e in planned if e.address in allowed)
        prefixes = self._prefixes if chain else None
        follow: Endpoint | None = None
        gain = 0.0
        held = None
        if prefixes is not None:
            follow, gain = prefixes.target(chain, prompt_tokens)
            if follow is None and self._key_seeded and (planned is None or view.rule.scores_planned(pinned)):
                # Scored by what each endpoint holds of the prompt (the rule's step 6).
                held = prefixes.held(chain, prompt_tokens)
        outcome, chosen = view.rule.choose(key_hash, planned, ready, is_usable, follow=follow, follow_gain=gain,
                                           pinned=pinned, held=held, prompt_tokens=prompt_tokens)
        if outcome == KEY_P2C:
            # Counted as p2c, key-seeded or not (the metric's documented outcomes).
            outcome = P2C
        charge = prefixes.settle(chain, chosen, prompt_tokens) if prefixes is not None else prompt_tokens
        if not self.token_aware:
            charge = 0
        if not self._fallbacks:
            # tuple.__new__ builds the named tuple without the Python-level constructor.
            return _new_decision(Decision, (outcome, (chosen,), charge))
        return self._with_fallbacks(outcome, chosen, planned or (), ready, charge)

    def _with_fallbacks(
        self, outcome: str, primary: Endpoint, planned: tuple[Endpoint, ...], ready: tuple[Endpoint, ...],
        charge: int,
    ) -> Decision:
        chosen = [primary]
        for e in planned:
            if e is not primary and e.ready and len(chosen) <= self._fallbacks:
                chosen.append(e)
        if len(chosen) <= self._fallbacks:
            rest = sorted((e for e in ready if e not in chosen), key=self._loads.load)
            chosen.extend(rest[: self._fallbacks + 1 - len(chosen)])
        return Decision(outcome, tuple(chosen), charge)

