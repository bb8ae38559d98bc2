"""The routing plan: what the operator publishes and the router follows.

Routes are held columnar (sorted 64-bit key hashes, CSR offsets, destination indexes) because
plans carry hundreds of thousands of keys and both the encoder and the router's loader work on
whole arrays at a time.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from cacheroute.planner.routing import DEFAULT_SPILL_THRESHOLD

PLAN_SCHEMA = "cacheroute.dev/plan/v1"
DEFAULT_KEY_HEADER = "x-affinity-key"

# Limits every reader enforces (`validate_plan`); docs/plan-format.md explains each.
# 2.5x the 200,000 routes a plan must hold, and small enough that a router decodes and indexes
# a full plan in about a second with a few hundred MB of memory.
MAX_ROUTES = 500_000
# Destinations of one key; the AffinityPlan API allows the same (budget.maxDestinationsPerKey).
MAX_DESTINATIONS_PER_ROUTE = 16
# A pool runs at most 1,024 replicas; route shards index destinations with 16 bits.
MAX_DESTINATIONS = 4096
# Bounded affinity: the router's --spill-threshold and the pool's router.spillThreshold range.
SPILL_THRESHOLD_RANGE = (1.0, 100.0)
MAX_PROMPT_PREFIX_CHARS = 65_536
MAX_NAME_CHARS = 253
MAX_TEXT_CHARS = 4096
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")
_HOST_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class PlanError(ValueError):
    """A plan or plan payload that is inconsistent; the message says what and where."""


def affinity_key_hash(key: str) -> int:
    """64-bit hash of an affinity key: the only form in which a key leaves the router.

    blake2b is in the standard library of every runtime that may read a plan, and a keyed-free
    8-byte digest keeps collisions negligible below billions of keys.
    """
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Destination:
    """One vLLM replica: stable id `<pool>-<ordinal>`, address `ip:port`; KV tokens it holds on its
    GPUs and in its host-memory tier (0: none)."""

    id: str
    address: str = ""
    weight: float = 1.0
    kv_capacity_tokens: int = 0
    host_kv_capacity_tokens: int = 0


@dataclass(frozen=True)
class KeyExtraction:
    """How the router derives the affinity key of a request, in order of precedence."""

    header: str = DEFAULT_KEY_HEADER
    body_field: str | None = "user"
    session_header: str | None = None
    prompt_prefix_chars: int = 0


@dataclass(frozen=True)
class PlanSummary:
    """Figures that justify a plan; they travel with it for status and review."""

    admitted_keys: int = 0
    admitted_request_share: float = 0.0
    admitted_token_share: float = 0.0
    churn: float = 0.0
    predicted_load: Mapping[str, float] = field(default_factory=dict)
    predicted_kv_hit: float | None = None
    reason: str = ""


@dataclass(frozen=True, eq=False)
class Plan:
    """A routing table for one pool, fixed for a control period.

    `route_keys` is sorted and unique; the destinations of `route_keys[i]` are
    `route_dests[route_offsets[i]:route_offsets[i + 1]]`, indexes into `destinations`, in
    preference order. `pinned_keys` (sorted, a subset of `route_keys`) are the routes someone
    pinned: the router keeps them to their entry, where it adds a computed route's ring
    candidates (`routing.key_candidates`).
    """

    pool: str
    destinations: tuple[Destination, ...]
    route_keys: npt.NDArray[np.uint64]
    route_offsets: npt.NDArray[np.int64]
    route_dests: npt.NDArray[np.uint16]
    generated_at: str = ""
    spill_threshold: float = DEFAULT_SPILL_THRESHOLD
    key_extraction: KeyExtraction = field(default_factory=KeyExtraction)
    summary: PlanSummary = field(default_factory=PlanSummary)
    pinned_keys: npt.NDArray[np.uint64] = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    # The share of a prompt a computed route's entry is credited with holding when the router
    # scores the request (`routing.py` step 1); 1 keeps the key on its entry up to the spill bound.
    entry_credit: float = 1.0

    def __post_init__(self) -> None:
        n = len(self.route_keys)
        if len(self.route_offsets) != n + 1:
            raise PlanError(f"route_offsets has {len(self.route_offsets)} entries, expected {n + 1}")
        if n and int(self.route_offsets[-1]) != len(self.route_dests):
            raise PlanError("route_offsets does not end at len(route_dests)")
        if n > 1 and not bool(np.all(self.route_keys[1:] > self.route_keys[:-1])):
            raise PlanError("route keys must be sorted and unique")
        if n and not bool(np.all(np.diff(self.route_offsets) >= 1)):
            raise PlanError("every routed key needs at least one destination")
        if len(self.route_dests) and int(self.route_dests.max()) >= len(self.destinations):
            raise PlanError("a route names a destination index outside the destination list")
        ids = [d.id for d in self.destinations]
        if len(set(ids)) != len(ids):
            raise PlanError("destination ids must be unique")
        pinned = self.pinned_keys
        if len(pinned):
            if len(pinned) > 1 and not bool(np.all(pinned[1:] > pinned[:-1])):
                raise PlanError("pinned keys must be sorted and unique")
            pos = np.minimum(np.searchsorted(self.route_keys, pinned), max(n - 1, 0))
            if not n or not bool(np.all(self.route_keys[pos] == pinned)):
                raise PlanError("a pinned key has no route")

    def __len__(self) -> int:
        return len(self.route_keys)

    def destinations_of(self, key_hash: int) -> tuple[str, ...]:
        """Destination ids for a key hash, in preference order; empty when unplanned."""
        i = int(np.searchsorted(self.route_keys, np.uint64(key_hash)))
        if i == len(self.route_keys) or int(self.route_keys[i]) != key_hash:
            return ()
        lo, hi = int(self.route_offsets[i]), int(self.route_offsets[i + 1])
        return tuple(self.destinations[j].id for j in self.route_dests[lo:hi])

    def routes(self) -> dict[int, tuple[str, ...]]:
        """All routes as a dict (key hash -> destination ids)."""
        ids = [d.id for d in self.destinations]
        offsets = self.route_offsets.tolist()
        dests = self.route_dests.tolist()
        return {
            k: tuple(ids[j] for j in dests[offsets[i] : offsets[i + 1]]) for i, k in enumerate(self.route_keys.tolist())
        }


def plan_from_routes(
    pool: str,
    destinations: Sequence[Destination],
    routes: Mapping[int, Sequence[str]] | Iterable[tuple[int, Sequence[str]]],
    *,
    pinned: bool = False,
    **kwargs: object,
) -> Plan:
    """Build a plan from `key hash -> destination ids`; the order of ids is kept.

    `pinned=True` marks every route pinned (`Plan.pinned_keys`: a router with `--widen-planned`
    keeps them to their entry instead of adding the key's ring candidates)."""
    index = {d.id: i for i, d in enumerate(destinations)}
    items = sorted(routes.items() if isinstance(routes, Mapping) else routes)
    keys = np.fromiter((k for k, _ in items), dtype=np.uint64, count=len(items))
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    flat: list[int] = []
    for i, (key, ids) in enumerate(items):
        if not ids:
            raise PlanError(f"key {key:016x} has no destination")
        for d in ids:
            if d not in index:
                raise PlanError(f"key {key:016x} names unknown destination {d!r}")
            flat.append(index[d])
        offsets[i + 1] = len(flat)
    return Plan(
        pool=pool,
        destinations=tuple(destinations),
        route_keys=keys,
        route_offsets=offsets,
        route_dests=np.asarray(flat, dtype=np.uint16),
        pinned_keys=keys.copy() if pinned else np.zeros(0, dtype=np.uint64),
        **kwargs,  # type: ignore[arg-type]
    )


# --- validation: what a router may rely on ---------------------------------------------------------


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets: how plans, routers, Envoy and gRPC write an
    address (`parse_destination_address` reads it back)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_destination_address(text: object) -> tuple[str, int]:
    """(host, port) of a destination address: `ip:port`, `[ipv6]:port` or `host:port`.

    Only the canonical spelling is accepted (lower case, no leading zeros, IPv6 compressed), so
    two spellings of one endpoint can never be two endpoints; raises PlanError saying why.
    """
    if not isinstance(text, str):
        raise PlanError(f"address {text!r} is not a string")
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise PlanError(f"address {text!r} is not host:port")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536 or port != str(int(port)):
        raise PlanError(f"address {text!r}: port {port!r} is not a number in 1-65535")
    if host.startswith("["):
        if not host.endswith("]"):
            raise PlanError(f"address {text!r}: unbalanced brackets")
        try:
            ip6 = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise PlanError(f"address {text!r}: {host[1:-1]!r} is not an IPv6 address") from None
        if f"[{ip6.compressed}]" != host:
            raise PlanError(f"address {text!r}: write it as [{ip6.compressed}]:{port}")
        return ip6.compressed, int(port)
    if ":" in host:
        raise PlanError(f"address {text!r}: an IPv6 address needs brackets, [ip]:port")
    try:
        ip4 = ipaddress.IPv4Address(host)
    except ValueError:
        ip4 = None
    if ip4 is not None:
        if str(ip4) != host:
            raise PlanError(f"address {text!r}: write it as {ip4}:{port}")
        return host, int(port)
    labels = host.split(".")
    if len(host) > MAX_NAME_CHARS or not all(_HOST_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        raise PlanError(f"address {text!r}: {host!r} is neither an IP address nor a lower-case DNS name")
    return host, int(port)


def _check_text(value: object, what: str, *, empty: bool = False, limit: int = MAX_NAME_CHARS) -> None:
    if not isinstance(value, str):
        raise PlanError(f"{what} must be a string, got {value!r}")
    if not value and not empty:
        raise PlanError(f"{what} must not be empty")
    if len(value) > limit:
        raise PlanError(f"{what} is longer than {limit} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise PlanError(f"{what} {value[:40]!r} holds control characters")


def _check_number(
    value: object, what: str, lo: float, hi: float, *, integer: bool = False, open_low: bool = False
) -> None:
    kinds: tuple[type, ...] = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise PlanError(f"{what} must be {'an integer' if integer else 'a number'}, got {value!r}")
    # Integers compared exactly: as a float, 2**53 + 1 equals 2**53.
    x = int(value) if integer else float(value)  # type: ignore[call-overload, arg-type]  # a number, checked above
    if not (integer or math.isfinite(x)) or x < lo or x > hi or (open_low and x == lo):
        low = f"> {lo:g}" if open_low else f">= {lo:g}"
        raise PlanError(f"{what} is {value!r}: must be finite, {low} and <= {hi:g}")


def _check_header_name(value: object, what: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    _check_text(value, what, limit=256)
    assert isinstance(value, str)
    if not is_header_name(value):
        raise PlanError(f"{what} {value!r} is not an HTTP header name")


def is_header_name(value: str) -> bool:
    """Whether `value` is an HTTP header name (RFC 9110's token; any case)."""
    return bool(_HEADER_NAME.match(value.lower()))


def validate_plan(plan: Plan) -> None:
    """Check everything a router reads from a plan; raises PlanError naming the field.

    The one gate between a plan and the data plane: `decode_plan` runs it on every payload a
    router loads, `cacheroute plan` before it writes, and the operator before it publishes, so
    a plan one of them accepts is a plan every router follows. Beyond the structural invariants
    `Plan` keeps itself: types (strings are strings, numbers are finite numbers), destination
    addresses (`ip:port`, `[ipv6]:port` or `host:port`; empty when the router finds the pod's
    address in the EndpointSlices), ranges (spill threshold, prompt prefix, weights), and the
    size limits (`MAX_ROUTES`, `MAX_DESTINATIONS`, `MAX_DESTINATIONS_PER_ROUTE`: a route's width is
    how many candidates the router weighs for the key), host KV capacities, and pinned keys (a
    sorted, unique subset of the route keys).
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"not a Plan: {type(plan).__name__}")
    _check_text(plan.pool, "pool")
    _check_text(plan.generated_at, "generatedAt", empty=True, limit=64)
    if not isinstance(plan.destinations, tuple) or not all(isinstance(d, Destination) for d in plan.destinations):
        raise PlanError("destinations must be a tuple of Destination")
    if len(plan.destinations) > MAX_DESTINATIONS:
        raise PlanError(f"{len(plan.destinations):,} destinations: at most {MAX_DESTINATIONS:,} are allowed")
    addresses: dict[str, str] = {}
    for i, d in enumerate(plan.destinations):
        where = f"destinations[{i}]"
        _check_text(d.id, f"{where}.id")
        if any(c.isspace() for c in d.id):
            raise PlanError(f"{where}.id {d.id!r} holds white space")
        if not isinstance(d.address, str):
            raise PlanError(f"{where}.address must be a string, got {d.address!r}")
        if d.address:
            try:
                parse_destination_address(d.address)
            except PlanError as exc:
                raise PlanError(f"{where} ({d.id}): {exc}") from None
            if d.address in addresses:
                raise PlanError(f"{where} ({d.id}): address {d.address} is also {addresses[d.address]}'s")
            addresses[d.address] = d.id
        _check_number(d.weight, f"{where}.weight", 0.0, 1e6, open_low=True)
        _check_number(d.kv_capacity_tokens, f"{where}.kvCapacityTokens", 0, 2**53, integer=True)
        _check_number(d.host_kv_capacity_tokens, f"{where}.hostKvCapacityTokens", 0, 2**53, integer=True)
    lo, hi = SPILL_THRESHOLD_RANGE
    _check_number(plan.spill_threshold, "spillThreshold", lo, hi)
    _check_number(plan.entry_credit, "entryCredit", 0.0, 1.0)
    ke = plan.key_extraction
    if not isinstance(ke, KeyExtraction):
        raise PlanError("keyExtraction must be a KeyExtraction")
    _check_header_name(ke.header, "keyExtraction.header", optional=False)
    _check_header_name(ke.session_header, "keyExtraction.sessionHeader", optional=True)
    if ke.body_field is not None:
        _check_text(ke.body_field, "keyExtraction.bodyField", limit=256)
    _check_number(ke.prompt_prefix_chars, "keyExtraction.promptPrefixChars", 0, MAX_PROMPT_PREFIX_CHARS, integer=True)
    _validate_summary(plan.summary)
    _validate_routes(plan)
    _validate_pinned(plan)


def _validate_summary(s: PlanSummary) -> None:
    if not isinstance(s, PlanSummary):
        raise PlanError("summary must be a PlanSummary")
    _check_number(s.admitted_keys, "summary.admittedKeys", 0, 2**53, integer=True)
    for name, value in (
        ("admittedRequestShare", s.admitted_request_share),
        ("admittedTokenShare", s.admitted_token_share),
        ("churn", s.churn),
    ):
        _check_number(value, f"summary.{name}", 0.0, 1e6)
    if s.predicted_kv_hit is not None:
        _check_number(s.predicted_kv_hit, "summary.predictedKvHit", 0.0, 1e6)
    if not isinstance(s.predicted_load, Mapping) or len(s.predicted_load) > MAX_DESTINATIONS:
        raise PlanError(f"summary.predictedLoad must map at most {MAX_DESTINATIONS} destination ids to loads")
    for key, load in s.predicted_load.items():
        _check_text(key, "summary.predictedLoad key")
        _check_number(load, f"summary.predictedLoad[{key!r}]", 0.0, 1e12)
    _check_text(s.reason, "summary.reason", empty=True, limit=MAX_TEXT_CHARS)


def _validate_pinned(plan: Plan) -> None:
    """Pinned keys: a sorted, unique subset of the route keys (their routes' widths are checked
    with every route's)."""
    pinned = plan.pinned_keys
    if not isinstance(pinned, np.ndarray) or pinned.ndim != 1 or pinned.dtype != np.uint64:
        raise PlanError("pinned_keys must be a one-dimensional uint64 array")
    if len(pinned) > len(plan):
        raise PlanError(f"{len(pinned):,} pinned keys but only {len(plan):,} routes")
    if len(pinned) > 1 and not bool(np.all(pinned[1:] > pinned[:-1])):
        raise PlanError("pinnedKeys must be sorted and unique")
    if len(pinned):
        pos = np.minimum(np.searchsorted(plan.route_keys, pinned), len(plan) - 1)
        missing = np.flatnonzero(plan.route_keys[pos] != pinned)
        if len(missing):
            raise PlanError(f"pinned key {int(pinned[missing[0]]):016x} has no route")


def _validate_routes(plan: Plan) -> None:
    for name, array, dtype in (
        ("route_keys", plan.route_keys, np.uint64),
        ("route_offsets", plan.route_offsets, np.int64),
        ("route_dests", plan.route_dests, np.uint16),
    ):
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != dtype:
            raise PlanError(f"{name} must be a one-dimensional {np.dtype(dtype).name} array")
    n = len(plan)
    if n > MAX_ROUTES:
        raise PlanError(f"{n:,} routes: a plan holds at most {MAX_ROUTES:,} (admit fewer keys)")
    if n:
        counts = np.diff(plan.route_offsets)
        widest = int(counts.max())
        if widest > MAX_DESTINATIONS_PER_ROUTE:
            row = int(np.argmax(counts))
            raise PlanError(
                f"key {int(plan.route_keys[row]):016x} has {widest} destinations: "
                f"at most {MAX_DESTINATIONS_PER_ROUTE} per key"
            )
