"""Planning time, memory, and the gain over a pure-Python implementation of the same algorithm.

Cases (synthetic statistics from `tests.support.synthetic_stats`, top 4% of keys carry 47%
of requests; destinations of 450,000 KV tokens, warm budget `auto` = 60% of it):

- paper: 128,824 keys onto 30 destinations (target <= 50 ms on one core);
- replan: the same after rates drift by up to 5% and one destination disappears, against the
  previous plan (the steady state of the operator);
- large: 1,000,000 keys onto 256 destinations (target <= 1 s, <= 500 MB peak, measured in a
  subprocess with tracemalloc and getrusage);
- large-admit-most: the same keys with a warm budget that admits nearly every key, so placement
  handles ~10^6 items;
- trace: `key_stats_from_trace` over a 1,000,000-request trace (the Mooncake conversation trace
  tiled with disjoint block ids), target ~1 s.

The baseline is a straightforward pure-Python implementation of the same steps (per-key loops,
a sorted candidate list, one-key-at-a-time greedy admission, LPT with a heap for every replica,
a dict of routes and `plan_from_routes`), timed in the same run on the paper case.
Medians over RUNS runs; wall time and process CPU time. Writes bench-results/planner.json.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cacheroute.planner.keystats import KeyStats, key_stats_from_trace
from cacheroute.planner.load import CostModel
from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import encode_plan
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.settings import Budget
from cacheroute.planner.trace import NO_KEY, RequestTrace
from tests.support.synthetic_stats import SyntheticStatsSpec, synthetic_key_stats

RUNS = 7
KV_TOKENS = 450_000
TARGET_PAPER_S = 0.050
TARGET_LARGE_S = 1.0
TARGET_LARGE_MB = 500.0
TARGET_TRACE_S = 1.0
REPO = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("CACHEROUTE_TRACES_DIR", REPO / ".." / "shared" / "traces"))


def fleet(m: int, kv: int = KV_TOKENS) -> list[Destination]:
    return [Destination(f"llama-{i}", f"10.{i // 250}.{i % 250}.1:8000", 1.0, kv) for i in range(m)]


def spec(keys: int, m: int) -> SyntheticStatsSpec:
    # 176 req/s on 30 destinations (the report's capacity), scaled with the fleet.
    return SyntheticStatsSpec(keys=keys, total_rate=176.0 * m / 30, median_prompt_tokens=1_200.0, seed=0)


def timed(fn: Callable[[], object], runs: int = RUNS) -> dict[str, float]:
    walls, cpus = [], []
    for _ in range(runs):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
    return {
        "runs": runs,
        "wall_median_s": statistics.median(walls),
        "wall_min_s": min(walls),
        "cpu_median_s": statistics.median(cpus),
    }


# --- The same algorithm in plain Python (no previous plan, no pinned routes). ---


def reference_plan(stats: KeyStats, dests: list[Destination], budget: Budget, cost: CostModel) -> dict[str, Any]:
    names = stats.names
    rate = stats.rate.tolist()
    prompt = stats.prompt_tokens.tolist()
    prefix = stats.prefix_tokens.tolist()
    output = stats.output_tokens.tolist()
    m = len(dests)
    weights = [d.weight for d in dests]
    if budget.warm_tokens_per_destination == "auto":
        warm = [math.floor(d.kv_capacity_tokens * budget.auto_fraction) for d in dests]
    else:
        warm = [budget.warm_tokens_per_destination] * m
    cap = min(budget.max_destinations_per_key, m)
    per_dest = budget.max_key_share_of_destination * min(weights)
    load, reps, cold = [], [], []
    for i in range(len(names)):
        fresh = max(prompt[i] - prefix[i], 0.0)
        load.append(
            rate[i] * (cost.request_overhead_s + cost.prefill_s_per_token * fresh + cost.decode_s_per_token * output[i])
        )
        cold.append(
            rate[i]
            * (cost.request_overhead_s + cost.prefill_s_per_token * prompt[i] + cost.decode_s_per_token * output[i])
        )
        reps.append(min(max(math.ceil(load[i] / per_dest - 1e-12), 1), cap))
    rooms_desc = sorted(warm, reverse=True)
    cands = [
        i
        for i in range(len(names))
        if rate[i] > 0 and prefix[i] > 0 and reps[i] <= m and prefix[i] <= rooms_desc[reps[i] - 1]
    ]
    cands.sort(key=lambda i: (-rate[i] / reps[i], i))
    left = float(sum(warm))
    admitted = []
    for i in cands:
        c = prefix[i] * reps[i]
        if c <= left:
            admitted.append(i)
            left -= c
    # LPT: every replica, heaviest first, onto the least-loaded destination with room.
    items = sorted(((load[i] / reps[i], i) for i in admitted for _ in range(reps[i])), key=lambda t: (-t[0], t[1]))
    loads = [0.0] * m
    room = [float(w) for w in warm]
    heap = [(0.0, d) for d in range(m)]
    dest_of: dict[int, list[int]] = {}
    for p, i in items:
        used = dest_of.setdefault(i, [])
        aside = []
        chosen = -1
        while heap:
            lv, d = heapq.heappop(heap)
            if lv != loads[d] / weights[d]:
                continue
            if room[d] >= prefix[i] and d not in used:
                chosen = d
                break
            aside.append((lv, d))
        for e in aside:
            heapq.heappush(heap, e)
        if chosen < 0:
            continue
        loads[chosen] += p
        room[chosen] -= prefix[i]
        used.append(chosen)
        heapq.heappush(heap, (loads[chosen] / weights[chosen], chosen))
    routed = {i for i, ds in dest_of.items() if len(ds) == reps[i]}
    spread = sum(cold) - sum(cold[i] for i in routed)
    spread += stats.unkeyed.rate * (
        cost.request_overhead_s
        + cost.prefill_s_per_token * stats.unkeyed.prompt_tokens
        + cost.decode_s_per_token * stats.unkeyed.output_tokens
    )
    # Water-filling of the p2c traffic, lowest levels first.
    levels = sorted((loads[d] / weights[d], d) for d in range(m))
    filled_w = 0.0
    filled_wl = 0.0
    lam = levels[0][0]
    for k, (lv, d) in enumerate(levels):
        if lv * filled_w - filled_wl > spread and k:
            break
        filled_w += weights[d]
        filled_wl += weights[d] * lv
        lam = (spread + filled_wl) / filled_w
    objective = max(*(loads[d] / weights[d] for d in range(m)), lam)
    routes = {affinity_key_hash(names[i]): [dests[d].id for d in dest_of[i]] for i in sorted(routed)}
    plan = plan_from_routes("llama", dests, routes)
    return {"plan": plan, "admitted": sorted(admitted), "routed": sorted(routed), "objective": objective}


# --- Trace helpers. ---


def tiled_trace(copies: int) -> RequestTrace | None:
    path = TRACES / "mooncake_conversation_trace.jsonl"
    if not path.is_file():
        return None
    from cacheroute.planner.mooncake import read_mooncake

    t = read_mooncake(path, key="first-blocks:4")
    n, nk = len(t), len(t.key_names)
    span = t.duration_s + 1.0
    top = int(t.block_ids.max()) + 1
    lens = np.diff(t.block_offsets)
    offs = np.zeros(n * copies + 1, dtype=np.int64)
    np.cumsum(np.tile(lens, copies), out=offs[1:])
    return RequestTrace(
        arrival_s=np.concatenate([t.arrival_s + c * span for c in range(copies)]),
        key=np.concatenate([np.where(t.key >= 0, t.key + c * nk, NO_KEY) for c in range(copies)]),
        input_tokens=np.tile(t.input_tokens, copies),
        output_tokens=np.tile(t.output_tokens, copies),
        block_offsets=offs,
        block_ids=np.concatenate([t.block_ids + c * top for c in range(copies)]),
        block_size=t.block_size,
        key_names=tuple(f"{k}#{c}" for c in range(copies) for k in t.key_names),
        name=f"conversation x{copies}",
    )


# --- Memory probe (runs in a fresh subprocess). ---


def probe_memory(keys: int, m: int) -> dict[str, float]:
    stats = synthetic_key_stats(spec(keys, m))
    dests = fleet(m)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tracemalloc.start()
    compute_plan(stats, dests, pool="llama")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "planner_peak_traced_mb": peak / 2**20,
        "process_max_rss_mb": rss_after,
        "process_max_rss_before_planning_mb": rss_before,
    }


def drifted(stats: KeyStats, seed: int = 1) -> KeyStats:
    rng = np.random.default_rng(seed)
    return KeyStats(
        stats.names,
        stats.rate * rng.uniform(0.95, 1.05, len(stats)),
        stats.prompt_tokens,
        stats.prefix_tokens,
        stats.output_tokens,
        stats.unkeyed,
    )


def main() -> None:
    out: dict[str, Any] = {"machine_cpus": os.cpu_count()}
    cost = CostModel()

    # Paper scale.
    stats = synthetic_key_stats(spec(128_824, 30))
    rates = np.sort(stats.rate)[::-1]
    top_share = float(rates[: math.ceil(0.04 * len(rates))].sum() / rates.sum())
    dests = fleet(30)
    result = compute_plan(stats, dests, pool="llama")
    paper = timed(lambda: compute_plan(stats, dests, pool="llama"))
    ref = reference_plan(stats, dests, Budget(), cost)
    base = timed(lambda: reference_plan(stats, dests, Budget(), cost), runs=5)
    agree = ref["admitted"] == np.flatnonzero(result.admitted).tolist()
    agree_routed = ref["routed"] == np.flatnonzero(result.routed).tolist()
    out["paper"] = {
        "keys": len(stats),
        "destinations": 30,
        "top4pct_request_share": top_share,
        "routed_keys": len(result.plan),
        "objective": result.objective,
        "lower_bound": result.lower_bound,
        **paper,
        "target_s": TARGET_PAPER_S,
    }
    out["baseline_pure_python"] = {
        **base,
        "routed_keys": len(ref["plan"]),
        "objective": ref["objective"],
        "same_admitted_keys": agree,
        "same_routed_keys": agree_routed,
        "speedup_wall_median": base["wall_median_s"] / paper["wall_median_s"],
    }
    print(f"paper: {len(stats):,} keys (top 4% carry {100 * top_share:.1f}% of requests) onto 30 destinations")
    print(
        f"  vectorised: median {1e3 * paper['wall_median_s']:.1f} ms wall, {1e3 * paper['cpu_median_s']:.1f} ms CPU "
        f"(target {1e3 * TARGET_PAPER_S:.0f} ms); {len(result.plan):,} routed keys, max load {result.objective:.3f} "
        f"(lower bound {result.lower_bound:.3f})"
    )
    print(
        f"  pure Python: median {1e3 * base['wall_median_s']:.0f} ms wall; max load {ref['objective']:.3f}; "
        f"same admitted keys: {agree}, same routed keys: {agree_routed}; "
        f"speed-up x{out['baseline_pure_python']['speedup_wall_median']:.1f}"
    )

    # Re-plan against the previous plan: drift and a lost destination.
    moved_stats = drifted(stats)
    survivors = dests[:29]
    replan_result = compute_plan(moved_stats, survivors, pool="llama", previous=result.plan)
    replan = timed(lambda: compute_plan(moved_stats, survivors, pool="llama", previous=result.plan))
    out["replan"] = {
        **replan,
        "churn": replan_result.churn,
        "churn_forced": replan_result.churn_forced,
        "kept_previous": replan_result.kept_previous,
    }
    print(
        f"replan (rates +-5%, 1 of 30 destinations gone): median {1e3 * replan['wall_median_s']:.1f} ms wall, "
        f"{1e3 * replan['cpu_median_s']:.1f} ms CPU; "
        f"churn {100 * replan_result.churn:.1f}% (forced {100 * replan_result.churn_forced:.1f}%)"
    )

    # 1M keys onto 256 destinations.
    big = synthetic_key_stats(spec(1_000_000, 256))
    dests256 = fleet(256)
    big_result = compute_plan(big, dests256, pool="llama")
    large = timed(lambda: compute_plan(big, dests256, pool="llama"), runs=5)
    payload = encode_plan(big_result.plan)
    enc = timed(lambda: encode_plan(big_result.plan), runs=3)
    # As a module from the repository root, like `make bench`, so that `tests.support` imports.
    probe = subprocess.run(
        [sys.executable, "-m", "tests.bench.bench_planner", "--probe", "1000000", "256"],
        check=True, capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    memory = json.loads(probe.stdout.strip().splitlines()[-1])
    out["large"] = {
        "keys": len(big),
        "destinations": 256,
        "routed_keys": len(big_result.plan),
        **large,
        "target_s": TARGET_LARGE_S,
        **memory,
        "target_mb": TARGET_LARGE_MB,
        "encode_wall_median_s": enc["wall_median_s"],
        "payload_bytes": payload.total_bytes,
        "configmaps": len(payload.configmaps),
    }
    print(
        f"large: 1,000,000 keys onto 256 destinations: median {1e3 * large['wall_median_s']:.0f} ms wall, "
        f"{1e3 * large['cpu_median_s']:.0f} ms CPU (target {1e3 * TARGET_LARGE_S:.0f} ms); "
        f"{len(big_result.plan):,} routed keys"
    )
    print(
        f"  memory: planner peak {memory['planner_peak_traced_mb']:.0f} MB (tracemalloc), process max RSS "
        f"{memory['process_max_rss_mb']:.0f} MB of which {memory['process_max_rss_before_planning_mb']:.0f} MB before "
        f"planning (target {TARGET_LARGE_MB:.0f} MB)"
    )
    print(
        f"  encode_plan: {1e3 * enc['wall_median_s']:.0f} ms, {payload.total_bytes:,} bytes in "
        f"{len(payload.configmaps)} ConfigMap(s)"
    )

    # Nearly every key admitted (KV capacity unknown, a fixed budget that never binds): ~10^6 replicas.
    generous = Budget(warm_tokens_per_destination=10**9)
    unbounded = fleet(256, kv=0)
    most = compute_plan(big, unbounded, pool="llama", budget=generous)
    most_t = timed(lambda: compute_plan(big, unbounded, pool="llama", budget=generous), runs=3)
    out["large_admit_most"] = {
        **most_t,
        "routed_keys": len(most.plan),
        "objective": most.objective,
        "lower_bound": most.lower_bound,
    }
    print(
        f"large, budget admitting most keys: {len(most.plan):,} routed keys in median "
        f"{1e3 * most_t['wall_median_s']:.0f} ms wall, {1e3 * most_t['cpu_median_s']:.0f} ms CPU; "
        f"max load {most.objective:.4f} (lower bound {most.lower_bound:.4f})"
    )

    # Per-key statistics from a 1M-request trace.
    trace = tiled_trace(84)
    if trace is None:
        print(f"trace: skipped ({TRACES} has no mooncake_conversation_trace.jsonl)")
    else:
        ks = timed(lambda: key_stats_from_trace(trace), runs=3)
        keys_seen = len(key_stats_from_trace(trace))
        out["trace_stats"] = {
            "requests": len(trace),
            "blocks": len(trace.block_ids),
            "keys": keys_seen,
            **ks,
            "target_s": TARGET_TRACE_S,
        }
        print(
            f"trace: key_stats_from_trace over {len(trace):,} requests ({len(trace.block_ids):,} blocks, "
            f"{keys_seen:,} keys): median {ks['wall_median_s']:.2f} s wall, {ks['cpu_median_s']:.2f} s CPU "
            f"(target ~{TARGET_TRACE_S:.0f} s)"
        )

    target = REPO / "bench-results" / "planner.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--probe":
        print(json.dumps(probe_memory(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        main()
