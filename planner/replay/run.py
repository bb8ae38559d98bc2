"""The discrete-event loop: arrivals in time order, engines advanced lazily through a heap.

Each engine has at most one pending event (the end of its current step or decode stretch); the
heap holds (time, engine, version) and entries whose version is stale are skipped. Before a
request is routed, every event up to its arrival is processed, so the router's in-flight counts
and the scraped metrics are exact at that instant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np
import numpy.typing as npt

from cacheroute.planner.replay.engine import IDLE, Engine, RequestTable
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE, EngineProfile
from cacheroute.planner.replay.policy import Policy, RouterView
from cacheroute.planner.trace import RequestTrace

DEFAULT_POOL = "pool"
_CHECK_EVERY = 1024


def destination_ids(n: int, pool: str = DEFAULT_POOL) -> tuple[str, ...]:
    """Stable destination ids as the operator's StatefulSet names them: `<pool>-<ordinal>`."""
    return tuple(f"{pool}-{d}" for d in range(n))


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay.

    `warmup_fraction`: the first share of requests (by arrival) is replayed but left out of the
    metrics, so cold caches and the first control period do not count.
    `abort_above_p99_ttft_s`: stop as soon as the p99 TTFT of the measured requests is certain to
    exceed this (more than 1 % of them already late); the capacity search uses it.
    """

    destinations: int = 30
    profile: EngineProfile = DEFAULT_PROFILE
    warmup_fraction: float = 0.1
    abort_above_p99_ttft_s: float | None = None
    seed: int = 0
    pool: str = DEFAULT_POOL
    # Explicit destination ids (default `<pool>-<ordinal>`); their count must be `destinations`.
    destination_ids: tuple[str, ...] | None = None
    # A bound, not a model: every destination hits every prefix any of them ever computed (one
    # infinite cache shared by all), so routing can only change the balance.
    ideal_cache: bool = False

    def __post_init__(self) -> None:
        if self.destinations < 1:
            raise ValueError(f"destinations must be at least 1, got {self.destinations}")
        if self.destination_ids is not None and len(self.destination_ids) != self.destinations:
            raise ValueError(
                f"{len(self.destination_ids)} destination ids given for {self.destinations} destinations"
            )
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.abort_above_p99_ttft_s is not None and self.abort_above_p99_ttft_s <= 0:
            raise ValueError("abort_above_p99_ttft_s must be positive")


@dataclass(frozen=True, eq=False)
class ReplayResult:
    """Per-request outcomes (NaN where a request did not get that far: only in aborted runs)."""

    policy: str
    trace_name: str
    destinations: int
    arrival_s: npt.NDArray[np.float64]
    dest: npt.NDArray[np.int64]
    start_s: npt.NDArray[np.float64]
    first_token_s: npt.NDArray[np.float64]
    finish_s: npt.NDArray[np.float64]
    input_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]
    hit_tokens: npt.NDArray[np.int64]
    measured: npt.NDArray[np.bool_]
    busy_s: npt.NDArray[np.float64]
    processed_tokens: npt.NDArray[np.int64]
    steps: npt.NDArray[np.int64]
    aborted: bool = False
    policy_settings: dict[str, object] = field(default_factory=dict)

    @property
    def ttft_s(self) -> npt.NDArray[np.float64]:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> npt.NDArray[np.float64]:
        return self.finish_s - self.arrival_s

    @property
    def queue_s(self) -> npt.NDArray[np.float64]:
        return self.start_s - self.arrival_s


def kv_need(trace: RequestTrace) -> npt.NDArray[np.int64]:
    """The KV tokens each request holds at its end: its prompt's blocks and its output."""
    need: npt.NDArray[np.int64] = np.diff(trace.block_offsets) * trace.block_size + np.maximum(trace.output_tokens, 1)
    return need


def fitting(trace: RequestTrace, capacity: int) -> tuple[RequestTrace, int]:
    """`trace` less the requests no destination's KV cache can hold at all, and how many those are."""
    fits = kv_need(trace) <= capacity
    left_out = len(trace) - int(np.count_nonzero(fits))
    return (trace.select(fits) if left_out else trace), left_out


def check_fits(trace: RequestTrace, capacity: int) -> None:
    """Refuse a trace with a request no destination's KV cache can hold at all."""
    need = kv_need(trace)
    worst = int(np.argmax(need)) if len(need) else 0
    if len(need) and int(need[worst]) > capacity:
        too_long = int(np.count_nonzero(need > capacity))
        raise ValueError(
            f"{too_long:,} request(s) need more KV than one destination holds ({capacity:,} tokens): the longest, "
            f"arriving at {float(trace.arrival_s[worst]):.3f} s, needs {int(need[worst]):,} (prompt blocks + "
            "output); raise the KV capacity or drop such requests"
        )


