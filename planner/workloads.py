"""Synthetic workloads: business keys with Zipf-like skew, multi-turn threads, stable prefixes.

Model. Every key has a stable prefix (system prompt + key context) of its own size, drawn from a
clipped lognormal (heterogeneous sizes), optionally after a prefix shared by all keys. Requests
come in threads (conversations) of one key: turn j's prompt is the key's prefix, the previous
turns' messages and answers, and a new message; its output becomes part of the next turn.
Thread starts are uniform over the duration (Poisson); turns follow at lognormal gaps; a turn
after the end of the trace, or whose prompt would exceed `max_prompt_tokens`, ends its thread.

Every key gets at least one thread; the remaining threads pick keys by a Zipf law whose exponent
is solved so that the top `top_key_fraction` of keys carry `top_key_request_share` of requests.
The share of multi-turn threads is solved so that `multi_turn_share` of requests belong to a
thread with at least two requests in the trace; the thread count is solved for `qps`. Both are
fixed points computed on the generated trace itself (deterministic given the seed).

Block ids are prefix-chained like Mooncake's: global-prefix blocks, then the key's prefix
blocks, then the thread's blocks by position; a prompt's final partial block gets an id of its
own.

Presets:
- `cacheroute-paper`: the report's statistics (128,824 keys; ~4 % of keys carry 47 % of requests;
  80.8 % of requests in multi-turn threads; minute-scale gaps; heterogeneous prefix sizes). The
  report gives no token lengths; they are set so that the preset also reproduces the report's
  operating point on 30 default destinations: Flat-LB serves ~61 % of prompt tokens from cache
  (report: 64.1 %), because every prompt starts with a 1,536-token prefix common to the product
  (system prompt and tool schemas), and the fleet's capacity lies in the report's range (p99 TTFT
  about 1 s at 150 QPS under p2c; report: 76-176 QPS). Then comes the key's own context
  (lognormal, median 512 tokens), the thread's history and a new message (median 80 tokens;
  answers median 120). Turn gaps follow the Mooncake conversation trace (median ~2 min).
  Generated at 200 QPS, so replays near the report's capacities barely stretch the gaps.
- `low-reuse`: the report's negative case, where affinity lifts the served KV hit only from ~1 %
  to ~12 %: 1,000 keys with ~1k-token prefixes ahead of long, mostly unique prompts (~4k tokens)
  and few follow-ups. Replayed on 30 default destinations at 40 QPS, p2c serves ~1 % of prompt
  tokens from cache and key affinity (sticky hash, CacheRoute) ~12 % (tests/unit/replay); with
  one infinite cache the bound would be ~20 %.

`sampled` (`sampled_spec`): a workload whose every parameter is drawn from `--seed` over wide
ranges (`SAMPLED_RANGES`), so that a method can be checked on workloads nobody chose: key count,
skew, multi-turn share and turn count, turn gaps, a shared system prompt or none, prefix,
message and answer sizes and their spreads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Final

import numpy as np
import numpy.typing as npt

from cacheroute.planner.trace import RequestTrace
from cacheroute.planner.tracestats import TraceStats, top_share, trace_stats


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "custom"
    keys: int = 10_000
    top_key_fraction: float = 0.04
    top_key_request_share: float = 0.47
    multi_turn_share: float = 0.808
    mean_turns: float = 5.0  # turns of a multi-turn thread before truncation (>= 2)
    turn_gap_median_s: float = 120.0
    turn_gap_sigma: float = 0.8
    shared_prefix_tokens: int = 0
    prefix_median_tokens: float = 3000.0
    prefix_sigma: float = 1.0
    prefix_min_tokens: int = 256
    prefix_max_tokens: int = 24_576
    message_median_tokens: float = 300.0
    message_sigma: float = 0.8
    message_max_tokens: int = 8192
    output_median_tokens: float = 250.0
    output_sigma: float = 0.7
    output_max_tokens: int = 2048
    max_prompt_tokens: int = 32_768
    qps: float = 100.0
    duration_s: float = 3600.0
    block_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.keys >= 1, "keys must be at least 1"),
            (0 < self.top_key_fraction < 1, "top_key_fraction must be in (0, 1)"),
            (
                self.top_key_fraction <= self.top_key_request_share < 1,
                "top_key_request_share must be in [top_key_fraction, 1)",
            ),
            (0 <= self.multi_turn_share < 1, "multi_turn_share must be in [0, 1)"),
            (self.mean_turns >= 2, "mean_turns must be at least 2"),
            (self.turn_gap_median_s > 0, "turn_gap_median_s must be positive"),
            (self.shared_prefix_tokens >= 0, "shared_prefix_tokens must not be negative"),
            (0 < self.prefix_min_tokens <= self.prefix_max_tokens, "prefix min/max are inconsistent"),
            (
                self.message_median_tokens >= 1 and self.output_median_tokens >= 1,
                "message and output medians must be at least 1 token",
            ),
            (
                self.max_prompt_tokens > self.shared_prefix_tokens + self.prefix_max_tokens,
                "max_prompt_tokens must exceed the largest prefix",
            ),
            (self.qps > 0 and self.duration_s > 0, "qps and duration_s must be positive"),
            (self.block_size >= 1, "block_size must be positive"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"workload {self.name}: {msg}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class Workload:
    spec: WorkloadSpec
    trace: RequestTrace
    thread: npt.NDArray[np.int64]

    def stats(self) -> TraceStats:
        return trace_stats(self.trace, self.thread, self.spec.top_key_fraction)


PRESETS: dict[str, WorkloadSpec] = {
    "cacheroute-paper": WorkloadSpec(
        name="cacheroute-paper",
        keys=128_824,
        top_key_fraction=0.04,
        top_key_request_share=0.47,
        multi_turn_share=0.808,
        mean_turns=4.0,
        turn_gap_median_s=120.0,
        shared_prefix_tokens=1536,
        prefix_median_tokens=512.0,
        prefix_sigma=1.0,
        prefix_max_tokens=16_384,
        message_median_tokens=80.0,
        output_median_tokens=120.0,
        block_size=256,
        qps=200.0,
        duration_s=3600.0,
    ),
    "low-reuse": WorkloadSpec(
        name="low-reuse",
        keys=1000,
        top_key_fraction=0.04,
        top_key_request_share=0.15,
        multi_turn_share=0.05,
        mean_turns=2.5,
        turn_gap_median_s=120.0,
        prefix_median_tokens=1000.0,
        prefix_sigma=0.3,
        prefix_min_tokens=256,
        prefix_max_tokens=4096,
        message_median_tokens=4000.0,
        message_sigma=0.5,
        output_median_tokens=300.0,
        block_size=256,
        qps=100.0,
        duration_s=3600.0,
    ),
}


SAMPLED: Final = "sampled"
# The ranges `sampled_spec` draws from ("log" ones uniformly in the logarithm). Keys are bounded
# by the request count so that every key gets a thread and the top keys' share stays reachable.
SAMPLED_RANGES: Final[dict[str, tuple[float, float, str]]] = {
    "keys": (100.0, 1.0 / 12.0, "log, at most this fraction of the requests"),
    "top_key_fraction": (0.01, 0.10, "uniform"),
    "top_key_request_share": (0.10, 0.60, "uniform, at least top_key_fraction + 0.05"),
    "multi_turn_share": (0.0, 0.90, "uniform"),
    "mean_turns": (2.0, 8.0, "uniform"),
    "turn_gap_median_s": (10.0, 300.0, "log"),
    "turn_gap_sigma": (0.3, 1.2, "uniform"),
    "prefix_median_tokens": (128.0, 8000.0, "log"),
    "prefix_sigma": (0.2, 1.2, "uniform"),
    "message_median_tokens": (30.0, 3000.0, "log"),
    "message_sigma": (0.3, 1.0, "uniform"),
    "output_median_tokens": (50.0, 800.0, "log"),
    "output_sigma": (0.3, 1.0, "uniform"),
}
# A system prompt common to every key: none in two draws of five, else one of these sizes.
SAMPLED_SHARED_PREFIX_TOKENS: Final = (0, 0, 256, 1024, 3072)
SAMPLED_QPS: Final = 30.0
SAMPLED_DURATION_S: Final = 900.0


def sampled_spec(seed: int, *, qps: float = SAMPLED_QPS, duration_s: float = SAMPLED_DURATION_S) -> WorkloadSpec:
    """A workload with every parameter drawn from `seed` (`SAMPLED_RANGES`); the draw of its
    requests uses the same seed."""
    if seed < 0:
        raise ValueError(f"workload {SAMPLED}: the seed must not be negative, got {seed}")
    rng = np.random.default_rng([0x5A17, seed])
    r = SAMPLED_RANGES

    def draw(name: str, lo: float | None = None, hi: float | None = None) -> float:
        """One value of `name` over its range (narrowed by `lo`/`hi`), as the range says."""
        a, b, how = r[name]
        a, b = a if lo is None else lo, b if hi is None else hi
        if how.startswith("log"):
            return float(math.exp(rng.uniform(math.log(a), math.log(b))))
        return float(rng.uniform(a, b))

    requests = qps * duration_s
    key_lo, key_share, _ = r["keys"]
    if requests * key_share < key_lo:
        raise ValueError(
            f"workload {SAMPLED}: {requests:.0f} requests (qps x duration) are too few for "
            f"{key_lo:.0f} keys; raise qps or the duration"
        )
    keys = round(draw("keys", hi=requests * key_share))
    top_fraction = draw("top_key_fraction")
    top_share = draw("top_key_request_share", lo=top_fraction + 0.05)
    return WorkloadSpec(
        name=f"{SAMPLED}-{seed}",
        keys=keys,
        top_key_fraction=top_fraction,
        top_key_request_share=top_share,
        multi_turn_share=draw("multi_turn_share"),
        mean_turns=draw("mean_turns"),
        turn_gap_median_s=draw("turn_gap_median_s"),
        turn_gap_sigma=draw("turn_gap_sigma"),
        shared_prefix_tokens=int(rng.choice(SAMPLED_SHARED_PREFIX_TOKENS)),
        prefix_median_tokens=draw("prefix_median_tokens"),
        prefix_sigma=draw("prefix_sigma"),
        message_median_tokens=draw("message_median_tokens"),
        message_sigma=draw("message_sigma"),
        output_median_tokens=draw("output_median_tokens"),
        output_sigma=draw("output_sigma"),
        qps=qps,
        duration_s=duration_s,
        block_size=256,
        seed=seed,
    )


def workload_spec(name: str, seed: int) -> WorkloadSpec:
    """A preset drawn with `seed`, or (`sampled`) the workload `seed` draws."""
    if name == SAMPLED:
        return sampled_spec(seed)
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join([*sorted(PRESETS), SAMPLED])}")
    return preset(name, seed=seed)


def preset(name: str, **overrides: object) -> WorkloadSpec:
    try:
        spec = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    return replace(spec, **overrides) if overrides else spec  # type: ignore[arg-type]


def _lognormal(
    rng: np.random.Generator, median: float, sigma: float, size: int, *, lo: int, hi: int
) -> npt.NDArray[np.int64]:
    x = rng.lognormal(math.log(median), sigma, size)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def _zipf_weights(keys: int, s: float) -> npt.NDArray[np.float64]:
    w = np.arange(1, keys + 1, dtype=np.float64) ** -s
    return np.asarray(w / w.sum(), dtype=np.float64)


_MAX_ZIPF_EXPONENT = 4.0


def _top_share(keys: int, threads: int, top: int, s: float) -> float:
    """The share of threads the `top` keys carry in expectation: one thread per key, the rest by Zipf(s)."""
    w = _zipf_weights(keys, s)
    return (top + (threads - keys) * float(w[:top].sum())) / threads


def _most_keys(threads: int, top_fraction: float, share: float, keys: int) -> int:
    """The most keys, below `keys`, whose top keys can carry `share` of `threads` (0 if none can)."""
    def reachable(k: int) -> bool:
        return _top_share(k, threads, _top_keys(k, top_fraction), _MAX_ZIPF_EXPONENT) >= share

    lo, hi = 0, min(keys, threads + 1)  # reachable(lo) taken as true, reachable(hi) false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if reachable(mid) else (lo, mid)
    # The top count rounds up, so reachability is monotone only nearly: step down to one that is.
    while lo > 0 and not reachable(lo):
        lo -= 1
    return lo


def _top_keys(keys: int, top_fraction: float) -> int:
    return max(1, math.ceil(top_fraction * keys))


def _solve_zipf(keys: int, threads: int, top_fraction: float, share: float) -> float:
    """Exponent such that the top keys (`top_fraction` of them) carry `share` of threads in
    expectation, given one guaranteed thread per key and the rest drawn by Zipf."""
    top = _top_keys(keys, top_fraction)

    def top_share(s: float) -> float:
        return _top_share(keys, threads, top, s)

    if top_share(0.0) >= share:
        return 0.0
    lo, hi = 0.0, _MAX_ZIPF_EXPONENT
    if top_share(hi) < share:
        most = _most_keys(threads, top_fraction, share, keys)
        fewer = f"at most {most:,} keys reach it" if most else "no key count reaches it"
        raise ValueError(
            f"cannot reach a top-key share of {share:.2f} with {keys} keys over {threads} threads; "
            f"{fewer} at this qps x duration: lower the key count or raise qps x duration"
        )
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if top_share(mid) < share:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _draw_threads(
    spec: WorkloadSpec, threads: int, p_multi: float, top_thread_share: float, rng: np.random.Generator
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Key rank, start time and planned turn count of every thread."""
    keys = spec.keys
    if threads < keys:
        raise ValueError(
            f"workload {spec.name}: {threads} threads (qps x duration / requests per thread) cannot "
            f"cover {keys} keys with one thread each; raise qps x duration or lower keys"
        )
    s = _solve_zipf(keys, threads, spec.top_key_fraction, top_thread_share)
    extra = rng.choice(keys, size=threads - keys, p=_zipf_weights(keys, s))
    rank = np.concatenate([np.arange(keys), extra])
    rng.shuffle(rank)
    start = rng.uniform(0.0, spec.duration_s, threads)
    multi = rng.random(threads) < p_multi
    extra_turns = rng.geometric(1.0 / (spec.mean_turns - 1.0), threads)  # >= 1
    turns = np.where(multi, 1 + extra_turns, 1).astype(np.int64)
    return rank.astype(np.int64), start, turns


