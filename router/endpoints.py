"""The endpoints the router may pick, their load and their readiness.

Endpoints come from three sources, merged by address: the plan's destinations, a static list,
and the pool's EndpointSlices. An `Endpoint` object lives as long as its address is known, so
in-flight counts survive plan and membership changes. Everything here runs on the event loop
thread; readers on other threads (the metrics endpoint) only take snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from cacheroute.planner.plan import Destination
from cacheroute.planner.tokenload import pending_prompt_tokens


class Endpoint:
    """One destination address and what the router knows of its load."""

    __slots__ = (
        "address",
        "counted_from",
        "destination",
        "in_flight",
        "in_flight_tokens",
        "member_ready",
        "pending",
        "ready",
        "running",
        "scrape_ok",
        "scraped",
        "waiting",
    )

    def __init__(self, address: str, destination: str = "") -> None:
        self.address = address
        self.destination = destination
        # Requests this router sent there and that have not finished yet; of the prompt tokens they
        # brought (estimated from their bodies), those still to prefill (token-aware load); and
        # each request's charge by ticket, in dispatch order, with the oldest ticket counted.
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.pending: dict[int, int] = {}
        self.counted_from = 0
        # Queue depth and batch size reported by the engine's /metrics.
        self.waiting = 0
        self.running = 0
        self.scraped = False
        self.scrape_ok = True
        # Readiness from the EndpointSlice (True when slices are not watched).
        self.member_ready = True
        self.ready = False

    @property
    def load(self) -> int:
        return self.in_flight + self.waiting

    def __repr__(self) -> str:
        return f"Endpoint({self.address}, in_flight={self.in_flight}, waiting={self.waiting}, ready={self.ready})"


@dataclass(frozen=True)
class SliceEndpoint:
    """An address from an EndpointSlice: the pod behind it and whether it is ready."""

    address: str
    pod: str
    ready: bool


class EndpointPool:
    """All known endpoints, the ready subset, and load totals over the ready subset."""

    def __init__(self, *, scraping: bool) -> None:
        self._scraping = scraping
        self._static: tuple[str, ...] = ()
        self._plan: tuple[Destination, ...] = ()
        self._slices: dict[str, SliceEndpoint] | None = None
        # Pod name -> slice address, and whether the plan's destination ids are such pods: both
        # follow the slices and the plan, set by every rebuild.
        self._pod_addresses: dict[str, str] = {}
        self._plan_names_pods = False
        self.by_address: dict[str, Endpoint] = {}
        self.ready: tuple[Endpoint, ...] = ()
        # Totals over `ready`, kept incrementally so the mean load is O(1) per decision.
        self.in_flight_ready = 0
        self.waiting_ready = 0
        self.tokens_ready = 0
        # Load units per request and per prompt token in flight (`planner/tokenload.py`); the
        # picker sets them.
        self.per_request = 1.0
        self.per_token = 0.0
        self._tickets = 0
        self._listeners: list[Callable[[], None]] = []

    # --- membership -------------------------------------------------------------------------------

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every membership change (not after load or readiness changes)."""
        self._listeners.append(listener)

    def set_static(self, addresses: Iterable[str]) -> None:
        self._static = tuple(addresses)
        self._rebuild()

    def set_plan_destinations(self, destinations: Iterable[Destination]) -> None:
        self._plan = tuple(destinations)
        self._rebuild()

    def set_slices(self, endpoints: Mapping[str, SliceEndpoint] | None) -> None:
        """The EndpointSlices' view (None: slices are not watched, every known address counts)."""
        self._slices = dict(endpoints) if endpoints is not None else None
        self._rebuild()

    @property
    def watches_slices(self) -> bool:
        return self._slices is not None

    def resolve(self, destination: Destination) -> Endpoint | None:
        """The endpoint of a plan destination (None when it has none now)."""
        address = self._plan_address(destination)
        return self.by_address.get(address) if address else None

    def _plan_address(self, destination: Destination) -> str:
        """Where a plan destination is now. Slices not watched: the plan's address. Watched, they
        say: a pod of the destination's name (the operator's `<pool>-<i>`) is found there, back on
        a new address or not; where the plan names the slices' pods, the address it recorded may
        belong to another pod by now, or to none. An address the slices do not list is no
        endpoint (it could not be ready; it would only be scraped)."""
        if self._slices is None:
            return destination.address
        if destination.id in self._pod_addresses:
            return self._pod_addresses[destination.id]
        if self._plan_names_pods or destination.address not in self._slices:
            return ""
        return destination.address

    def _rebuild(self) -> None:
        wanted: dict[str, str] = {}
        for address in self._static:
            wanted.setdefault(address, "")
        slices = self._slices.values() if self._slices is not None else ()
        self._pod_addresses = {s.pod: s.address for s in slices}
        self._plan_names_pods = any(d.id in self._pod_addresses for d in self._plan)
        for dest in self._plan:
            address = self._plan_address(dest)
            if address:
                wanted[address] = dest.id
        if self._slices is not None:
            for item in self._slices.values():
                wanted.setdefault(item.address, item.pod)
        for address in list(self.by_address):
            if address not in wanted:
                gone = self.by_address.pop(address)
                self._set_ready(gone, False)
        for address, dest_id in wanted.items():
            endpoint = self.by_address.get(address)
            if endpoint is None:
                endpoint = self.by_address[address] = Endpoint(address, dest_id)
            elif dest_id:
                endpoint.destination = dest_id
            endpoint.member_ready = self._member_ready(address)
            self._set_ready(endpoint, self._should_be_ready(endpoint))
        self._refresh_ready_tuple()
        for listener in self._listeners:
            listener()

    def _member_ready(self, address: str) -> bool:
        """What membership says: the slice's condition; else listed statically; else (a plan
        address the watched slices do not know) not ready."""
        if self._slices is None:
            return True
        member = self._slices.get(address)
        if member is not None:
            return member.ready
        return address in self._static

    # --- readiness and load -----------------------------------------------------------------------

    def _should_be_ready(self, endpoint: Endpoint) -> bool:
        if not endpoint.member_ready:
            return False
        if not self._scraping:
            return True
        return endpoint.scraped and endpoint.scrape_ok

    def _set_ready(self, endpoint: Endpoint, ready: bool) -> bool:
        if endpoint.ready == ready:
            return False
        sign = 1 if ready else -1
        self.in_flight_ready += sign * endpoint.in_flight
        self.waiting_ready += sign * endpoint.waiting
        self.tokens_ready += sign * endpoint.in_flight_tokens
        endpoint.ready = ready
        return True

    def _refresh_ready_tuple(self) -> None:
        self.ready = tuple(e for e in self.by_address.values() if e.ready)

    def record_scrape(self, endpoint: Endpoint, *, ok: bool, running: int = 0, waiting: int = 0) -> None:
        """Apply one scrape result; a failed scrape takes the endpoint out until the next success."""
        if ok:
            if endpoint.ready:
                self.waiting_ready += waiting - endpoint.waiting
            if endpoint.pending:
                self._recount(endpoint, waiting)
        endpoint.scraped = True
        endpoint.scrape_ok = ok
        if ok:
            endpoint.waiting = waiting
            endpoint.running = running
        if self.by_address.get(endpoint.address) is not endpoint:
            return
        if self._set_ready(endpoint, self._should_be_ready(endpoint)):
            self._refresh_ready_tuple()

    def _recount(self, endpoint: Endpoint, waiting: int) -> None:
        """The prompt tokens still to prefill, from the queue depth just scraped (`tokenload.py`)."""
        tokens, endpoint.counted_from = pending_prompt_tokens(endpoint.pending, waiting)
        if endpoint.ready:
            self.tokens_ready += tokens - endpoint.in_flight_tokens
        endpoint.in_flight_tokens = tokens

    def acquire(self, endpoint: Endpoint, tokens: int = 0) -> int:
        """A request (bringing `tokens` prompt tokens to compute) was sent to `endpoint`; the
        ticket returned goes back to `release`."""
        self._tickets += 1
        ticket = self._tickets
        endpoint.in_flight += 1
        if endpoint.ready:
            self.in_flight_ready += 1
        if self.per_token:
            # The newest request is always still to prefill: counted until a scrape says otherwise.
            endpoint.pending[ticket] = tokens
            endpoint.in_flight_tokens += tokens
            if endpoint.ready:
                self.tokens_ready += tokens
        return ticket

    def release(self, endpoint: Endpoint, ticket: int = 0) -> None:
        """The request `acquire` counted (and gave `ticket`) ended."""
        endpoint.in_flight -= 1
        if endpoint.ready:
            self.in_flight_ready -= 1
        tokens = endpoint.pending.pop(ticket, None)
        if tokens is not None and ticket >= endpoint.counted_from:
            endpoint.in_flight_tokens -= tokens
            if endpoint.ready:
                self.tokens_ready -= tokens

    def mean_load(self) -> float:
        """Mean load over ready endpoints: in flight times `per_request` plus queued, plus prompt
        tokens still to prefill times `per_token` (token-aware load, `planner/tokenload.py`)."""
        n = len(self.ready)
        load = self.in_flight_ready * self.per_request + self.waiting_ready + self.tokens_ready * self.per_token
        return load / n if n else 0.0

    @property
    def known(self) -> bool:
        """Whether any endpoint is known at all (what readiness of the router needs)."""
        return bool(self.by_address)
