"""Step 1 of a plan, load and replicas: what each key costs a destination, how many destinations
it needs, and the warm room the pinned routes leave to admission (`key_demand`).

Load is measured in *destination-seconds per second*: the busy share of a destination of weight
1 (1.0 means one such destination fully busy). A destination of weight w serves w of it. Pinned
routes (keys the operator routes by hand) are served before anyone: they take their load and
their prefixes' warm room first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic, affinity_key_hashes
from cacheroute.planner.plan import Destination
from cacheroute.planner.settings import Budget

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
B = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class CostModel:
    """Work a request puts on one destination of weight 1, in seconds.

    The defaults describe a Llama-3.3-70B FP8 replica on two H100s (TP=2) at the batch sizes a
    loaded replica runs:
    - `prefill_s_per_token` 1.4e-4: ~7,000 prompt tokens/s (2 x 70e9 FLOP per token against about
      1e15 usable FLOP/s of FP8 on two GPUs);
    - `decode_s_per_token` 4.0e-4: ~2,500 output tokens/s (a 64-sequence batch at ~25 ms a step);
    - `request_overhead_s` 0: scheduling and sampling overhead per request, negligible next to
      the above for long prompts;
    - `host_copy_s_per_token` 0: copying one token of KV back from a host-memory tier
      (`EngineProfile.host_copy_s_per_token`: 3.3 us in fp8, 6.6 us in bf16 for this replica);
      a prefix held there saves `prefill - copy` per token instead of `prefill`.
    Calibrate them per model and GPU; placement only depends on their ratios, replication also on
    their scale (it compares a key's load with `max_key_share_of_destination`).
    """

    prefill_s_per_token: float = 1.4e-4
    decode_s_per_token: float = 4.0e-4
    request_overhead_s: float = 0.0
    host_copy_s_per_token: float = 0.0

    @property
    def host_value(self) -> float:
        """What a prefix token held in host memory saves, as a share of one held on the GPU."""
        if self.prefill_s_per_token <= 0:
            return 0.0
        return max(0.0, 1.0 - self.host_copy_s_per_token / self.prefill_s_per_token)

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_token", "request_overhead_s", "host_copy_s_per_token"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise PlanInputError(f"cost.{name} is {v!r}: must be finite and >= 0")
        if self.prefill_s_per_token == 0 and self.decode_s_per_token == 0 and self.request_overhead_s == 0:
            raise PlanInputError("cost model is all zeros: every request would be free")

    def request_cost(self, prompt: F64 | float, reused: F64 | float, output: F64 | float) -> F64:
        """Seconds of one request that reuses `reused` of its `prompt` tokens from KV cache."""
        fresh = np.maximum(np.asarray(prompt, np.float64) - reused, 0.0)
        return np.asarray(
            self.request_overhead_s + self.prefill_s_per_token * fresh + self.decode_s_per_token * np.asarray(output),
            dtype=np.float64,
        )


def dot(a: npt.NDArray[np.floating] | npt.NDArray[np.integer], b: npt.NDArray[np.floating]) -> float:
    """Inner product without BLAS: one core, and no BLAS thread pool waking up for a reduction."""
    return float(np.einsum("i,i->", a, b, dtype=np.float64))


def warm_load(stats: KeyStats, cost: CostModel) -> F64:
    """Load of each key when a destination holding its stable prefix serves it."""
    return stats.rate * cost.request_cost(stats.prompt_tokens, stats.prefix_tokens, stats.output_tokens)


def cold_load(stats: KeyStats, cost: CostModel, rows: I64 | None = None) -> F64:
    """Load of each key (or of `rows`) routed without affinity (its prefix is recomputed)."""
    if rows is None:
        return stats.rate * cost.request_cost(stats.prompt_tokens, 0.0, stats.output_tokens)
    return stats.rate[rows] * cost.request_cost(stats.prompt_tokens[rows], 0.0, stats.output_tokens[rows])


def total_cold_load(stats: KeyStats, cost: CostModel) -> float:
    """Sum of `cold_load` over all keys, without a per-key array."""
    return float(
        cost.request_overhead_s * float(stats.rate.sum())
        + cost.prefill_s_per_token * dot(stats.rate, stats.prompt_tokens)
        + cost.decode_s_per_token * dot(stats.rate, stats.output_tokens)
    )


def unkeyed_load(unkeyed: UnkeyedTraffic, cost: CostModel) -> float:
    return unkeyed.rate * float(cost.request_cost(unkeyed.prompt_tokens, 0.0, unkeyed.output_tokens))


def replicas_needed(load: F64, share: float, min_weight: float, cap: int) -> I64:
    """Destinations each key needs so no replica takes more than `share` of any destination.

    The smallest destination is the yardstick, so the limit holds wherever a replica lands;
    the count is capped by `cap` (max destinations per key, at most the number of destinations).
    """
    per_destination = share * min_weight
    need = np.ceil(load / per_destination - 1e-12)
    return np.clip(need, 1, max(cap, 1)).astype(np.int64)


def warm_capacity(destinations: Sequence[Destination], cost: CostModel) -> F64:
    """Warm KV each destination can hold, in GPU-token equivalents: its GPU tokens plus its host-tier
    tokens valued by what they save net of the copy back (`CostModel.host_value`)."""
    kv = np.array([float(d.kv_capacity_tokens) for d in destinations], dtype=np.float64)
    host = np.array([float(d.host_kv_capacity_tokens) for d in destinations], dtype=np.float64)
    return np.asarray(kv + np.floor(host * cost.host_value), dtype=np.float64)


def warm_budget(destinations: Sequence[Destination], budget: Budget, cost: CostModel | None = None) -> F64:
    """Warm KV tokens per destination: the fixed number (within the warm capacity when known), or
    auto, a share of the warm capacity of both tiers (`warm_capacity`)."""
    kv = warm_capacity(destinations, cost or CostModel())
    if budget.warm_tokens_per_destination == "auto":
        return np.floor(kv * budget.auto_fraction)
    fixed = float(budget.warm_tokens_per_destination)
    return np.where(kv > 0, np.minimum(kv, fixed), fixed)


@dataclass(frozen=True, eq=False)
class PinnedRoutes:
    """The pinned keys, their destinations, and the load and warm room they take."""

    rows: I64  # stats row per pinned key, -1 when the key has no statistics
    hashes: U64
    dests: list[list[int]]
    load: F64  # per destination
    kv: F64  # per destination
    mask: B  # per stats row
    key_load: F64  # per pinned key


def pinned_routes(
    pinned: Mapping[str, Sequence[str]],
    stats: KeyStats,
    key_load: F64,
    dest_ids: list[str],
    budget: Budget,
) -> PinnedRoutes:
    """Check the pinned routes against the pool and charge their keys' load and prefixes."""
    m = len(dest_ids)
    index = {d: i for i, d in enumerate(dest_ids)}
    names = list(pinned)
    rows = np.full(len(names), -1, dtype=np.int64)
    mask = np.zeros(len(stats), dtype=bool)
    load = np.zeros(m, dtype=np.float64)
    kv = np.zeros(m, dtype=np.float64)
    plist: list[list[int]] = []
    row_of = {k: i for i, k in enumerate(stats.names)} if names else {}
    pload = np.zeros(len(names), dtype=np.float64)
    for j, name in enumerate(names):
        ids = pinned[name]
        if not isinstance(name, str) or not name:
            raise PlanInputError(f"pinned key {name!r} must be a non-empty string")
        if isinstance(ids, str) or not len(ids):
            raise PlanInputError(f"pinned[{name!r}] must list at least one destination id, got {ids!r}")
        if len(ids) > budget.max_destinations_per_key:
            raise PlanInputError(
                f"pinned[{name!r}] lists {len(ids)} destinations, more than "
                f"budget.max_destinations_per_key={budget.max_destinations_per_key}"
            )
        unknown = [d for d in ids if d not in index]
        if unknown:
            raise PlanInputError(
                f"pinned[{name!r}] names destination {unknown[0]!r}, which is not in the pool "
                f"(known: {', '.join(dest_ids[:8])}{', ...' if m > 8 else ''})"
            )
        if len(set(ids)) != len(ids):
            raise PlanInputError(f"pinned[{name!r}] lists a destination twice: {list(ids)!r}")
        dl = [index[d] for d in ids]
        plist.append(dl)
        row = row_of.get(name, -1)
        rows[j] = row
        if row >= 0:
            mask[row] = True
            pload[j] = float(key_load[row])
            load[dl] += pload[j] / len(dl)
            kv[dl] += float(stats.prefix_tokens[row])
    return PinnedRoutes(rows, affinity_key_hashes(names), plist, load, kv, mask, pload)


@dataclass(frozen=True, eq=False)
class Demand:
    """Per key: load when served warm and destinations wanted; per destination: the warm budget
    and the room the pinned routes leave of it."""

    key_load: F64
    replicas: I64
    pinned: PinnedRoutes
    warm_budget: F64
    room: F64
    notes: tuple[str, ...]


def key_demand(
    stats: KeyStats,
    destinations: Sequence[Destination],
    *,
    weights: F64,
    pinned: Mapping[str, Sequence[str]],
    budget: Budget,
    cost: CostModel,
) -> Demand:
    """Step 1: every key's warm load and replicas; the pinned routes take load and room first."""
    dest_ids = [d.id for d in destinations]
    key_load = warm_load(stats, cost)
    pin = pinned_routes(pinned, stats, key_load, dest_ids, budget)
    wb = warm_budget(destinations, budget, cost)
    room = np.maximum(wb - pin.kv, 0.0)
    notes = []
    if bool(np.any(pin.kv > wb)):
        notes.append(f"pinned prefixes exceed the warm budget on {dest_ids[int(np.argmax(pin.kv - wb))]}")
    cap = min(budget.max_destinations_per_key, len(destinations))
    replicas = replicas_needed(key_load, budget.max_key_share_of_destination, float(weights.min()), cap)
    return Demand(key_load, replicas, pin, wb, room, tuple(notes))

