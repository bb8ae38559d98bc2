"""Deterministic per-key statistics with a chosen skew, for benchmarks and tests.

The default matches the skew reported for CacheRoute's workload: the top 4% of keys carry 47% of
requests (a Zipf law whose exponent is solved for that share). Token sizes are assumptions of
this generator, not figures from the report: prompts log-normal around 2,500 tokens, a stable
prefix of about two thirds of the prompt for most keys, none for 10% of keys, outputs
log-normal around 250 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic

F64 = npt.NDArray[np.float64]
_BISECT_STEPS = 48


def zipf_top_share(n: int, exponent: float, top: int) -> float:
    w = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    return float(w[:top].sum() / w.sum())


def zipf_exponent_for_share(n: int, top_fraction: float, share: float) -> float:
    """The Zipf exponent s for which the top `top_fraction` of n keys carry `share` of requests."""
    top = max(1, math.ceil(top_fraction * n))
    if not top / n < share < 1:
        raise PlanInputError(f"share {share!r} is not reachable by the top {top} of {n} keys with a Zipf law")
    lo, hi = 0.0, 8.0
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if zipf_top_share(n, mid, top) < share:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class SyntheticStatsSpec:
    keys: int = 128_824
    total_rate: float = 176.0
    top_fraction: float = 0.04
    top_share: float = 0.47
    unkeyed_share: float = 0.05
    median_prompt_tokens: float = 2_500.0
    prompt_sigma: float = 0.8
    zero_prefix_share: float = 0.10
    median_output_tokens: float = 250.0
    output_sigma: float = 0.6
    name_prefix: str = "key-"
    seed: int = 0


def synthetic_key_stats(spec: SyntheticStatsSpec | None = None) -> KeyStats:
    """Per-key statistics drawn from `spec` (same spec and seed, same statistics)."""
    spec = spec or SyntheticStatsSpec()
    n = spec.keys
    if n < 1:
        raise PlanInputError(f"keys is {n!r}: need at least one key")
    rng = np.random.default_rng(spec.seed)
    s = zipf_exponent_for_share(n, spec.top_fraction, spec.top_share) if n > 1 else 0.0
    weight = np.arange(1, n + 1, dtype=np.float64) ** -s
    keyed_rate = spec.total_rate * (1 - spec.unkeyed_share)
    rate = keyed_rate * weight / weight.sum()
    # Ranks are spread over key names, so the hottest key is not the first row.
    rate = rate[rng.permutation(n)]
    prompt = np.maximum(np.round(spec.median_prompt_tokens * rng.lognormal(0.0, spec.prompt_sigma, n)), 16.0)
    share = rng.beta(4.0, 2.0, n)
    share[rng.random(n) < spec.zero_prefix_share] = 0.0
    prefix = np.floor(prompt * share)
    output = np.maximum(np.round(spec.median_output_tokens * rng.lognormal(0.0, spec.output_sigma, n)), 1.0)
    width = len(str(n - 1))
    unkeyed_rate = spec.total_rate * spec.unkeyed_share
    return KeyStats(
        names=tuple(f"{spec.name_prefix}{i:0{width}d}" for i in range(n)),
        rate=rate,
        prompt_tokens=prompt,
        prefix_tokens=prefix,
        output_tokens=output,
        unkeyed=UnkeyedTraffic(
            rate=unkeyed_rate, prompt_tokens=spec.median_prompt_tokens, output_tokens=spec.median_output_tokens
        ),
    )
