"""The planner's input from what the cluster reports: statistics, destinations, settings.

- Statistics: the router counts requests, prompt tokens and reusable-prefix tokens per key; over
  a window of W seconds a key's rate is its requests / W and its token columns are means per
  request. Keys are labelled by their 16-hex `affinity_key_hash` (or in clear when the router
  exports names, then hashed here), so the rows carry known hashes. Keys the router's sketch does
  not track (`__other__`) and requests without a key (`__none__`) are traffic the plan cannot
  route: they are the planner's unkeyed traffic. Output tokens per request come from vLLM
  (generated tokens over the window / requests), the same mean for every key.
- Destinations: the pool's ready destinations (ids `<pool>-<ordinal>`, addresses), each with the
  memory plan's KV capacity.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from cacheroute.operator.api.common import parse_duration
from cacheroute.operator.api.plan import AffinityPlanSpec
from cacheroute.operator.api.pool import InferencePool
from cacheroute.operator.control.prometheus import WindowMetrics
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic
from cacheroute.planner.plan import Destination, KeyExtraction, affinity_key_hash
from cacheroute.planner.replay.guard import GuardSettings
from cacheroute.planner.settings import Budget, Stability

_HASH_LABEL = re.compile(r"^[0-9a-f]{16}$")


def key_hash_of_label(label: str) -> int:
    """The affinity hash a router key label stands for: the label itself when it is 16 hex
    digits (the router's default), else the hash of the clear key."""
    return int(label, 16) if _HASH_LABEL.match(label) else affinity_key_hash(label)


@dataclass(frozen=True, eq=False)
class PlanningStats:
    stats: KeyStats
    output_tokens_known: bool


def key_stats(window: WindowMetrics, pinned_keys: Sequence[str] = ()) -> PlanningStats:
    """Per-key statistics of the window (see the module docstring).

    Rows whose hash is that of a pinned key are named by the pinned key, so the planner matches
    them with `spec.pinned`; the names stay in memory (the plan holds hashes only).
    """
    keys = window.keys
    w = window.window_s
    labels_hashes = np.fromiter((key_hash_of_label(label) for label in keys.labels), np.uint64, len(keys))
    # Rows in hash order, so the planner's input does not depend on the order Prometheus answers
    # in; two labels of one hash (a router exporting names beside one exporting hashes) add up.
    hashes, first, row = np.unique(labels_hashes, return_index=True, return_inverse=True)
    row = row.reshape(-1)
    requests, prompt_total, prefix_total = (
        np.bincount(row, weights=col, minlength=len(hashes))
        for col in (keys.requests, keys.prompt_tokens, keys.prefix_tokens)
    )
    labels = [keys.labels[i] for i in first.tolist()]
    total = window.total_requests
    generated = window.generation_tokens
    output = generated / total if generated is not None and total > 0 else 0.0
    prompt_mean = prompt_total / requests
    prefix_mean = np.minimum(prefix_total / requests, prompt_mean)
    names = labels
    if pinned_keys:
        row_of = {int(h): i for i, h in enumerate(hashes.tolist())}
        for key in pinned_keys:
            i = row_of.get(affinity_key_hash(key))
            if i is not None:
                names[i] = key
    aggregate_requests = window.other.requests + window.unkeyed.requests
    aggregate_prompt = window.other.prompt_tokens + window.unkeyed.prompt_tokens
    unkeyed = UnkeyedTraffic(
        rate=aggregate_requests / w,
        prompt_tokens=aggregate_prompt / aggregate_requests if aggregate_requests > 0 else 0.0,
        output_tokens=output,
    )
    stats = KeyStats(
        names=tuple(names),
        rate=requests / w,
        prompt_tokens=prompt_mean,
        prefix_tokens=prefix_mean,
        output_tokens=np.full(len(names), output),
        unkeyed=unkeyed,
        window_s=w,
        key_hashes=hashes,
    )
    return PlanningStats(stats, generated is not None)


def pool_destinations(pool: InferencePool, *, ready_only: bool) -> list[Destination]:
    """The pool's destinations in ordinal order, with the memory plan's KV capacity on GPU and in
    the host-memory tier (the planner's warm budget spans both)."""
    status = pool.status
    if status is None:
        return []
    memory = status.memory_plan
    kv = memory.kv_capacity_tokens if memory is not None else 0
    host = memory.host_kv_capacity_tokens if memory is not None else 0
    found = [Destination(d.id, d.address, 1.0, kv, host) for d in status.destinations if d.ready or not ready_only]
    return sorted(found, key=lambda d: _ordinal_key(d.id))


def no_destination_message(pool: InferencePool, name: str, *, ready_only: bool) -> str:
    """Why a pool offers nothing to plan for: scaled to zero on purpose, or replicas not (yet) there."""
    if pool.spec.replicas == 0:
        return (f"InferencePool {name} is scaled to zero (spec.replicas is 0): nothing to plan for until it has "
                "replicas again")
    return f"InferencePool {name} " + ("has no ready destination" if ready_only else "lists no destination")


def max_prompt_tokens(pool: InferencePool) -> int | None:
    """The longest prompt the pool's engines accept (their `--max-model-len`); None while no
    memory plan says it."""
    memory = pool.status.memory_plan if pool.status is not None else None
    return memory.max_model_len if memory is not None and memory.max_model_len > 0 else None


def _ordinal_key(dest_id: str) -> tuple[str, int]:
    stem, _, tail = dest_id.rpartition("-")
    return (stem, int(tail)) if tail.isdigit() else (dest_id, -1)


def key_extraction(pool: InferencePool) -> KeyExtraction:
    """The pool's key settings as the plan header carries them (header names in lower case, as
    HTTP/2 and Envoy deliver them; an empty body field means none)."""
    r = pool.spec.router
    return KeyExtraction(
        header=r.key_header.lower(),
        body_field=r.body_field or None,
        session_header=r.session_header.lower() if r.session_header else None,
        prompt_prefix_chars=r.prompt_prefix_chars,
    )


def budget(spec: AffinityPlanSpec) -> Budget:
    b = spec.budget
    return Budget(
        warm_tokens_per_destination=b.warm_tokens_per_destination,
        auto_fraction=b.auto_fraction,
        max_destinations_per_key=b.max_destinations_per_key,
        max_key_share_of_destination=b.max_key_share_of_destination,
    )


def stability(spec: AffinityPlanSpec) -> Stability:
    return Stability(max_churn=spec.stability.max_churn, min_gain=spec.stability.min_gain)


def guard_settings(spec: AffinityPlanSpec) -> GuardSettings:
    return GuardSettings(
        slo_p99_ttft_s=parse_duration(spec.guard.p99_ttft),
        min_kv_hit_gain=spec.guard.min_kv_hit_gain,
    )


def pinned_routes(
    spec: AffinityPlanSpec, available: Sequence[Destination]
) -> tuple[dict[str, list[str]], list[str]]:
    """`spec.pinned` restricted to `available` destinations; and notes on what was dropped."""
    ids = {d.id for d in available}
    routes: dict[str, list[str]] = {}
    notes: list[str] = []
    for pin in spec.pinned:
        kept = [d for d in pin.destinations if d in ids]
        if len(kept) < len(pin.destinations):
            gone = [d for d in pin.destinations if d not in ids]
            notes.append(f"a pinned key's destination {gone[0]} is not ready")
        if kept:
            routes[pin.key] = kept
    return routes, notes


def unknown_pinned_destinations(spec: AffinityPlanSpec, pool_ids: Collection[str]) -> list[tuple[str, str]]:
    """Each pinned route that names a destination not in the pool at all: its key and the first
    such destination."""
    out = []
    for pin in spec.pinned:
        unknown = next((d for d in pin.destinations if d not in pool_ids), None)
        if unknown is not None:
            out.append((pin.key, unknown))
    return out
