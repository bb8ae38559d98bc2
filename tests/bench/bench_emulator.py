"""CPU per request of the vLLM emulator, and how closely its timing follows the replay.

One process hosts EMULATORS emulated servers in one event loop, as the pod runtime does (same
`Emulator` class, uvloop). The load generator replays a generated workload (`cacheroute-paper`
statistics, shared prefixes, multi-turn threads) against them, open loop, each key always on the
same server. Measured, in the same run:

- CPU seconds of the emulator process per completed request, streaming (the default for the
  load generator) and not; against the process's idle CPU over the same wall time (baseline);
- the load generator's own CPU per request (the client side of the same requests);
- for every request, client-side TTFT and end-to-end latency against what the replay engine
  predicts for the same arrivals on a one-destination simulation of its server (medians and
  90th percentiles of the relative error).

Run: `.venv/bin/python -m tests.bench.bench_emulator` (writes bench-results/emulator.json).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from cacheroute.planner.replay.policies import RoundRobin
from cacheroute.planner.replay.run import ReplayConfig, replay_trace
from cacheroute.planner.trace import NO_KEY, RequestTrace
from cacheroute.sandbox.emulator.args import parse_vllm_args
from cacheroute.sandbox.emulator.tokens import block_ids, words
from cacheroute.sandbox.loadgen.client import LoadSettings, RequestResult, run_load
from cacheroute.sandbox.loadgen.prompts import prompt_text
from cacheroute.sandbox.loadgen.schedule import Schedule, build_schedule, load_trace
from cacheroute.sandbox.process import free_ports

OUT = Path("bench-results") / "emulator.json"
EMULATORS = 4
QPS = 16.0
SECONDS = 25.0
IDLE_SECONDS = 5.0
ARGS = ["meta-llama/Llama-3.3-70B-Instruct", "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "24G",
        "--max-model-len", "32768"]
HOST_SCRIPT = """
import asyncio, signal, sys, uvloop
from cacheroute.sandbox.emulator.args import parse_vllm_args
from cacheroute.sandbox.emulator.server import Emulator
args, ports = sys.argv[1].split(), [int(p) for p in sys.argv[2].split(",")]
async def main():
    emulators = [Emulator(parse_vllm_args([*args, "--port", str(p)]), "127.0.0.1", log=lambda m: None) for p in ports]
    for e in emulators:
        await e.start()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
uvloop.run(main())
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def split(schedule: Schedule, parts: int) -> list[Schedule]:
    """One schedule per server: requests go to a server by their key (or index when keyless)."""
    buckets: list[list[Any]] = [[] for _ in range(parts)]
    for request in schedule.requests:
        token = request.key if request.key is not None else str(request.index)
        buckets[zlib.crc32(token.encode()) % parts].append(request)
    return [Schedule(schedule.trace, tuple(b), schedule.source, schedule.time_scale) for b in buckets]


async def drive(urls: list[str], schedules: list[Schedule], stream: bool) -> list[list[RequestResult]]:
    settings = [LoadSettings(url=u, timeout_s=120.0) for u in urls]
    if not stream:
        return await asyncio.gather(*(non_streaming(u, s) for u, s in zip(urls, schedules, strict=True)))
    return list(await asyncio.gather(*(run_load(s, c) for s, c in zip(schedules, settings, strict=True))))


async def non_streaming(url: str, schedule: Schedule) -> list[RequestResult]:
    loop = asyncio.get_running_loop()
    origin = loop.time() + 0.2
    results: list[RequestResult] = []
    tr = schedule.trace

    async def one(client: httpx.AsyncClient, request: Any) -> None:
        await asyncio.sleep(max(0.0, origin + request.at_s - loop.time()))
        body = {"prompt": prompt_text(tr.blocks(request.index).tolist(), request.input_tokens, tr.block_size,
                                      salt=request.index), "max_tokens": request.output_tokens}
        sent = loop.time()
        reply = await client.post(f"{url}/v1/completions", json=body)
        results.append(RequestResult(index=request.index, key=request.key, scheduled_s=request.at_s,
                                     sent_s=sent - origin, e2e_s=loop.time() - sent, status=reply.status_code,
                                     output_tokens=request.output_tokens))

    async with httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_connections=None)) as client:
        await asyncio.gather(*(one(client, r) for r in schedule.requests))
    return results


def predicted(schedule: Schedule, results: list[RequestResult], block_size: int) -> tuple[list[float], list[float]]:
    """The replay's TTFT and e2e for these requests, as sent, on one simulated server."""
    tr = schedule.trace
    order = sorted((r for r in results if not math.isnan(r.sent_s)), key=lambda r: r.sent_s)
    by_index = {r.index: r for r in schedule.requests}
    chains = []
    for result in order:
        request = by_index[result.index]
        text = prompt_text(tr.blocks(request.index).tolist(), request.input_tokens, tr.block_size, salt=request.index)
        chains.append(block_ids(words(text), block_size))
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in chains])]).astype(np.int64)
    trace = RequestTrace(
        arrival_s=np.array([r.sent_s for r in order]),
        key=np.full(len(order), NO_KEY, dtype=np.int64),
        input_tokens=np.array([by_index[r.index].input_tokens for r in order], dtype=np.int64),
        output_tokens=np.array([by_index[r.index].output_tokens for r in order], dtype=np.int64),
        block_offsets=offsets,
        block_ids=np.array([b for c in chains for b in c], dtype=np.int64),
        block_size=block_size,
        key_names=(),
    )
    profile = parse_vllm_args(ARGS).profile
    sim = replay_trace(trace, RoundRobin(), ReplayConfig(destinations=1, profile=profile, warmup_fraction=0.0))
    return sim.ttft_s.tolist(), sim.e2e_s.tolist()


