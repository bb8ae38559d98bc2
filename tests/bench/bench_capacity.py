"""Capacity benchmarks of issue 17: CacheRoute against per-request routers, where the gain comes
from, and the whole product against a default vLLM deployment.

Run: `.venv/bin/python -m tests.bench.bench_capacity [--quick] [--jobs N] [--only a,b] [--rel-tol F]`
(writes bench-results/capacity.json after every section, and its figures `capacity.png` and
`capacity_probes.png` beside it, `capacity_plots.py`). Capacity is the highest QPS with p99 TTFT
within the SLO (bisection on the time-scaled trace, `replay/capacity.py`, to within `--rel-tol`,
3 % unless told: a ratio closer than that to its target is not resolved, so pass 0.01 to decide
one); every ratio compares policies measured in the same run.

1. `paper`: the `cacheroute-paper` workload, 30 destinations, p99 TTFT <= 3.5 s, the same engine
   for every policy (the replay's default profile: Llama-3.3-70B FP8, TP=2, bf16 KV, no host
   tier). CacheRoute against the best per-request baseline (target 1.3x), key-seeded p2c among
   them.
2. `ablation`: on the same workload, CacheRoute with load in requests or token-aware, with or
   without its memory of routed prefixes, on an engine without or with the host-memory KV tier the
   memory plan sizes (`auto` on a 2 TiB, 8-GPU node): each component alone and together; the best
   per-request baselines on the host-tier engine alongside, so the host tier's gain is not
   credited to routing.
3. `product`: the operator's configuration (memory plan of the pool: fp8 KV as the pool asks, host
   tier auto, the chosen max-num-batched-tokens, `--kv-cache-memory-bytes` from the plan) with
   CacheRoute, against vLLM's defaults (`--gpu-memory-utilization 0.9`,
   `--max-num-batched-tokens 8192`, bf16 KV, no host tier) with p2c (target 2.3x, served KV hit
   >= 80 %); the bf16-KV operator configuration, and p2c and Preble on the operator's engine, too;
   and the ceiling of any router on the operator's engine: CacheRoute with one ideal cache shared
   by every destination (every prefix computed anywhere hits), so only balance is left to routing.
4. `mnbt`: served capacity of the operator's engine at each max-num-batched-tokens candidate, with
   the KV capacity the memory plan leaves at that value (issue 17 item 4).
5. `bound`: the ceilings of served KV hit on each of those engines, whatever the routing: one LRU
   cache as large as the whole fleet's KV, and Belady's MIN on it; and on the GPU-only engine,
   per-destination LRU caches under key-sticky routing and under a routing that knows which keys
   come back (`replay/bound.py`).
6. `traces`: every Mooncake trace of the shared folder, 8 destinations, key = first 4 blocks, SLO
   twice the p99 TTFT of an almost idle fleet (as `bench_replay.py`): CacheRoute against the best
   baseline (target 1.00x), and with its guard.
7. `low-reuse`: CacheRoute (and with the guard) against p2c (target 0.97x); the guarded policy
   against CacheRoute's routing without any plan.
8. `heldout`: workloads nobody chose, every parameter drawn from a seed (`workloads.sampled_spec`;
   `--heldout-seeds`, pass seeds never run before to check the method on workloads it was not
   tuned on), 8 destinations, SLO twice the p99 TTFT of an almost idle fleet under p2c:
   CacheRoute, with and without its guard, against the best per-request baseline (target 1.00x),
   and the guarded policy against CacheRoute's routing without any plan (what the guard degrades to).

`--quick` replays the first 15 minutes of the generated workloads (the public traces whole).
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
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cacheroute.operator.files import OutputPathError, check_output_dir, check_output_file, write_with
from cacheroute.planner.memory import plan_memory
from cacheroute.planner.memory.architecture import preset
from cacheroute.planner.memory.gpus import GIB, H100_80GB
from cacheroute.planner.memory.memory_plan import MemoryPlan
from cacheroute.planner.memory.request import DEFAULT_MNBT_CANDIDATES, PlanRequest
from cacheroute.planner.mooncake import read_mooncake
from cacheroute.planner.replay.bound import (
    key_sticky_routes,
    optimal_hit,
    oracle_admission_routes,
    routed_lru_hit,
    unified_lru_hit,
)
from cacheroute.planner.replay.capacity import DEFAULT_REL_TOL, CapacityResult, base_qps, find_capacity, replay_at
from cacheroute.planner.replay.hardware import (
    H100_80GB_GIB,
    H100_LLAMA33_70B_FP8_TP2,
    H100_LLAMA33_70B_FP8_TP2_FP8KV,
    LLAMA33_70B_FP8_WEIGHTS_GIB,
    LLAMA33_70B_TP2_KV_BYTES_BF16,
    LLAMA33_70B_TP2_RUNTIME_OVERHEAD_GIB,
    EngineProfile,
    kv_capacity_tokens,
)
from cacheroute.planner.replay.policy import Policy
from cacheroute.planner.replay.registry import make_policy
from cacheroute.planner.replay.run import ReplayConfig
from cacheroute.planner.trace import RequestTrace
from cacheroute.planner.workloads import generate, sampled_spec
from cacheroute.planner.workloads import preset as workload_preset

OUT = Path("bench-results") / "capacity.json"
TRACES = Path(os.environ.get("CACHEROUTE_TRACES_DIR", Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"))
SLO = 3.5
PAPER_DESTINATIONS = 30
TRACE_DESTINATIONS = 8
QUICK_WINDOW_S = 900.0
# An HGX H100 node: 8 GPUs, 2 TiB of memory (the memory plan's `auto` host tier takes a TP=2
# replica's quarter of it less a reserve per GPU).
NODE_MEMORY_BYTES = 2048 * GIB
# Per-request routers: no plan, decisions from the request and momentary state only.
PER_REQUEST = ("p2c", "key-p2c", "least-loaded", "chwbl", "prefix-tree", "gie-prefix", "preble")
# Scratch destinations of the oracle admission routing (`bench_routed_bound`).
ORACLE_SCRATCH = (3, 6, 10)
SECTIONS = ("paper", "ablation", "product", "mnbt", "bound", "traces", "low-reuse", "heldout")
HELDOUT_SEEDS = tuple(range(1, 13))


def log(msg: str) -> None:
    print(msg, flush=True)


# --- engines ---------------------------------------------------------------------------------------


def memory_plan(kv_cache_dtype: str, mnbt: int | None = None) -> MemoryPlan:
    """The operator's Analytic memory plan for the paper's pool (70B FP8, TP=2, H100, host tier auto)."""
    return plan_memory(PlanRequest(
        model=preset("llama-3.3-70b"), gpu=H100_80GB, quantization="fp8", tp=2,
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        mnbt=mnbt, host_kv="auto", node_memory_bytes=NODE_MEMORY_BYTES,
    ))


def operator_engine(kv_cache_dtype: str = "fp8", mnbt: int | None = None, host: bool = True) -> EngineProfile:
    """The replay engine of a pod the operator configures: timing of the KV dtype's profile, KV
    capacity, batch budget and host tier from the memory plan."""
    plan = memory_plan(kv_cache_dtype, mnbt)
    base = H100_LLAMA33_70B_FP8_TP2_FP8KV if kv_cache_dtype == "fp8" else H100_LLAMA33_70B_FP8_TP2
    return replace(
        base,
        name=f"operator-{kv_cache_dtype}-mnbt{plan.max_num_batched_tokens}{'-host' if host else ''}",
        kv_capacity_tokens=plan.kv_capacity_tokens,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        host_kv_capacity_tokens=plan.host_kv_capacity_tokens if host else 0,
    )


def vllm_default_engine() -> EngineProfile:
    """vLLM's defaults on the same GPUs: utilization 0.9, mnbt 8192, bf16 KV, no host tier."""
    kv = kv_capacity_tokens(
        gpu_memory_gib=H100_80GB_GIB, tensor_parallel=2, weights_gib=LLAMA33_70B_FP8_WEIGHTS_GIB,
        runtime_overhead_gib_per_gpu=LLAMA33_70B_TP2_RUNTIME_OVERHEAD_GIB,
        kv_bytes_per_token_per_gpu=LLAMA33_70B_TP2_KV_BYTES_BF16, gpu_memory_utilization=0.9,
    )
    return replace(H100_LLAMA33_70B_FP8_TP2, name="vllm-default", kv_capacity_tokens=kv, max_num_batched_tokens=8192)


