"""The AffinityPlan control loop at scale, on the sandbox (API server) and a backfilled Prometheus.

1. Timer fire -> ConfigMap updated for the report's 128,824 keys (30 destinations): one control
   period run by the operator's own code (`PlanLoop.run_period`, what the kopf daemon calls when a
   period is due), RUNS times, each from an empty ConfigMap so every run plans, judges and
   publishes. Reported per step: read (pool, plan in effect), Prometheus query, planner (with
   encoding), guard (shadow replay: candidate, plan in effect, no plan), publish. Baseline measured in
   the same run: Prometheus' own evaluation time for the operator's per-key queries (`stats=all`).
   Every series began before the window (its `_created` series says so), so no key is counted
   again. Also a steady period: same statistics with the plan already in effect.
2. The operator process's CPU per control period with 20 AffinityPlans (20 pools of 2,048 keys,
   8 destinations each, reconciled by the same operator, pods played by kwok): the first period
   (plan, guard, publish), steady Auto periods (the plan in effect still fits), and Shadow periods
   (plan and guard every period, the most a period can cost). The process's CPU with the pools
   alone, measured before any AffinityPlan, is taken out. Baseline measured in the same run: the
   planner and the guard alone on the same statistics, in-process (CPU time), so the ratio is
   what the operator adds around them.

Prometheus holds SAMPLES_IN_WINDOW samples per series in the window (one a minute); a production
Prometheus scraping every 15 s over 30 min holds 120, so Prometheus' per-sample work is lower
here than there. Writes bench-results/control.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from kubernetes import client

from cacheroute.operator.control.guard import run_guard
from cacheroute.operator.control.kube import ControlApi
from cacheroute.operator.control.loop import PlanLoop
from cacheroute.operator.control.period import PeriodResult
from cacheroute.operator.control.promql import PoolSeries, window_queries
from cacheroute.operator.control.settings import ControlSettings
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.plan import Destination
from cacheroute.planner.planning import compute_plan
from cacheroute.planner.replay.guard import GuardSettings
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE
from cacheroute.sandbox.crds import apply_crds, load_crds
from tests.support.backfill import PoolSeriesSpec, create_blocks, write_openmetrics
from tests.support.control import (
    CRD_DIR,
    GUARD_THROUGH_TIES,
    DedicatedPrometheus,
    await_destinations,
    create_plan,
    create_pool,
    create_reconciled_pool,
    get_plan,
    plan_manifest,
    start_operator,
)
from tests.support.operator import operator_identity
from tests.support.sandbox import fresh_namespace, session_sandbox
from tests.support.synthetic_stats import SyntheticStatsSpec, synthetic_key_stats

RUNS = 3
TARGET_S = 5.0
WINDOW_S = 300
STEP_S = 60
SAMPLES_IN_WINDOW = WINDOW_S // STEP_S
PAPER_DESTINATIONS = 30
PLANS = 20
KEYS_PER_PLAN = 2048
DESTINATIONS_PER_PLAN = 8
PERIOD_S = 30
PERIODS_MEASURED = 2
POOLS_ONLY_S = 30
# 20 pools of 8 one-GPU replicas: 160 GPUs, 20 of the sandbox's fake 8-GPU nodes.
SMALL_POOL = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "tensorParallelSize": 1}
NODES = PLANS * DESTINATIONS_PER_PLAN // 8
REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench-results" / "control.json"


# The synthetic statistics overload the simulated destinations of the guard's replay (p99 TTFT in
# minutes under any routing), so its SLO would decide on noise between two overloaded fleets; what
# this bench measures is the period's cost, and the guard still replays all three sides. Its KV-hit
# bar likewise: the routers' own routing keeps these keys as well as the plan does, and a tie to the
# hundredth of a point would make the first period's verdict, not its cost, decide the run.
GUARD = {"p99Ttft": "1h", **GUARD_THROUGH_TIES}


def log(message: str) -> None:
    print(message, flush=True)


def hashed(stats: KeyStats) -> KeyStats:
    """The statistics as the operator reads them: keys known by their hash only."""
    return KeyStats(
        names=tuple(f"{int(h):016x}" for h in stats.hashes.tolist()),
        rate=stats.rate,
        prompt_tokens=stats.prompt_tokens,
        prefix_tokens=stats.prefix_tokens,
        output_tokens=stats.output_tokens,
        unkeyed=stats.unkeyed,
        key_hashes=stats.hashes,
    )


def series_spec(stats: KeyStats, namespace: str, pool: str, engines: int) -> PoolSeriesSpec:
    return PoolSeriesSpec(
        namespace=namespace,
        pool=pool,
        labels=[f"{int(h):016x}" for h in stats.hashes.tolist()],
        rate=stats.rate,
        prompt_tokens=stats.prompt_tokens,
        prefix_tokens=stats.prefix_tokens,
        other_rate=0.0,
        unkeyed_rate=stats.unkeyed.rate,
        aggregate_prompt_tokens=stats.unkeyed.prompt_tokens,
        engines=engines,
    )


def backfilled_prometheus(workdir: Path, specs: list[PoolSeriesSpec], *, lasts_s: int) -> DedicatedPrometheus:
    workdir.mkdir(parents=True, exist_ok=True)
    now = int(time.time())
    om = workdir / "series.om"
    t0 = time.perf_counter()
    samples = write_openmetrics(om, specs, start=now - WINDOW_S - STEP_S, end=now + lasts_s, step=STEP_S)
    t1 = time.perf_counter()
    create_blocks(om, workdir / "prometheus" / "data")
    log(f"  backfill: {samples:,} samples ({om.stat().st_size / 1e6:,.0f} MB) written in {t1 - t0:.1f}s, "
        f"blocks in {time.perf_counter() - t1:.1f}s")
    om.unlink()
    prom = DedicatedPrometheus(workdir / "prometheus", [])
    prom.start()
    return prom


def create_fleet_pool(api: Any, namespace: str, pool: str, destinations: int, kv: int) -> None:
    create_pool(api, namespace, pool, [(f"10.{len(pool)}.{i // 250}.{i % 250 + 1}:8000", True)
                                       for i in range(destinations)], kv)


def delete_plan_configmaps(api: Any, namespace: str, pool: str) -> None:
    core = client.CoreV1Api(api)
    for cm in core.list_namespaced_config_map(namespace).items:
        if cm.metadata.name == f"{pool}-plan" or cm.metadata.name.startswith(f"{pool}-plan-"):
            core.delete_namespaced_config_map(cm.metadata.name, namespace)


def prometheus_eval_s(prom: DedicatedPrometheus, namespace: str, pool: str) -> float:
    """Prometheus' own evaluation time of the operator's per-key queries (one after the other):
    the increases and the keys born in the window (none here: every series began before it)."""
    queries = window_queries(PoolSeries(namespace, pool), WINDOW_S)
    total = 0.0
    for q in (queries.key_requests, queries.key_prompt_tokens, queries.key_prefix_tokens, queries.key_born):
        body = httpx.post(f"{prom.url}/api/v1/query", data={"query": q, "time": str(int(time.time())),
                                                            "stats": "all"}, timeout=120).json()
        total += float(body["data"]["stats"]["timings"]["execTotalTime"])
    return total


def fire_to_configmap(sandbox: Any, workdir: Path) -> dict[str, Any]:
    log(f"1. timer fire -> ConfigMap updated, {SyntheticStatsSpec().keys:,} keys")
    api = sandbox.api_client()
    stats = synthetic_key_stats()
    kv = DEFAULT_PROFILE.kv_capacity_tokens
    with fresh_namespace(sandbox, "bench-control-scale") as namespace:
        prom = backfilled_prometheus(workdir / "scale", [series_spec(stats, namespace, "paper", PAPER_DESTINATIONS)],
                                     lasts_s=480)
        try:
            create_fleet_pool(api, namespace, "paper", PAPER_DESTINATIONS, kv)
            create_plan(api, namespace, plan_manifest(
                "paper", "paper", controlPeriod="1h", metricsWindow=f"{WINDOW_S}s",
                prometheus={"url": prom.url, "timeout": "120s"}, guard=GUARD,
            ))
            loop = PlanLoop(ControlApi(api), ControlSettings(), namespace=namespace, name="paper",
                            events=lambda *_: None)
            runs: list[dict[str, float]] = []
            last: PeriodResult | None = None
            for i in range(RUNS):
                delete_plan_configmaps(api, namespace, "paper")
                body = get_plan(api, namespace, "paper")
                t0 = time.perf_counter()
                last = asyncio.run(loop.run_period(body))
                wall = time.perf_counter() - t0
                assert last.outcome == "applied", (last.outcome, last.findings)
                s = last.seconds
                fire = sum(s.get(k, 0.0) for k in ("read", "query", "plan", "guard", "publish"))
                runs.append({**s, "fire_to_configmap_s": fire, "period_wall_s": wall})
                log(f"  run {i + 1}: fire->ConfigMap {fire:.2f}s (" + ", ".join(f"{k} {v:.2f}s" for k, v in s.items())
                    + f"), load {os.getloadavg()[0]:.1f}")
            steady = asyncio.run(loop.run_period(get_plan(api, namespace, "paper")))
            log(f"  steady period ({steady.outcome}): " + ", ".join(f"{k} {v:.2f}s" for k, v in steady.seconds.items()))
            evals = [prometheus_eval_s(prom, namespace, "paper") for _ in range(RUNS)]
        finally:
            prom.stop()
    assert last is not None and last.candidate is not None and last.verdict is not None
    median = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
    eval_median = statistics.median(evals)
    return {
        "keys": len(stats),
        "destinations": PAPER_DESTINATIONS,
        "routes": len(last.candidate),
        "payload_configmaps": len(last.payload.configmaps) if last.payload else None,
        "guard": {"passed": last.verdict.passed, "reason": last.verdict.reason},
        "runs": runs,
        "median": median,
        "steady_period": {"outcome": steady.outcome, **steady.seconds},
        "prometheus_eval_s_median": eval_median,
        "ratios": {
            "fire_to_configmap_vs_target": median["fire_to_configmap_s"] / TARGET_S,
            "query_share": median["query"] / median["fire_to_configmap_s"],
            "plan_share": median["plan"] / median["fire_to_configmap_s"],
            "guard_share": median["guard"] / median["fire_to_configmap_s"],
            "query_vs_prometheus_eval": median["query"] / eval_median if eval_median else None,
        },
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def period_times(api: Any, namespace: str) -> dict[str, str]:
    items = client.CustomObjectsApi(api).list_namespaced_custom_object(
        "cacheroute.dev", "v1alpha1", namespace, "affinityplans")["items"]
    return {o["metadata"]["name"]: (o.get("status") or {}).get("lastPeriodTime", "") for o in items}


def periods_until(api: Any, namespace: str, periods: int, timeout: float) -> int:
    """Wait until every AffinityPlan has run `periods` more periods; returns the periods counted."""
    seen = period_times(api, namespace)
    counts = dict.fromkeys(seen, 0)
    deadline = time.monotonic() + timeout
    while min(counts.values()) < periods:
        if time.monotonic() > deadline:
            raise TimeoutError(f"periods per plan after {timeout:.0f}s: {sorted(counts.values())}")
        time.sleep(0.5)
        for name, last in period_times(api, namespace).items():
            if last != seen[name]:
                counts[name] += 1
                seen[name] = last
    return sum(counts.values())


def patch_all(api: Any, namespace: str, spec: dict[str, Any]) -> None:
    custom = client.CustomObjectsApi(api)
    for i in range(PLANS):
        custom.patch_namespaced_custom_object("cacheroute.dev", "v1alpha1", namespace, "affinityplans", f"p{i:02d}",
                                              {"spec": spec})


def cpu_per_period(sandbox: Any, workdir: Path) -> dict[str, Any]:
    log(f"2. operator CPU per control period, {PLANS} AffinityPlans x {KEYS_PER_PLAN:,} keys")
    api = sandbox.api_client()
    kv = DEFAULT_PROFILE.kv_capacity_tokens
    with fresh_namespace(sandbox, "bench-control-cpu") as namespace:
        specs, all_stats = [], []
        for i in range(PLANS):
            stats = hashed(synthetic_key_stats(SyntheticStatsSpec(keys=KEYS_PER_PLAN, total_rate=48.0, seed=i,
                                                                  name_prefix=f"p{i:02d}-")))
            all_stats.append(stats)
            specs.append(series_spec(stats, namespace, f"p{i:02d}", DESTINATIONS_PER_PLAN))
        prom = backfilled_prometheus(workdir / "cpu", specs, lasts_s=1800)
        identity = operator_identity(sandbox, workdir / "identity")
        operator = start_operator(identity, namespace, workdir=workdir, prometheus_url=prom.url)
        assert operator.process is not None
        pid = operator.process.pid
        try:
            for i in range(PLANS):
                create_reconciled_pool(api, namespace, f"p{i:02d}", DESTINATIONS_PER_PLAN, SMALL_POOL)
            for i in range(PLANS):
                kv = await_destinations(api, namespace, f"p{i:02d}", DESTINATIONS_PER_PLAN)[0].kv_capacity_tokens
            # Baseline: the same process reconciling the 20 pools, before any AffinityPlan exists.
            c0, t0 = cpu_seconds(pid), time.monotonic()
            time.sleep(POOLS_ONLY_S)  # a fixed span of CPU accounting, not a wait for a condition
            pools_cpu_per_s = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
            phases: dict[str, dict[str, float]] = {}
            c0, t0 = cpu_seconds(pid), time.monotonic()
            for i in range(PLANS):
                create_plan(api, namespace, plan_manifest(f"p{i:02d}", f"p{i:02d}", controlPeriod="1h",
                                                          metricsWindow=f"{WINDOW_S}s", guard=GUARD))
            counted = periods_until(api, namespace, 1, timeout=600)
            phases["first"] = {"cpu_s": cpu_seconds(pid) - c0, "wall_s": time.monotonic() - t0, "periods": counted}
            for name, spec in (("steady_auto", {"controlPeriod": f"{PERIOD_S}s"}), ("shadow", {"mode": "Shadow"})):
                patch_all(api, namespace, spec)
                periods_until(api, namespace, 1, timeout=600)  # the period the spec change starts
                c0, t0 = cpu_seconds(pid), time.monotonic()
                counted = periods_until(api, namespace, PERIODS_MEASURED, timeout=900)
                phases[name] = {"cpu_s": cpu_seconds(pid) - c0, "wall_s": time.monotonic() - t0, "periods": counted}
        finally:
            delete_all(api, namespace)
            operator.stop()
            prom.stop()
    baseline = compute_baseline(all_stats, kv)
    out: dict[str, Any] = {"plans": PLANS, "keys_per_plan": KEYS_PER_PLAN, "period_s": PERIOD_S,
                           "pools_only_cpu_s_per_s": pools_cpu_per_s, "baseline_cpu_s_per_plan": baseline,
                           "phases": {}}
    # What the planner and the guard alone cost for the same statistics, in this process: the
    # rest of a period's CPU is the operator's own (queries, parsing, API calls, kopf).
    compute = {"first": baseline["plan"] + baseline["guard"], "steady_auto": baseline["replan"],
               "shadow": baseline["replan"] + baseline["guard"]}
    for name, p in phases.items():
        # The pools' own reconciling goes on meanwhile: take it out, as measured before any plan.
        loop_cpu = max(p["cpu_s"] - pools_cpu_per_s * p["wall_s"], 0.0)
        per_period = loop_cpu / p["periods"]
        out["phases"][name] = {
            **p,
            "pools_cpu_s": pools_cpu_per_s * p["wall_s"],
            "cpu_s_per_plan_period": per_period,
            "cpu_s_per_control_period_all_plans": per_period * PLANS,
            "planner_and_guard_cpu_s_per_plan": compute[name],
            "vs_planner_and_guard": per_period / compute[name],
        }
        log(f"  {name}: {per_period * PLANS:.2f} CPU-s per control period of {PLANS} plans "
            f"({per_period:.3f} per plan-period, {p['periods']} periods in {p['wall_s']:.0f}s, of a process "
            f"that spent {p['cpu_s']:.1f} CPU-s of which the pools' reconciling {pools_cpu_per_s * p['wall_s']:.1f}; "
            f"planner and guard alone {compute[name]:.3f}, ratio {per_period / compute[name]:.2f})")
    return out


def delete_all(api: Any, namespace: str) -> None:
    """AffinityPlans and pools, while the operator runs to release its finalizers."""
    custom = client.CustomObjectsApi(api)
    for plural in ("affinityplans", "inferencepools"):
        for item in custom.list_namespaced_custom_object("cacheroute.dev", "v1alpha1", namespace, plural)["items"]:
            custom.delete_namespaced_custom_object("cacheroute.dev", "v1alpha1", namespace, plural,
                                                   item["metadata"]["name"])
        deadline = time.monotonic() + 120
        while custom.list_namespaced_custom_object("cacheroute.dev", "v1alpha1", namespace, plural)["items"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)


def compute_baseline(all_stats: list[KeyStats], kv: int) -> dict[str, float]:
    """Median CPU seconds per plan of the planner (first plan, re-plan) and the guard, in-process."""
    dests = [Destination(f"p-{i}", f"10.0.0.{i}:8000", 1.0, kv) for i in range(DESTINATIONS_PER_PLAN)]
    plan_s, replan_s, guard_s = [], [], []
    for stats in all_stats:
        t0 = time.process_time()
        first = compute_plan(stats, dests, pool="p").plan
        t1 = time.process_time()
        compute_plan(stats, dests, pool="p", previous=first)
        t2 = time.process_time()
        run_guard(stats, first, None, settings=GuardSettings(), duration_s=120.0, kv_capacity_tokens=kv)
        t3 = time.process_time()
        plan_s.append(t1 - t0)
        replan_s.append(t2 - t1)
        guard_s.append(t3 - t2)
    return {"plan": statistics.median(plan_s), "replan": statistics.median(replan_s),
            "guard": statistics.median(guard_s)}


def main() -> None:
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-control-") as tmp, session_sandbox(nodes=NODES) as sandbox:
        apply_crds(sandbox.api_client(), load_crds(CRD_DIR.glob("*.yaml")))
        scale = fire_to_configmap(sandbox, Path(tmp))
        cpu = cpu_per_period(sandbox, Path(tmp))
    m = scale["median"]
    ratio = scale["ratios"]["fire_to_configmap_vs_target"]
    log(f"fire->ConfigMap, {scale['keys']:,} keys, median of {RUNS}: {m['fire_to_configmap_s']:.2f}s "
        f"(target {TARGET_S:.0f}s, ratio {ratio:.2f}): query {m['query']:.2f}s "
        f"(Prometheus' own evaluation {scale['prometheus_eval_s_median']:.2f}s), plan {m['plan']:.2f}s, "
        f"guard {m['guard']:.2f}s, publish {m['publish']:.2f}s")
    result = {
        "command": [sys.executable, "-m", "tests.bench.bench_control"],
        "load_average_at_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "window_s": WINDOW_S,
        "samples_per_series_in_window": SAMPLES_IN_WINDOW,
        "fire_to_configmap": scale,
        "cpu_per_period": cpu,
        "wall_s": time.time() - started,
        "numpy": np.__version__,
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {OUT}")


if __name__ == "__main__":
    main()
