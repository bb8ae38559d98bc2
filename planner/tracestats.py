"""Workload statistics, with the definitions of `traces/README.md`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from cacheroute.planner.trace import NO_KEY, RequestTrace


@dataclass(frozen=True)
class TraceStats:
    requests: int
    duration_s: float
    qps: float
    mean_input_tokens: float
    median_input_tokens: float
    mean_output_tokens: float
    distinct_keys: int
    top_keys_fraction: float
    top_keys_request_share: float
    threads: int
    multi_turn_request_share: float
    continuation_share: float
    ideal_token_reuse: float
    median_turn_gap_s: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def top_share(key: npt.NDArray[np.int64], fraction: float = 0.04) -> tuple[float, int]:
    """Share of keyed requests carried by the ceil(fraction) most frequent keys, and key count."""
    k = key[key != NO_KEY]
    if len(k) == 0:
        return 0.0, 0
    counts = np.bincount(k)
    counts = counts[counts > 0]
    top = max(1, math.ceil(fraction * len(counts)))
    counts.sort()
    return float(counts[-top:].sum() / len(k)), len(counts)


def ideal_token_reuse(trace: RequestTrace) -> float:
    """Prompt tokens covered by the longest prefix seen in any earlier request, over all prompt
    tokens: one instance with an infinite cache, the bound of any router's KV hit."""
    offs = trace.block_offsets.tolist()
    ids = trace.block_ids
    inp = trace.input_tokens.tolist()
    bs = trace.block_size
    seen: set[int] = set()
    hit = 0
    for r in range(len(trace)):
        blocks: list[int] = ids[offs[r] : offs[r + 1]].tolist()
        m = 0
        for b in blocks:
            if b in seen:
                m += 1
            else:
                break
        hit += min(m * bs, inp[r])
        seen.update(blocks)
    total = int(trace.input_tokens.sum())
    return hit / total if total else 0.0


def trace_stats(trace: RequestTrace, thread: npt.NDArray[np.int64], top_fraction: float = 0.04) -> TraceStats:
    """Statistics of a trace; `thread` gives each request's conversation thread id."""
    n = len(trace)
    share, distinct = top_share(trace.key, top_fraction)
    _, first_of, per_thread = np.unique(thread, return_index=True, return_counts=True)
    in_multi = int(per_thread[per_thread >= 2].sum())
    order = np.lexsort((trace.arrival_s, thread))
    th_sorted = thread[order]
    same = th_sorted[1:] == th_sorted[:-1]
    gaps = np.diff(trace.arrival_s[order])[same]
    duration = trace.duration_s
    return TraceStats(
        requests=n,
        duration_s=duration,
        qps=n / duration if duration > 0 else float("nan"),
        mean_input_tokens=float(trace.input_tokens.mean()) if n else 0.0,
        median_input_tokens=float(np.median(trace.input_tokens)) if n else 0.0,
        mean_output_tokens=float(trace.output_tokens.mean()) if n else 0.0,
        distinct_keys=distinct,
        top_keys_fraction=top_fraction,
        top_keys_request_share=share,
        threads=len(per_thread),
        multi_turn_request_share=in_multi / n if n else 0.0,
        continuation_share=(n - len(first_of)) / n if n else 0.0,
        ideal_token_reuse=ideal_token_reuse(trace),
        median_turn_gap_s=float(np.median(gaps)) if len(gaps) else float("nan"),
    )
