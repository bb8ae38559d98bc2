"""Load estimation: what each key costs a destination, and how many destinations it needs.

Load is measured in *destination-seconds per second*: the busy share of a destination of weight
1 (1.0 means one such destination fully busy). A destination of weight w serves w of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class CostModel:
    """Work a request puts on one destination of weight 1, in seconds.

    The defaults describe a Llama-3.3-70B FP8 replica on two H100s (TP=2) at the batch sizes a
    loaded replica runs:
    - `prefill_s_per_token` 1.4e-4: ~7,000 prompt tokens/s (2 x 70e9 FLOP per token against about
      1e15 usable FLOP/s of FP8 on two GPUs);
    - `decode_s_per_token` 4.0e-4: ~2,500 output tokens/s (a 64-sequence batch at ~25 ms a step);
    - `request_overhead_s` 0: scheduling and sampling overhead per request, negligible next to
      the above for long prompts.
    Calibrate them per model and GPU; placement only depends on their ratios, replication also on
    their scale (it compares a key's load with `max_key_share_of_destination`).
    """

    prefill_s_per_token: float = 1.4e-4
    decode_s_per_token: float = 4.0e-4
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_token", "request_overhead_s"):
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
