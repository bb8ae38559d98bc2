"""The routing plan: what the operator publishes and the router follows.

Routes are held columnar (sorted 64-bit key hashes, CSR offsets, destination indexes) because
plans carry hundreds of thousands of keys and both the encoder and the router's loader work on
whole arrays at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from cacheroute.planner.routing import DEFAULT_SPILL_THRESHOLD

PLAN_SCHEMA = "cacheroute.dev/plan/v1"
DEFAULT_KEY_HEADER = "x-affinity-key"


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
    **kwargs: object,
) -> Plan:
    """Build a plan from `key hash -> destination ids`; the order of ids is kept."""
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
        **kwargs,  # type: ignore[arg-type]
    )