def phase(schedule: Schedule, stream: bool) -> dict[str, Any]:
    ports = free_ports(EMULATORS)
    host = subprocess.Popen(
        [sys.executable, "-c", HOST_SCRIPT, " ".join(ARGS), ",".join(map(str, ports))],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        idle_start = cpu_seconds(host.pid)
        time.sleep(IDLE_SECONDS)
        idle_cpu_per_s = (cpu_seconds(host.pid) - idle_start) / IDLE_SECONDS
        schedules = split(schedule, EMULATORS)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        cpu0, client0, wall0 = cpu_seconds(host.pid), own_cpu(), time.monotonic()
        per_server = asyncio.run(drive(urls, schedules, stream))
        cpu, client_cpu, wall = cpu_seconds(host.pid) - cpu0, own_cpu() - client0, time.monotonic() - wall0
    finally:
        host.terminate()
        host.wait(10)
    results = [r for rs in per_server for r in rs]
    ok = [r for r in results if r.ok] if stream else [r for r in results if r.status == 200]
    tokens = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "requests": len(results),
        "ok": len(ok),
        "wall_s": wall,
        "emulator_cpu_s": cpu,
        "emulator_cpu_ms_per_request": 1000 * cpu / max(1, len(ok)),
        "emulator_cpu_us_per_output_token": 1e6 * cpu / max(1, tokens),
        "emulator_idle_cpu_ms_per_s": 1000 * idle_cpu_per_s,
        "emulator_busy_share_of_one_core": cpu / wall,
        "client_cpu_ms_per_request": 1000 * client_cpu / max(1, len(ok)),
    }
    if stream:
        relative: dict[str, list[float]] = {"ttft": [], "e2e": []}
        absolute_ms: dict[str, list[float]] = {"ttft": [], "e2e": []}
        replay_ttft: list[float] = []
        for sched, rs in zip(schedules, per_server, strict=True):
            done = sorted((r for r in rs if not math.isnan(r.sent_s)), key=lambda r: r.sent_s)
            want_ttft, want_e2e = predicted(sched, done, parse_vllm_args(ARGS).block_size)
            replay_ttft += want_ttft
            for r, wt, we in zip(done, want_ttft, want_e2e, strict=True):
                if r.ok:
                    for name, got, want in (("ttft", r.ttft_s, wt), ("e2e", r.e2e_s, we)):
                        relative[name].append(abs(got - want) / want)
                        absolute_ms[name].append(1000 * abs(got - want))
        for name in ("ttft", "e2e"):
            out[f"{name}_rel_error_median"] = statistics.median(relative[name])
            out[f"{name}_rel_error_p90"] = float(np.percentile(relative[name], 90))
            out[f"{name}_abs_error_ms_median"] = statistics.median(absolute_ms[name])
            out[f"{name}_abs_error_ms_p90"] = float(np.percentile(absolute_ms[name], 90))
        out["replay_ttft_median_ms"] = 1000 * statistics.median(replay_ttft)
        out["served_kv_hit"] = sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))
    return out


def main() -> None:
    trace, source = load_trace(trace=None, workload="cacheroute-paper", qps=QPS, duration_s=600.0, keys=1500, seed=1)
    schedule = build_schedule(trace, source=source, duration_s=SECONDS, max_output_tokens=256, max_input_tokens=12_000)
    print(f"{len(schedule.requests)} requests of {source} over {schedule.duration_s:.0f} s on {EMULATORS} servers")
    results: dict[str, Any] = {"emulators": EMULATORS, "qps": QPS, "seconds": SECONDS, "args": ARGS}
    for name, stream in (("streaming", True), ("non_streaming", False)):
        results[name] = phase(schedule, stream)
        print(name, json.dumps(results[name], indent=1))
    streaming, plain = results["streaming"], results["non_streaming"]
    results["ratios"] = {
        "streaming_vs_non_streaming_cpu_per_request": (
            streaming["emulator_cpu_ms_per_request"] / plain["emulator_cpu_ms_per_request"]
        ),
        "emulator_vs_client_cpu_per_request": (
            streaming["emulator_cpu_ms_per_request"] / streaming["client_cpu_ms_per_request"]
        ),
    }
    print("ratios", json.dumps(results["ratios"], indent=1))
    OUT.parent.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=OUT.parent, delete=False) as staged:
        staged.write(json.dumps(results, indent=2))
    os.replace(staged.name, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