def host_engine(base: EngineProfile = H100_LLAMA33_70B_FP8_TP2) -> EngineProfile:
    """`base` with the host tier the memory plan sizes for its KV dtype."""
    dtype = "fp8" if base.kv_bytes_per_token_per_gpu < LLAMA33_70B_TP2_KV_BYTES_BF16 else "auto"
    return replace(base, name=base.name + "-host", host_kv_capacity_tokens=memory_plan(dtype).host_kv_capacity_tokens)


# --- capacity searches -----------------------------------------------------------------------------

# (label, policy name, engine) of one search; the trace and SLO are inherited by forked workers.
Job = tuple[str, str, EngineProfile, int]
_SHARED: dict[str, Any] = {}


def _run(job: Job) -> tuple[CapacityResult, float]:
    _label, policy, engine, destinations = job
    trace, slo = _SHARED["trace"], _SHARED["slo"]
    # A guarded policy's guard holds plans to the objective measured here, as the operator's holds
    # them to the AffinityPlan's.
    factory: Callable[[], Policy] = lambda: make_policy(policy, slo_p99_ttft_s=slo)  # noqa: E731
    t0 = time.perf_counter()
    res = find_capacity(trace, factory, ReplayConfig(destinations=destinations, profile=engine), slo_p99_ttft_s=slo,
                        rel_tol=rel_tol())
    return res, time.perf_counter() - t0


