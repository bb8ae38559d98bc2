"""Checks of `compute_plan`'s input: every problem is one `PlanInputError` naming the input."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.plan import Destination, Plan

F64 = npt.NDArray[np.float64]

# Destination indexes travel as uint16; one value is kept free as a sentinel.
MAX_DESTINATIONS = 65_535


def _check_destinations(destinations: Sequence[Destination]) -> F64:
    if not len(destinations):
        raise PlanInputError("destinations is empty: a plan needs at least one destination")
    if len(destinations) > MAX_DESTINATIONS:
        raise PlanInputError(f"destinations has {len(destinations)} entries, at most {MAX_DESTINATIONS} are supported")
    seen: set[str] = set()
    for i, d in enumerate(destinations):
        if not isinstance(d, Destination):
            raise PlanInputError(f"destinations[{i}] is a {type(d).__name__}, expected Destination")
        if not d.id:
            raise PlanInputError(f"destinations[{i}].id is empty")
        if d.id in seen:
            raise PlanInputError(f"destinations[{i}].id {d.id!r} appears more than once")
        seen.add(d.id)
        if not (isinstance(d.weight, int | float) and math.isfinite(d.weight) and d.weight > 0):
            raise PlanInputError(f"destinations[{i}] ({d.id}) weight is {d.weight!r}: must be finite and > 0")
        for name in ("kv_capacity_tokens", "host_kv_capacity_tokens"):
            cap = getattr(d, name)
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise PlanInputError(f"destinations[{i}] ({d.id}) {name} is {cap!r}: must be an integer >= 0")
    return np.array([float(d.weight) for d in destinations], dtype=np.float64)


def checked_weights(
    stats: KeyStats,
    *,
    destinations: Sequence[Destination],
    pool: str,
    previous: Plan | None,
    pinned: object,
    spill_threshold: float,
) -> F64:
    """Check the input of one plan; returns the destinations' weights."""
    if not isinstance(pool, str) or not pool:
        raise PlanInputError(f"pool is {pool!r}: a plan needs the pool name")
    if not isinstance(stats, KeyStats):
        raise PlanInputError(f"stats is a {type(stats).__name__}, expected KeyStats")
    if not (isinstance(spill_threshold, int | float) and math.isfinite(spill_threshold) and spill_threshold > 0):
        raise PlanInputError(f"spill_threshold is {spill_threshold!r}: must be finite and > 0")
    weights = _check_destinations(destinations)
    if previous is not None and not isinstance(previous, Plan):
        raise PlanInputError(f"previous is a {type(previous).__name__}, expected Plan")
    if previous is not None and previous.pool != pool:
        raise PlanInputError(f"previous plan belongs to pool {previous.pool!r}, not {pool!r}")
    if not isinstance(pinned, Mapping):
        raise PlanInputError(f"pinned is a {type(pinned).__name__}, expected a mapping key -> destination ids")
    return weights