def replay_trace(
    trace: RequestTrace,
    policy: Policy,
    config: ReplayConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay `trace` through `policy` over `config.destinations` engines."""
    cfg = config or ReplayConfig()
    n = len(trace)
    profile = cfg.profile
    out_arr = np.maximum(trace.output_tokens, 1)
    check_fits(trace, profile.kv_capacity_tokens)
    arrival: list[float] = trace.arrival_s.tolist()
    req = RequestTable(arrival, trace.input_tokens.tolist(), out_arr.tolist())
    offsets: list[int] = trace.block_offsets.tolist()
    block_ids = trace.block_ids

    def get_blocks(i: int) -> list[int]:
        blocks: list[int] = block_ids[offsets[i] : offsets[i + 1]].tolist()
        return blocks

    engines = [Engine(d, profile, trace.block_size, req, get_blocks) for d in range(cfg.destinations)]
    if cfg.ideal_cache:
        shared: set[int] = set()
        for e in engines:
            e.cache.ideal = shared
    ids = cfg.destination_ids or destination_ids(cfg.destinations, cfg.pool)
    view = RouterView(trace, engines, req, destination_ids=ids, profile=profile, get_blocks=get_blocks)
    policy.bind(view, cfg.seed)
    route = policy.route
    on_finish = policy.on_finish if policy.wants_finish else None
    inflight = view.inflight
    charging = view.charging
    pending = view.pending
    dest = req.dest
    heap: list[tuple[float, int, int]] = []
    finished: list[int] = []

    warmup = int(n * cfg.warmup_fraction)
    slo = cfg.abort_above_p99_ttft_s
    allowed_late = 0.01 * (n - warmup) + 2
    late = 0
    scan = warmup
    first = req.first
    aborted = False

    def advance(until: float) -> None:
        """Complete every engine step that ends by `until`, in time order."""
        while heap and heap[0][0] <= until:
            tt, e, ver = heappop(heap)
            eng = engines[e]
            if ver != eng.version:
                continue
            eng.step_done(finished)
            if eng.mode != IDLE:
                heappush(heap, (eng.t_end, e, eng.version))
            if finished:
                k = len(finished)
                inflight[e] -= k
                view.total_inflight -= k
                if charging:
                    charges = pending[e]
                    for r in finished:
                        charges.pop(r, None)
                if on_finish is not None:
                    for r in finished:
                        on_finish(r, e, tt)
                finished.clear()

    for i in range(n):
        t = arrival[i]
        advance(t)
        d = route(i, t)
        dest[i] = d
        inflight[d] += 1
        view.total_inflight += 1
        eng = engines[d]
        if eng.enqueue(i, t):
            heappush(heap, (eng.t_end, d, eng.version))
        if i % _CHECK_EVERY == 0:
            if progress is not None:
                progress(i, n)
            if slo is not None:
                # Requests that arrived more than `slo` ago are decided for good: late when their
                # first token came after the SLO or has not come yet.
                horizon = t - slo
                while scan < n and arrival[scan] < horizon:
                    f = first[scan]
                    if math.isnan(f) or f - arrival[scan] > slo:
                        late += 1
                    scan += 1
                if late > allowed_late:
                    aborted = True
                    break

    if not aborted:
        advance(math.inf)
    if progress is not None:
        progress(n, n)

    measured = np.zeros(n, dtype=bool)
    measured[warmup:] = True
    return ReplayResult(
        policy=policy.name,
        trace_name=trace.name,
        destinations=cfg.destinations,
        arrival_s=trace.arrival_s,
        dest=np.asarray(dest, dtype=np.int64),
        start_s=np.asarray(req.start, dtype=np.float64),
        first_token_s=np.asarray(first, dtype=np.float64),
        finish_s=np.asarray(req.finish, dtype=np.float64),
        input_tokens=trace.input_tokens,
        output_tokens=out_arr,
        hit_tokens=np.asarray(req.hit, dtype=np.int64),
        measured=measured,
        busy_s=np.asarray([e.busy_s for e in engines], dtype=np.float64),
        processed_tokens=np.asarray([e.tokens for e in engines], dtype=np.int64),
        steps=np.asarray([e.steps for e in engines], dtype=np.int64),
        aborted=aborted,
        policy_settings=policy.describe(),
    )