def search(trace: RequestTrace, jobs: Sequence[Job], slo: float) -> dict[str, dict[str, Any]]:
    """Capacity of every job, `--jobs` at a time, keyed by label."""
    _SHARED.update(trace=trace, slo=slo)
    workers = int(_SHARED.get("jobs", 1))
    found: dict[str, dict[str, Any]] = {}

    def record(job: Job, out: tuple[CapacityResult, float]) -> None:
        res, wall = out
        b = res.best
        found[job[0]] = {
            "policy": job[1], "engine": job[2].name, "capacity_qps": res.qps,
            "kv_hit": b.kv_hit if b else None, "ttft_p99_s": b.ttft_p99_s if b else None,
            "ttft_p50_s": b.ttft_p50_s if b else None, "load_cv_busy": b.load_cv_busy if b else None,
            "probes": [(p.qps, p.ttft_p99_s, p.passed) for p in res.probes], "search_wall_s": wall,
        }
        hit = f"{b.kv_hit:6.1%}" if b else "   n/a"
        log(f"  {job[0]:<34} {res.qps:8.2f} QPS  served KV hit {hit}  ({len(res.probes)} probes, {wall:.0f}s)")

    if workers > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
            for job, out in zip(jobs, pool.imap(_run, jobs), strict=True):
                record(job, out)
    else:
        for job in jobs:
            record(job, _run(job))
    return {job[0]: found[job[0]] for job in jobs}


def rel_tol() -> float:
    """The bisection's step (`--rel-tol`): a capacity is the highest rate that passed, up to this
    fraction below the lowest that failed."""
    return float(_SHARED.get("rel_tol", DEFAULT_REL_TOL))


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def check(value: float, target: float, **extra: Any) -> dict[str, Any]:
    return {"value": value, "target": target, "met": bool(math.isfinite(value) and value >= target), **extra}


def workload(name: str, quick: bool) -> RequestTrace:
    tr = generate(workload_preset(name)).trace
    if quick:
        start = float(tr.arrival_s[0])
        tr = tr.window(start, start + QUICK_WINDOW_S)
    return tr


def best_of(results: dict[str, dict[str, Any]], labels: Sequence[str]) -> str:
    return max(labels, key=lambda n: results[n]["capacity_qps"])


# --- sections --------------------------------------------------------------------------------------


def bench_paper(trace: RequestTrace) -> dict[str, Any]:
    engine = H100_LLAMA33_70B_FP8_TP2
    log(f"[paper] {len(trace):,} requests, {PAPER_DESTINATIONS} destinations, engine {engine.name}")
    policies = (*PER_REQUEST, "cacheroute", "cacheroute-guard")
    res = search(trace, [(p, p, engine, PAPER_DESTINATIONS) for p in policies], SLO)
    best = best_of(res, PER_REQUEST)
    r = ratio(res["cacheroute"]["capacity_qps"], res[best]["capacity_qps"])
    log(f"    CacheRoute / best per-request ({best}) = {r:.3f} (target 1.3); with its guard "
        f"{ratio(res['cacheroute-guard']['capacity_qps'], res[best]['capacity_qps']):.3f}")
    return {"engine": engine.name, "slo_p99_ttft_s": SLO, "policies": res, "check": check(r, 1.3, baseline=best)}


