"""A replayable window built from per-key statistics: what the operator has to feed the guard.

The operator sees Prometheus counters per key (rate, mean prompt, stable prefix, output), not
request-level traces. `window_from_stats` turns them into a trace of the same traffic: Poisson
arrivals per key at its rate; every request of a key shares the key's stable prefix blocks and
carries unique blocks for the rest of its prompt; keyless traffic gets unique blocks only.

Given a destination's KV capacity, `fitting_window` leaves out the requests no destination could
hold (prompt blocks and output over the capacity) and counts them: a server refuses a request
longer than its model's length, which fits its KV cache, so they are never served and must not
keep the rest of the window from being replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.trace import NO_KEY, RequestTrace

DEFAULT_BLOCK_SIZE = 256


@dataclass(frozen=True)
class StatsWindow:
    """A synthesised window and how many of its requests were left out as too long to hold."""

    trace: RequestTrace
    left_out: int = 0


def window_from_stats(
    stats: KeyStats, *, duration_s: float, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0
) -> RequestTrace:
    """Requests over `duration_s` seconds with the rates and token sizes of `stats`."""
    return fitting_window(stats, duration_s=duration_s, block_size=block_size, seed=seed).trace


def fitting_window(
    stats: KeyStats,
    *,
    duration_s: float,
    kv_capacity_tokens: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> StatsWindow:
    """`window_from_stats`, less the requests that need more than `kv_capacity_tokens` of KV
    (prompt blocks and output; none left out when it is None); counted in `left_out`."""
    if not duration_s > 0:
        raise ValueError("window duration must be positive")
    if block_size < 1:
        raise ValueError("block size must be positive")
    rng = np.random.default_rng(seed)
    n_keys = len(stats)
    counts = rng.poisson(stats.rate * duration_s)
    u = stats.unkeyed
    n_unkeyed = int(rng.poisson(u.rate * duration_s))
    key = np.concatenate([np.repeat(np.arange(n_keys, dtype=np.int64), counts),
                          np.full(n_unkeyed, NO_KEY, dtype=np.int64)])
    n = len(key)
    if n == 0:
        raise ValueError("the statistics describe no traffic over the window")
    keyed = key != NO_KEY
    kk = np.where(keyed, key, 0)
    prompt = np.where(keyed, stats.prompt_tokens[kk], u.prompt_tokens)
    prompt = np.maximum(np.rint(prompt), 1).astype(np.int64)
    prefix = np.where(keyed, stats.prefix_tokens[kk], 0.0)
    prefix = np.minimum(np.rint(prefix).astype(np.int64), prompt - 1)
    output = np.where(keyed, stats.output_tokens[kk], u.output_tokens)
    output = np.maximum(np.rint(output), 1).astype(np.int64)
    arrival = rng.uniform(0.0, duration_s, n)
    order = np.argsort(arrival, kind="stable")
    key, prompt, prefix, output, arrival = key[order], prompt[order], prefix[order], output[order], arrival[order]
    # Dropped before their blocks exist: a prompt of millions of tokens would need millions of ids.
    n_blocks = -(-prompt // block_size)
    capacity = np.iinfo(np.int64).max if kv_capacity_tokens is None else kv_capacity_tokens
    fits = n_blocks * block_size + output <= capacity
    left_out = n - int(np.count_nonzero(fits))
    if left_out == n:
        raise ValueError(f"every one of the window's {n:,} request(s) needs more KV than one destination holds "
                         f"({kv_capacity_tokens:,} tokens): a server refuses them")
    if left_out:
        key, prompt, prefix, output, arrival = key[fits], prompt[fits], prefix[fits], output[fits], arrival[fits]
        n, n_blocks = len(key), n_blocks[fits]

    # Block ids: the key's shared prefix blocks by position, then ids unique to the request.
    shared = np.where(key != NO_KEY, prefix // block_size, 0)
    offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_blocks, out=offs[1:])
    req = np.repeat(np.arange(n, dtype=np.int64), n_blocks)
    pos = np.arange(int(offs[-1]), dtype=np.int64) - offs[req]
    max_shared = int(shared.max()) + 1 if n else 1
    unique_base = n_keys * max_shared
    ids = np.where(pos < shared[req], np.maximum(key[req], 0) * max_shared + pos, unique_base + np.arange(len(pos)))
    trace = RequestTrace(
        arrival_s=arrival.astype(np.float64),
        key=key,
        input_tokens=prompt,
        output_tokens=output,
        block_offsets=offs,
        block_ids=ids.astype(np.int64),
        block_size=block_size,
        key_names=stats.names,
        name="stats-window",
        key_hashes=stats.key_hashes,
    )
    return StatsWindow(trace, left_out)

