"""Figures a replay is judged by."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from cacheroute.planner.replay.run import ReplayResult


def _pct(x: npt.NDArray[np.float64], q: float) -> float:
    if not len(x):
        return float("nan")
    if bool(np.isfinite(x).all()):
        return float(np.percentile(x, q))
    # Unfinished requests count as infinitely late; interpolating next to inf gives NaN.
    return float(np.percentile(x, q, method="higher"))


def _cv(x: npt.NDArray[np.float64]) -> float:
    m = float(np.mean(x)) if len(x) else 0.0
    return float(np.std(x) / m) if m > 0 else 0.0


@dataclass(frozen=True)
class ReplayMetrics:
    """Summary of one replay over its measured requests (after warm-up).

    `kv_hit` is the served token-weighted KV hit: prompt tokens served from the prefix cache over
    all prompt tokens. `load_cv_busy` / `load_cv_tokens`: coefficient of variation across
    destinations of busy time and of processed tokens. Latencies are in seconds. In an aborted
    replay (stopped once its p99 TTFT could only exceed the limit) unfinished requests count as
    infinitely late, so the percentiles are lower bounds or infinite.
    """

    policy: str
    requests: int
    measured: int
    qps: float
    kv_hit: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    queue_p99_s: float
    load_cv_busy: float
    load_cv_tokens: float
    aborted: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(result: ReplayResult) -> ReplayMetrics:
    m = result.measured
    n = len(result.arrival_s)
    duration = float(result.arrival_s[-1] - result.arrival_s[0]) if n > 1 else 0.0
    ttft = np.nan_to_num(result.ttft_s[m], nan=np.inf)
    e2e = np.nan_to_num(result.e2e_s[m], nan=np.inf)
    queue = np.nan_to_num(result.queue_s[m], nan=np.inf)
    served = m & ~np.isnan(result.start_s)
    prompt = int(result.input_tokens[served].sum())
    hit = int(result.hit_tokens[served].sum())
    return ReplayMetrics(
        policy=result.policy,
        requests=n,
        measured=int(m.sum()),
        qps=n / duration if duration > 0 else float("nan"),
        kv_hit=hit / prompt if prompt else 0.0,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p99_s=_pct(ttft, 99),
        ttft_mean_s=float(np.mean(ttft)) if len(ttft) else float("nan"),
        e2e_p50_s=_pct(e2e, 50),
        e2e_p99_s=_pct(e2e, 99),
        queue_p99_s=_pct(queue, 99),
        load_cv_busy=_cv(result.busy_s),
        load_cv_tokens=_cv(result.processed_tokens.astype(np.float64)),
        aborted=result.aborted,
    )