def _build(spec: WorkloadSpec, threads: int, p_multi: float, top_thread_share: float) -> Workload:
    rng = np.random.default_rng(spec.seed)
    bs = spec.block_size
    rank, start, turns = _draw_threads(spec, threads, p_multi, top_thread_share, rng)
    # Key ids are ranks shuffled, so key names do not reveal popularity.
    perm = rng.permutation(spec.keys)
    key_of_thread = perm[rank]
    prefix = (
        _lognormal(
            rng, spec.prefix_median_tokens, spec.prefix_sigma, spec.keys,
            lo=spec.prefix_min_tokens, hi=spec.prefix_max_tokens,
        )
        + spec.shared_prefix_tokens
    )

    # One row per planned turn.
    th = np.repeat(np.arange(threads), turns)
    first_row = np.zeros(threads + 1, dtype=np.int64)
    np.cumsum(turns, out=first_row[1:])
    turn = np.arange(len(th)) - first_row[th]
    rows = len(th)
    gaps = rng.lognormal(math.log(spec.turn_gap_median_s), spec.turn_gap_sigma, rows)
    gaps[turn == 0] = 0.0
    arrival = start[th] + _group_cumsum(gaps, first_row)
    msg = _lognormal(rng, spec.message_median_tokens, spec.message_sigma, rows, lo=1, hi=spec.message_max_tokens)
    out = _lognormal(rng, spec.output_median_tokens, spec.output_sigma, rows, lo=1, hi=spec.output_max_tokens)
    grown = _group_cumsum(msg + out, first_row).astype(np.int64) - out  # history + own message
    key = key_of_thread[th]
    prompt = prefix[key] + grown
    # A thread ends at its first turn past the trace end or the prompt limit.
    bad = (arrival >= spec.duration_s) | (prompt > spec.max_prompt_tokens)
    bad_cum = _group_cumsum(bad.astype(np.int64), first_row)
    keep = bad_cum == 0
    order = np.argsort(arrival[keep], kind="stable")
    idx = np.flatnonzero(keep)[order]

    arrival_k = arrival[idx]
    prompt_k = prompt[idx]
    out_k = out[idx]
    key_k = key[idx]
    th_k = th[idx]

    # Block ids: [global prefix][key prefix][thread stream]; a final partial block is unique.
    shared_blocks = spec.shared_prefix_tokens // bs
    key_blocks = prefix // bs  # full blocks holding only global + key prefix
    max_key_blocks = int(key_blocks.max()) + 1
    max_blocks = spec.max_prompt_tokens // bs + 1
    n_blocks = -(-prompt_k // bs)
    full = prompt_k // bs
    offs = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(n_blocks, out=offs[1:])
    total = int(offs[-1])
    req_of = np.repeat(np.arange(len(idx)), n_blocks)
    pos = np.arange(total) - offs[req_of]
    kb = key_blocks[key_k][req_of]
    key_id_base = shared_blocks  # ids below this are the global prefix blocks
    thread_id_base = key_id_base + spec.keys * max_key_blocks
    partial_id_base = thread_id_base + threads * max_blocks
    ids = np.where(
        pos < shared_blocks,
        pos,
        np.where(
            pos < kb,
            key_id_base + key_k[req_of] * max_key_blocks + pos,
            thread_id_base + th_k[req_of] * max_blocks + pos,
        ),
    )
    is_partial = (pos == full[req_of]) & (prompt_k[req_of] % bs != 0)
    ids = np.where(is_partial, partial_id_base + req_of, ids).astype(np.int64)

    names = tuple(f"key-{k:06d}" for k in range(spec.keys))
    trace = RequestTrace(
        arrival_s=arrival_k.astype(np.float64),
        key=key_k.astype(np.int64),
        input_tokens=prompt_k.astype(np.int64),
        output_tokens=out_k.astype(np.int64),
        block_offsets=offs,
        block_ids=ids,
        block_size=bs,
        key_names=names,
        name=spec.name,
    )
    return Workload(spec=spec, trace=trace, thread=th_k.astype(np.int64))


def _group_cumsum(
    x: npt.NDArray[np.float64] | npt.NDArray[np.int64], first_row: npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    """Cumulative sum of x restarting at every group start (`first_row` are group offsets); exact
    for integer sums below 2**53."""
    c = np.cumsum(x, dtype=np.float64)
    starts = first_row[:-1]
    lens = np.diff(first_row)
    before = np.where(starts > 0, c[np.maximum(starts - 1, 0)], 0.0)
    return np.asarray(c - np.repeat(before, lens), dtype=np.float64)


def _achieved(w: Workload) -> tuple[float, float, int]:
    """Multi-turn request share, top-key request share and request count of a draw."""
    _, counts = np.unique(w.thread, return_counts=True)
    n = len(w.thread)
    multi = float(counts[counts >= 2].sum()) / n if n else 0.0
    top, _ = top_share(w.trace.key, w.spec.top_key_fraction)
    return multi, top, n


def _odds_step(p: float, target: float, got: float) -> float:
    """Move probability p so that an outcome at `got` moves towards `target` (odds ratio)."""
    if not 0.0 < got < 1.0 or not 0.0 < target < 1.0:
        return p
    r = target * (1.0 - got) / (got * (1.0 - target))
    return min(0.999, max(1e-6, p * r / (1.0 + p * (r - 1.0))))


def generate(spec: WorkloadSpec) -> Workload:
    """Generate the workload of `spec` (deterministic given `spec.seed`)."""
    target = spec.qps * spec.duration_s
    m = spec.mean_turns
    s = spec.multi_turn_share
    # Share of requests in multi-turn threads is p*m / (p*m + 1 - p) before truncation.
    p = s / (m * (1.0 - s) + s) if s > 0 else 0.0
    top_target = spec.top_key_request_share
    threads = round(target / (p * m + 1.0 - p))
    w = _build(spec, threads, p, top_target)
    # Truncation at the end of the trace and at the prompt limit shortens threads, and thread
    # lengths vary: correct the multi-turn probability, the thread count and the top keys' thread
    # share from what the previous draw achieved.
    for _ in range(3):
        got_multi, got_top, got_n = _achieved(w)
        if s > 0:
            p = _odds_step(p, s, got_multi)
        top_target = _odds_step(top_target, spec.top_key_request_share, got_top)
        threads = round(threads * target / max(got_n, 1))
        w = _build(spec, threads, p, top_target)
    return w
