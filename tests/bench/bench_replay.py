"""Shadow-replay benchmarks: capacity of every routing policy, KV hit, and replay speed.

Run: `.venv/bin/python tests/bench/bench_replay.py [--quick]` (writes bench-results/replay.json).

1. `cacheroute-paper` workload (the report's statistics), 30 destinations: capacity (max QPS with
   p99 TTFT <= 3.5 s, bisection on the time-scaled trace) and served KV hit of every policy.
   Targets: CacheRoute >= 2.0x p2c, >= 1.3x the best per-request cache-aware baseline
   (prefix-tree, gie-prefix, preble), served KV hit >= 90 %. `cacheroute-p2c` (unplanned keys on
   random p2c, as the report does) is measured alongside to show what key-seeded p2c adds.
2. Every Mooncake trace in the shared traces folder, 8 destinations, key = first 4 blocks:
   CacheRoute capacity >= the best baseline's (issue 17; it was best - 5 %). Their SLO is twice
   the p99 TTFT of an almost idle fleet: their longest prompts alone take more than 3.5 s to
   prefill.
3. `low-reuse` workload, 30 destinations: CacheRoute with the guard (p2c for a period whenever
   the guard predicts no gain) >= 0.97x p2c; CacheRoute without the guard for comparison.
4. Speed: 1,000,000 requests over 30 destinations, p2c, median of 3 runs of process CPU time
   (target <= 60 s), with a pure-Python reference loop timed in the same run to show how fast
   the machine was.

`--quick` replays the first 15 minutes of the generated workloads instead of the full hour (the
same requests, fewer of them) and keeps everything else. `--jobs N` searches N policies' capacities
at once in forked worker processes (default: one per CPU); the speed figures are always measured
alone, one run at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheroute.planner.mooncake import read_mooncake
from cacheroute.planner.replay.capacity import CapacityResult, base_qps, find_capacity, replay_at
from cacheroute.planner.replay.registry import BASELINES, CACHE_AWARE, make_policy
from cacheroute.planner.replay.run import ReplayConfig, replay_trace
from cacheroute.planner.trace import RequestTrace
from cacheroute.planner.workloads import generate, preset

OUT = Path("bench-results") / "replay.json"
TRACES = Path(os.environ.get("CACHEROUTE_TRACES_DIR", Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"))
SLO = 3.5
PAPER_DESTINATIONS = 30
TRACE_DESTINATIONS = 8
QUICK_WINDOW_S = 900.0
# CacheRoute with unplanned keys on random p2c, as the report routes them: what key-seeded p2c adds.
ABLATION = "cacheroute-p2c"
SPEED_REQUESTS = 1_000_000
SPEED_QPS = 45.0


def log(msg: str) -> None:
    print(msg, flush=True)


JOBS = os.cpu_count() or 1
# The trace the forked workers search on: inherited through fork, never pickled.
_SHARED: dict[str, Any] = {}


def _capacity_job(policy: str) -> tuple[CapacityResult, float]:
    trace, destinations, slo = _SHARED["trace"], _SHARED["destinations"], _SHARED["slo"]
    t0 = time.perf_counter()
    res = find_capacity(trace, lambda: make_policy(policy), ReplayConfig(destinations=destinations), slo_p99_ttft_s=slo)
    return res, time.perf_counter() - t0


def capacities(trace: RequestTrace, policies: Sequence[str], destinations: int,
               slo: float = SLO) -> dict[str, dict[str, Any]]:
    """Capacity search of every policy, `--jobs` at a time; results in the order of `policies`."""
    _SHARED.update(trace=trace, destinations=destinations, slo=slo)
    found: dict[str, tuple[CapacityResult, float]] = {}
    jobs = int(_SHARED.get("jobs", JOBS))
    if jobs > 1 and len(policies) > 1:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(min(jobs, len(policies))) as pool:
            for policy, out in zip(policies, pool.imap(_capacity_job, policies), strict=True):
                found[policy] = out
                _log_capacity(policy, *out)
    else:
        for policy in policies:
            found[policy] = _capacity_job(policy)
            _log_capacity(policy, *found[policy])
    return {p: summary(*found[p]) for p in policies}


def _log_capacity(policy: str, res: CapacityResult, wall: float) -> None:
    hit = res.best.kv_hit if res.best is not None else float("nan")
    log(f"  {policy:<17} capacity {res.qps:7.1f} QPS  KV hit {hit:6.1%}  ({len(res.probes)} probes, {wall:.0f}s)")


def summary(res: CapacityResult, wall: float) -> dict[str, Any]:
    b = res.best
    return {
        "capacity_qps": res.qps,
        "kv_hit": b.kv_hit if b else None,
        "ttft_p50_s": b.ttft_p50_s if b else None,
        "ttft_p99_s": b.ttft_p99_s if b else None,
        "e2e_p99_s": b.e2e_p99_s if b else None,
        "load_cv_busy": b.load_cv_busy if b else None,
        "load_cv_tokens": b.load_cv_tokens if b else None,
        "probes": [(p.qps, p.ttft_p99_s, p.passed) for p in res.probes],
        "search_wall_s": wall,
    }


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def workload_trace(name: str, quick: bool) -> tuple[RequestTrace, dict[str, Any]]:
    w = generate(preset(name))
    stats = w.stats().to_dict()
    tr = w.trace
    if quick:
        start = float(tr.arrival_s[0])
        tr = tr.window(start, start + QUICK_WINDOW_S)
    return tr, stats


def bench_paper(quick: bool) -> dict[str, Any]:
    tr, stats = workload_trace("cacheroute-paper", quick)
    log(f"[1] cacheroute-paper: {len(tr):,} requests, {PAPER_DESTINATIONS} destinations")
    results = capacities(tr, (*BASELINES, "cacheroute", ABLATION), PAPER_DESTINATIONS)
    cr = results["cacheroute"]["capacity_qps"]
    p2c = results["p2c"]["capacity_qps"]
    best_aware = max(CACHE_AWARE, key=lambda n: results[n]["capacity_qps"])
    best_base = max(BASELINES, key=lambda n: results[n]["capacity_qps"])
    hit = results["cacheroute"]["kv_hit"] or 0.0
    checks: dict[str, dict[str, Any]] = {
        "vs_p2c": {"ratio": ratio(cr, p2c), "target": 2.0},
        "vs_best_cache_aware": {"baseline": best_aware, "ratio": ratio(cr, results[best_aware]["capacity_qps"]),
                                "target": 1.3},
        "kv_hit": {"value": hit, "target": 0.90},
        # Issue 17: every per-request baseline counts, key-seeded p2c included.
        "vs_best_baseline": {"baseline": best_base, "ratio": ratio(cr, results[best_base]["capacity_qps"]),
                             "target": 1.3},
        "key_seeded_p2c_gain": {"ratio": ratio(cr, results[ABLATION]["capacity_qps"])},
    }
    for c in checks.values():
        if "target" in c:
            v = c.get("ratio", c.get("value"))
            c["met"] = bool(v is not None and not math.isnan(v) and v >= c["target"])
    log(f"    CacheRoute / p2c = {checks['vs_p2c']['ratio']:.2f} (target 2.0), / {best_aware} = "
        f"{checks['vs_best_cache_aware']['ratio']:.2f} (target 1.3), KV hit {hit:.1%} (target 90%)")
    return {"requests": len(tr), "destinations": PAPER_DESTINATIONS, "workload_stats": stats,
            "policies": results, "checks": checks}


def bench_traces() -> dict[str, Any]:
    out: dict[str, Any] = {}
    files = sorted(TRACES.glob("*.jsonl"))
    log(f"[2] {len(files)} Mooncake traces, {TRACE_DESTINATIONS} destinations, key first-blocks:4")
    for path in files:
        tr = read_mooncake(path, key="first-blocks:4")
        # Their longest prompts take longer than 3.5 s to prefill on an idle 70B TP=2 replica
        # (p99 prompt 66k-85k tokens), so a 3.5 s p99 is out of reach for any router: the SLO of a
        # trace is twice the p99 TTFT of an almost idle fleet (2 % of the trace's own rate).
        idle = replay_at(tr, 0.02 * base_qps(tr), make_policy("p2c"), ReplayConfig(destinations=TRACE_DESTINATIONS))
        slo = 2.0 * idle.ttft_p99_s
        log(f" {path.name}: {len(tr):,} requests; idle p99 TTFT {idle.ttft_p99_s:.2f}s -> SLO {slo:.2f}s")
        results = capacities(tr, (*BASELINES, "cacheroute", ABLATION), TRACE_DESTINATIONS, slo)
        best = max(BASELINES, key=lambda n: results[n]["capacity_qps"])
        cr = results["cacheroute"]["capacity_qps"]
        # Issue 17: never below the best baseline.
        need = results[best]["capacity_qps"]
        out[path.name] = {
            "requests": len(tr), "slo_p99_ttft_s": slo, "idle_ttft_p99_s": idle.ttft_p99_s, "policies": results,
            "check": {"best_baseline": best, "cacheroute_qps": cr, "required_qps": need, "met": cr >= need,
                      "ratio": ratio(cr, results[best]["capacity_qps"]),
                      "key_seeded_p2c_gain": ratio(cr, results[ABLATION]["capacity_qps"])},
        }
        log(f"    CacheRoute {cr:.2f} vs best baseline {best} {results[best]['capacity_qps']:.2f} "
            f"(needs >= {need:.2f}): {'met' if cr >= need else 'NOT met'}")
    return out


def bench_low_reuse(quick: bool) -> dict[str, Any]:
    tr, stats = workload_trace("low-reuse", quick)
    log(f"[3] low-reuse: {len(tr):,} requests, {PAPER_DESTINATIONS} destinations "
        f"(ideal reuse {stats['ideal_token_reuse']:.1%})")
    results = capacities(tr, ("p2c", "cacheroute", "cacheroute-guard"), PAPER_DESTINATIONS)
    p2c = results["p2c"]["capacity_qps"]
    g = results["cacheroute-guard"]["capacity_qps"]
    check = {"ratio": ratio(g, p2c), "target": 0.97, "met": ratio(g, p2c) >= 0.97}
    log(f"    guarded CacheRoute / p2c = {check['ratio']:.3f} (target 0.97); unguarded "
        f"{ratio(results['cacheroute']['capacity_qps'], p2c):.3f}")
    return {"requests": len(tr), "workload_stats": stats, "policies": results, "check": check}


def reference_loop_ns() -> float:
    """Time of one `x in set` step of a plain Python loop: how fast this machine is right now."""
    s = set(range(1000))
    data = list(range(2000)) * 250
    t0 = time.process_time()
    for x in data:
        _ = x in s
    return (time.process_time() - t0) / len(data) * 1e9


def bench_speed() -> dict[str, Any]:
    spec = preset("cacheroute-paper", duration_s=SPEED_REQUESTS / 200.0 * 1.001)
    tr = generate(spec).trace
    tr = tr.window(float(tr.arrival_s[0]), float(tr.arrival_s[min(SPEED_REQUESTS, len(tr) - 1)]))
    n = len(tr)
    log(f"[4] speed: {n:,} requests, {PAPER_DESTINATIONS} destinations, p2c at {SPEED_QPS:g} QPS")
    scaled = tr.time_scaled(SPEED_QPS / (n / tr.duration_s))
    runs = []
    refs = []
    for _ in range(3):
        refs.append(reference_loop_ns())
        t0 = time.process_time()
        w0 = time.perf_counter()
        replay_trace(scaled, make_policy("p2c"), ReplayConfig(destinations=PAPER_DESTINATIONS))
        runs.append({"cpu_s": time.process_time() - t0, "wall_s": time.perf_counter() - w0})
        log(f"    run: {runs[-1]['cpu_s']:.1f}s CPU, {runs[-1]['wall_s']:.1f}s wall")
    med = statistics.median(r["cpu_s"] for r in runs)
    ref = statistics.median(refs)
    log(f"    median {med:.1f}s CPU for {n:,} requests ({med / n * 1e6:.1f} us/request; target <= 60 s); "
        f"reference loop {ref:.0f} ns/step")
    return {"requests": n, "policy": "p2c", "qps": SPEED_QPS, "runs": runs, "median_cpu_s": med,
            "us_per_request": med / n * 1e6, "target_s": 60.0, "met": med <= 60.0 * n / SPEED_REQUESTS,
            "reference_loop_ns": ref}


def clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first 15 minutes of the generated workloads")
    ap.add_argument("--only", choices=("paper", "traces", "low-reuse", "speed"), action="append",
                    help="run only these parts (repeatable)")
    ap.add_argument("--jobs", type=int, default=JOBS, help="capacity searches run at once (default: CPUs)")
    args = ap.parse_args(argv)
    _SHARED["jobs"] = max(1, args.jobs)
    parts = set(args.only or ("paper", "traces", "low-reuse", "speed"))
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "bench": "replay", "quick": args.quick, "jobs": _SHARED["jobs"], "slo_p99_ttft_s": SLO,
        "python": sys.version.split()[0],
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if "paper" in parts:
        report["cacheroute_paper"] = bench_paper(args.quick)
    if "traces" in parts:
        report["traces"] = bench_traces()
    if "low-reuse" in parts:
        report["low_reuse"] = bench_low_reuse(args.quick)
    if "speed" in parts:
        report["speed"] = bench_speed()
    report["wall_s"] = time.perf_counter() - t0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(clean(report), indent=2) + "\n", encoding="utf-8")
    log(f"wrote {OUT} ({report['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