def bench_ablation(trace: RequestTrace) -> dict[str, Any]:
    gpu = H100_LLAMA33_70B_FP8_TP2
    host = host_engine(gpu)
    log(f"[ablation] host tier {host.host_kv_capacity_tokens:,} tokens per destination "
        f"(GPU {gpu.kv_capacity_tokens:,})")
    jobs: list[Job] = [
        ("neither (load in requests, no prefix memory)", "cacheroute-before", gpu, PAPER_DESTINATIONS),
        ("token-aware load alone", "cacheroute-nofollow", gpu, PAPER_DESTINATIONS),
        ("prefix following alone", "cacheroute-requests", gpu, PAPER_DESTINATIONS),
        ("token-aware load + prefix following", "cacheroute", gpu, PAPER_DESTINATIONS),
        ("host tier alone", "cacheroute-before", host, PAPER_DESTINATIONS),
        ("host tier + token-aware load", "cacheroute-nofollow", host, PAPER_DESTINATIONS),
        ("all three", "cacheroute", host, PAPER_DESTINATIONS),
        ("p2c, host tier", "p2c", host, PAPER_DESTINATIONS),
        ("key-p2c, host tier", "key-p2c", host, PAPER_DESTINATIONS),
        ("preble, host tier", "preble", host, PAPER_DESTINATIONS),
    ]
    res = search(trace, jobs, SLO)
    base = res["neither (load in requests, no prefix memory)"]["capacity_qps"]
    best_host = best_of(res, ("p2c, host tier", "key-p2c, host tier", "preble, host tier"))
    ratios = {k: ratio(v["capacity_qps"], base) for k, v in res.items()}
    vs = ratio(res["all three"]["capacity_qps"], res[best_host]["capacity_qps"])
    log("    vs neither: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    log(f"    all three / best per-request on the host-tier engine ({best_host}) = {vs:.3f}")
    return {"engines": {"gpu": gpu.name, "host": host.name, "host_kv_capacity_tokens": host.host_kv_capacity_tokens},
            "policies": res, "ratio_vs_neither": ratios, "all_vs_best_per_request_host": vs,
            "best_per_request_host": best_host}


def bench_product(trace: RequestTrace) -> dict[str, Any]:
    default = vllm_default_engine()
    ours = operator_engine("fp8")
    ours_bf16 = operator_engine("auto")
    for e in (default, ours, ours_bf16):
        log(f"[product] engine {e.name}: KV {e.kv_capacity_tokens:,} tokens on GPU, {e.host_kv_capacity_tokens:,} "
            f"in host memory, mnbt {e.max_num_batched_tokens}")
    jobs: list[Job] = [
        ("vLLM defaults + p2c", "p2c", default, PAPER_DESTINATIONS),
        ("operator (fp8 KV) + CacheRoute", "cacheroute", ours, PAPER_DESTINATIONS),
        ("operator (bf16 KV) + CacheRoute", "cacheroute", ours_bf16, PAPER_DESTINATIONS),
        ("operator (fp8 KV) + p2c", "p2c", ours, PAPER_DESTINATIONS),
        ("operator (fp8 KV) + preble", "preble", ours, PAPER_DESTINATIONS),
        ("operator (fp8 KV) + CacheRoute with its guard", "cacheroute-guard", ours, PAPER_DESTINATIONS),
    ]
    res = search(trace, jobs, SLO)
    base = res["vLLM defaults + p2c"]["capacity_qps"]
    r = ratio(res["operator (fp8 KV) + CacheRoute"]["capacity_qps"], base)
    hit = res["operator (fp8 KV) + CacheRoute"]["kv_hit"] or 0.0
    log(f"    operator + CacheRoute / vLLM defaults + p2c = {r:.3f} (target 2.3), served KV hit {hit:.1%} (target 80%)")
    t0 = time.perf_counter()
    ideal = find_capacity(trace, lambda: make_policy("cacheroute"),
                          ReplayConfig(destinations=PAPER_DESTINATIONS, profile=ours, ideal_cache=True),
                          slo_p99_ttft_s=SLO, rel_tol=rel_tol())
    ceiling = ratio(ideal.qps, base)
    log(f"    ceiling: CacheRoute with one ideal cache on the operator's engine {ideal.qps:.2f} QPS "
        f"({ideal.best.kv_hit if ideal.best else 0.0:.1%} served), {ceiling:.3f}x vLLM defaults + p2c "
        f"({time.perf_counter() - t0:.0f}s)")
    return {"engines": {e.name: {"kv_capacity_tokens": e.kv_capacity_tokens, "host_kv_capacity_tokens":
                                 e.host_kv_capacity_tokens, "max_num_batched_tokens": e.max_num_batched_tokens}
                        for e in (default, ours, ours_bf16)},
            "policies": res, "check": check(r, 2.3), "kv_hit_check": check(hit, 0.80),
            "ideal_cache_ceiling": {"capacity_qps": ideal.qps, "ratio": ceiling,
                                    "kv_hit": ideal.best.kv_hit if ideal.best else None},
            "bf16_ratio": ratio(res["operator (bf16 KV) + CacheRoute"]["capacity_qps"], base)}


def bench_mnbt(trace: RequestTrace) -> dict[str, Any]:
    candidates = [m for m in DEFAULT_MNBT_CANDIDATES if m <= 8192]
    engines = {m: operator_engine("fp8", m) for m in candidates}
    for m, e in engines.items():
        log(f"[mnbt] {m}: KV {e.kv_capacity_tokens:,} tokens")
    res = search(trace, [(f"mnbt {m}", "cacheroute", e, PAPER_DESTINATIONS) for m, e in engines.items()], SLO)
    chosen = memory_plan("fp8").max_num_batched_tokens
    best = max(candidates, key=lambda m: res[f"mnbt {m}"]["capacity_qps"])
    return {"policies": res, "kv_capacity_tokens": {m: e.kv_capacity_tokens for m, e in engines.items()},
            "memory_plan_choice": chosen, "best_by_capacity": best}


def bench_traces() -> dict[str, Any]:
    out: dict[str, Any] = {}
    engine = H100_LLAMA33_70B_FP8_TP2
    for path in sorted(TRACES.glob("*.jsonl")):
        tr = read_mooncake(path, key="first-blocks:4")
        slo = idle_slo(tr, TRACE_DESTINATIONS, engine)
        log(f"[traces] {path.name}: {len(tr):,} requests, SLO {slo:.2f}s")
        res = search(tr, [(p, p, engine, TRACE_DESTINATIONS)
                          for p in (*PER_REQUEST, "cacheroute", "cacheroute-guard", "cacheroute-noscore")], slo)
        best = best_of(res, PER_REQUEST)
        r = ratio(res["cacheroute"]["capacity_qps"], res[best]["capacity_qps"])
        g = ratio(res["cacheroute-guard"]["capacity_qps"], res[best]["capacity_qps"])
        log(f"    CacheRoute / {best} = {r:.3f} (target 1.00); with its guard {g:.3f}")
        out[path.name] = {"slo_p99_ttft_s": slo, "policies": res, "check": check(r, 1.0, baseline=best),
                          "guard_ratio": g}
    return out


def bench_low_reuse(trace: RequestTrace) -> dict[str, Any]:
    engine = H100_LLAMA33_70B_FP8_TP2
    log(f"[low-reuse] {len(trace):,} requests, {PAPER_DESTINATIONS} destinations")
    res = search(trace, [(p, p, engine, PAPER_DESTINATIONS) for p in ("p2c", "key-p2c", "cacheroute",
                                                                         "cacheroute-guard", "cacheroute-noplan")],
                 SLO)
    r = ratio(res["cacheroute"]["capacity_qps"], res["p2c"]["capacity_qps"])
    floor = ratio(res["cacheroute-guard"]["capacity_qps"], res["cacheroute-noplan"]["capacity_qps"])
    log(f"    CacheRoute / p2c = {r:.3f} (target 0.97); with its guard / without any plan {floor:.3f}")
    return {"policies": res, "check": check(r, 0.97),
            "guard_ratio": ratio(res["cacheroute-guard"]["capacity_qps"], res["p2c"]["capacity_qps"]),
            "guard_vs_noplan": floor}


def idle_slo(trace: RequestTrace, destinations: int, engine: EngineProfile) -> float:
    """Twice the p99 TTFT of p2c at 2 % of the trace's rate: an SLO that scales with its prompts."""
    idle = replay_at(trace, 0.02 * base_qps(trace), make_policy("p2c"),
                     ReplayConfig(destinations=destinations, profile=engine))
    return 2.0 * idle.ttft_p99_s


def compare_with_baselines(trace: RequestTrace, engine: EngineProfile, destinations: int,
                           slo: float) -> dict[str, Any]:
    """Every per-request baseline and CacheRoute (guarded too) on one workload: capacities and
    CacheRoute's ratios to the best baseline."""
    res = search(trace, [(p, p, engine, destinations)
                         for p in (*PER_REQUEST, "cacheroute", "cacheroute-guard", "cacheroute-noplan",
                                   "cacheroute-pinned", "cacheroute-inflight")], slo)
    best = best_of(res, PER_REQUEST)
    r = ratio(res["cacheroute"]["capacity_qps"], res[best]["capacity_qps"])
    g = ratio(res["cacheroute-guard"]["capacity_qps"], res[best]["capacity_qps"])
    floor = ratio(res["cacheroute-guard"]["capacity_qps"], res["cacheroute-noplan"]["capacity_qps"])
    pinned = ratio(res["cacheroute-pinned"]["capacity_qps"], res[best]["capacity_qps"])
    inflight = ratio(res["cacheroute-inflight"]["capacity_qps"], res[best]["capacity_qps"])
    return {"slo_p99_ttft_s": slo, "policies": res, "best_per_request": best, "ratio": r, "guard_ratio": g,
            "guard_vs_noplan": floor, "pinned_ratio": pinned, "inflight_ratio": inflight}


def bench_heldout(seeds: Sequence[int]) -> dict[str, Any]:
    engine = H100_LLAMA33_70B_FP8_TP2
    out: dict[str, Any] = {}
    for seed in seeds:
        spec = sampled_spec(seed)
        w = generate(spec)
        slo = idle_slo(w.trace, TRACE_DESTINATIONS, engine)
        st = w.stats()
        log(f"[heldout] {spec.name}: {len(w.trace):,} requests, {spec.keys:,} keys, top {spec.top_key_fraction:.0%} "
            f"of keys carry {st.top_keys_request_share:.0%}, {st.multi_turn_request_share:.0%} multi-turn, "
            f"mean prompt {float(w.trace.input_tokens.mean()):,.0f} tokens, SLO {slo:.2f}s")
        found = compare_with_baselines(w.trace, engine, TRACE_DESTINATIONS, slo)
        log(f"    CacheRoute / {found['best_per_request']} = {found['ratio']:.3f} (target 1.00); with its guard "
            f"{found['guard_ratio']:.3f}; with its guard / without any plan {found['guard_vs_noplan']:.3f}; "
            f"entries held (no credit) {found['pinned_ratio']:.3f}; requests in flight weighing whole "
            f"{found['inflight_ratio']:.3f}")
        out[spec.name] = {"spec": spec.to_dict(), "stats": st.to_dict(), **found,
                          "check": check(found["ratio"], 1.0, baseline=found["best_per_request"])}
    guarded = [v["guard_ratio"] for v in out.values()]
    unguarded = [v["ratio"] for v in out.values()]
    if out:
        log(f"    held-out, {len(out)} workloads: with the guard {min(guarded):.3f}-{max(guarded):.3f} "
            f"(median {statistics.median(guarded):.3f}); without {min(unguarded):.3f}-{max(unguarded):.3f}")
    return out


def bench_bound(trace: RequestTrace) -> dict[str, Any]:
    """The ceilings of served KV hit on each engine of the paper sections (`replay/bound.py`)."""
    engines = {"gpu": H100_LLAMA33_70B_FP8_TP2, "host": host_engine(H100_LLAMA33_70B_FP8_TP2),
               "operator fp8": operator_engine("fp8")}
    out: dict[str, Any] = {}
    for name, e in engines.items():
        fleet = PAPER_DESTINATIONS * (e.kv_capacity_tokens + e.host_kv_capacity_tokens)
        t0 = time.perf_counter()
        lru = unified_lru_hit(trace, fleet)
        best = optimal_hit(trace, fleet)
        log(f"[bound] {name}: fleet KV {fleet:,} tokens: one LRU cache {lru:.1%}, Belady MIN {best:.1%} "
            f"({time.perf_counter() - t0:.0f}s)")
        out[name] = {"engine": e.name, "fleet_kv_tokens": fleet, "unified_lru_hit": lru, "optimal_hit": best}
    out["gpu"]["routed"] = bench_routed_bound(trace, engines["gpu"])
    return out


def bench_routed_bound(trace: RequestTrace, engine: EngineProfile) -> dict[str, Any]:
    """Per-destination LRU caches under routings that ignore load, one of them knowing the
    future (`replay/bound.py`): what routing alone could serve from cache on this engine."""
    capacity = engine.kv_capacity_tokens
    routings: dict[str, list[int]] = {"key-sticky": key_sticky_routes(trace, PAPER_DESTINATIONS)}
    for scratch in ORACLE_SCRATCH:
        routings[f"oracle admission, {scratch} scratch"] = oracle_admission_routes(trace, PAPER_DESTINATIONS, scratch)
    out: dict[str, Any] = {}
    for label, routes in routings.items():
        t0 = time.perf_counter()
        r = routed_lru_hit(trace, routes, PAPER_DESTINATIONS, capacity)
        log(f"[bound] gpu, routed {label}: {r.hit:.1%} served, most prefill on one destination "
            f"{r.imbalance:.2f}x the mean ({time.perf_counter() - t0:.0f}s)")
        out[label] = {"hit": r.hit, "prefill_max_over_mean": r.imbalance}
    return out


def clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    return x


def seed_list(text: str) -> list[int]:
    """`--heldout-seeds`: comma-separated non-negative integers, at least one."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative integers, got {text!r}")
    return seeds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first 15 minutes of the generated workloads")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="capacity searches at once")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {', '.join(SECTIONS)}")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--heldout-seeds", type=seed_list, default=list(HELDOUT_SEEDS),
                    help="seeds of the held-out workloads (section heldout), comma-separated")
    ap.add_argument("--rel-tol", type=float, default=DEFAULT_REL_TOL,
                    help="bisection step: stop when the lowest failing rate is within this fraction of the highest "
                         f"passing one (default {DEFAULT_REL_TOL})")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    problem = (f"--only {','.join(unknown)} is not one of {', '.join(SECTIONS)}" if unknown
               else f"--jobs {args.jobs} must be at least 1" if args.jobs < 1
               else f"--rel-tol {args.rel_tol} must be in (0, 1)" if not 0 < args.rel_tol < 1 else None)
    if problem:
        print(f"bench_capacity: {problem}", file=sys.stderr)
        return 2
    try:
        check_output_dir(args.out.parent, "--out")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        check_output_file(args.out, "--out")
    except OutputPathError as exc:
        print(f"bench_capacity: {exc}", file=sys.stderr)
        return 2
    _SHARED.update(jobs=args.jobs, rel_tol=args.rel_tol)
    report: dict[str, Any] = {"bench": "capacity", "quick": args.quick, "jobs": args.jobs, "rel_tol": args.rel_tol,
                              "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())}
    paper_sections = {"paper", "ablation", "product", "mnbt", "bound"} & set(only)
    paper = workload("cacheroute-paper", args.quick) if paper_sections else None
    for name in only:
        t0 = time.perf_counter()
        if name == "paper" and paper is not None:
            report["paper"] = bench_paper(paper)
        elif name == "ablation" and paper is not None:
            report["ablation"] = bench_ablation(paper)
        elif name == "product" and paper is not None:
            report["product"] = bench_product(paper)
        elif name == "mnbt" and paper is not None:
            report["mnbt"] = bench_mnbt(paper)
        elif name == "bound" and paper is not None:
            report["bound"] = bench_bound(paper)
        elif name == "traces":
            report["traces"] = bench_traces()
        elif name == "heldout":
            report["heldout"] = bench_heldout(args.heldout_seeds)
        elif name == "low-reuse":
            report["low_reuse"] = bench_low_reuse(workload("low-reuse", args.quick))
        report.setdefault("section_wall_s", {})[name] = time.perf_counter() - t0
        if paper is not None:
            report["paper_requests"] = len(paper)
        # After every section, so that an interrupted run keeps what it finished.
        write_report(report, args.out)
    return 0


def write_report(report: dict[str, Any], out: Path) -> None:
    """The JSON report and its figures (`capacity_plots.py`), each replaced whole."""
    from tests.bench.capacity_plots import write_figures

    cleaned = clean(report)
    text = json.dumps(cleaned, indent=2) + "\n"
    write_with(out, lambda staged: staged.write_text(text))
    # A figure that fails must not cost the run its remaining sections: the JSON is written.
    try:
        figures = write_figures(cleaned, out.parent, out.stem)
    except Exception as exc:
        log(f"wrote {out}; its figures failed: {exc!r} (redraw with python -m tests.bench.capacity_plots {out})")
        return
    log(f"wrote {', '.join(str(p) for p in (out, *figures))}")


if __name__ == "__main__":
    sys.exit(main())
