"""The plan as the picker reads it: an immutable dict from key hash to a destination group.

Keys with the same destination list share one group, so the dict holds small ints and a
200,000-route plan needs a few thousand groups. Groups are resolved to `Endpoint` objects
separately (`resolve_groups`), because endpoints can change while the plan does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from cacheroute.planner.plan import Destination, KeyExtraction, Plan
from cacheroute.planner.routing import DEFAULT_SPILL_THRESHOLD
from cacheroute.router.endpoints import Endpoint, EndpointPool

# Destination lists up to this length are grouped with numpy; longer ones (rare) in Python.
_PACKED_MAX: Final = 3


@dataclass(frozen=True, eq=False)
class RoutingTable:
    pool: str
    version: str
    generated_at: str
    destinations: tuple[Destination, ...]
    # key hash -> group index; groups[i] is a tuple of destination indexes in plan order.
    routes: dict[int, int]
    groups: tuple[tuple[int, ...], ...]
    spill_threshold: float
    key_extraction: KeyExtraction
    # Keys someone pinned: kept to their plan entry, without their ring candidates.
    pinned: frozenset[int] = frozenset()
    # The share of a prompt a computed route's entry is credited with (`Plan.entry_credit`).
    entry_credit: float = 1.0

    def __len__(self) -> int:
        return len(self.routes)

    @classmethod
    def empty(cls) -> RoutingTable:
        return cls("", "", "", (), {}, (), DEFAULT_SPILL_THRESHOLD, KeyExtraction())


def build_table(plan: Plan, version: str) -> RoutingTable:
    """Group the plan's routes by destination list and index them by key hash."""
    n = len(plan)
    counts = np.diff(plan.route_offsets)
    starts = plan.route_offsets[:-1]
    packed_rows = counts <= _PACKED_MAX
    # One 64-bit code per row: the count in the top byte, then up to three 16-bit indexes.
    codes = np.zeros(n, dtype=np.uint64)
    if n:
        codes |= counts.astype(np.uint64) << np.uint64(56)
        dests = plan.route_dests.astype(np.uint64)
        for slot in range(_PACKED_MAX):
            has = packed_rows & (counts > slot)
            codes[has] |= dests[starts[has] + slot] << np.uint64(16 * slot)
    unique_codes, inverse = np.unique(codes[packed_rows], return_inverse=True)
    groups: list[tuple[int, ...]] = []
    for code in unique_codes.tolist():
        count = code >> 56
        groups.append(tuple((code >> (16 * s)) & 0xFFFF for s in range(count)))
    group_of_row = np.empty(n, dtype=np.int64)
    group_of_row[packed_rows] = inverse
    index: dict[tuple[int, ...], int] = {g: i for i, g in enumerate(groups)}
    offsets = plan.route_offsets.tolist()
    all_dests = plan.route_dests.tolist()
    for row in np.flatnonzero(~packed_rows).tolist():
        group = tuple(all_dests[offsets[row] : offsets[row + 1]])
        if group not in index:
            index[group] = len(groups)
            groups.append(group)
        group_of_row[row] = index[group]
    routes = dict(zip(plan.route_keys.tolist(), group_of_row.tolist(), strict=True))
    return RoutingTable(
        pool=plan.pool,
        version=version,
        generated_at=plan.generated_at,
        destinations=plan.destinations,
        routes=routes,
        groups=tuple(groups),
        spill_threshold=plan.spill_threshold,
        key_extraction=plan.key_extraction,
        pinned=frozenset(plan.pinned_keys.tolist()),
        entry_credit=plan.entry_credit,
    )


def resolve_groups(table: RoutingTable, pool: EndpointPool) -> tuple[tuple[Endpoint, ...], ...]:
    """Each group's endpoints, in plan order; destinations without a known address are left out."""
    endpoints = [pool.resolve(d) for d in table.destinations]
    return tuple(tuple(e for e in (endpoints[i] for i in group) if e is not None) for group in table.groups)
