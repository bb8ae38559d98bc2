"""Router benchmarks: decision time, decisions per second over gRPC, latency added through Envoy.

Run: `.venv/bin/python tests/bench/bench_router.py` (writes bench-results/router.json).

1. In-process decision time with a 200,000-route plan (target: median <= 20 us), for planned,
   unplanned and keyless requests, for `Picker.pick` alone and for a whole ext_proc message
   (key hashing, pick, reply, metrics) without gRPC; plus the time to load such a plan, and the
   time from a new plan appearing in the mounted volume to the router following it (<= 1 s).
2. Decisions per second of one router process over gRPC (target >= 3,000/s): a grpc.aio client
   in this process opens header-only `Process` streams with bounded concurrency against the
   router in its own process. Baseline in the same run: a grpc.aio servicer that answers every
   message with a constant, in its own process (the ceiling of any Python ext_proc server here).
3. Latency added through Envoy at 250, 500 and 1,000 requests/s (target <= 1 ms at p99 at
   1,000/s): the same Envoy setup without ext_proc, with ext_proc to the constant servicer, and
   with ext_proc to the router (request headers only, and with the buffered body), interleaved
   in rounds in the same run, in front of fast upstreams (Envoy direct responses on their own
   loopback addresses). Open-loop load from a small asyncio HTTP/1.1 client; latency is measured
   from each request's scheduled send time, so a stalled client or server cannot hide queueing.

Everything listens on loopback; every phase is bounded in request count and in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cacheroute.planner.plan import Destination, Plan
from cacheroute.planner.planfile import encode_plan
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.envoy import GatewayOptions, gateway_bootstrap
from cacheroute.router.extproc import Exchange, RouterCore
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.plans import PlanStore
from cacheroute.router.testing import PlanVolume, RouterProcess, start_router_process
from cacheroute.sandbox.envoy import Envoy, start_envoy
from cacheroute.sandbox.process import ServerProcess, free_port, spawn, wait_until

ROUTES = 200_000
DESTINATIONS = 30
DECISIONS = 100_000
GRPC_STREAMS = 20_000
GRPC_CONCURRENCY = 64
GRPC_TIME_LIMIT = 30.0
RATES = (250.0, 500.0, 1000.0)
ROUND_SECONDS = 2.0
ROUNDS = 2
LOAD_CONNECTIONS = 64
UPSTREAMS = 8
KEYS = [f"tenant-{i}" for i in range(ROUTES)]

OUT = Path("bench-results") / "router.json"


# --- plans -----------------------------------------------------------------------------------------


def big_plan(destinations: Sequence[Destination], seed: int = 7) -> Plan:
    """200,000 routes over the destinations; 1 to 3 destinations per key, most with one."""
    from cacheroute.planner.plan import affinity_key_hash

    rng = np.random.default_rng(seed)
    hashes = np.array(sorted({affinity_key_hash(k) for k in KEYS}), dtype=np.uint64)
    counts = rng.choice([1, 1, 1, 1, 2, 3], len(hashes))
    offsets = np.zeros(len(hashes) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    n = len(destinations)
    dests = np.concatenate([rng.permutation(n)[:c] for c in counts]).astype(np.uint16)
    return Plan("bench", tuple(destinations), hashes, offsets, dests)


def summary(samples_s: Sequence[float]) -> dict[str, float]:
    values = np.asarray(samples_s) * 1e6
    return {
        "n": len(values),
        "median_us": round(float(np.median(values)), 2),
        "p90_us": round(float(np.percentile(values, 90)), 2),
        "p99_us": round(float(np.percentile(values, 99)), 2),
        "mean_us": round(float(values.mean()), 2),
    }


# --- 1. in-process decisions -----------------------------------------------------------------------


def bench_in_process() -> dict[str, Any]:
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from cacheroute.planner.plan import affinity_key_hash

    destinations = [Destination(f"bench-{i}", f"10.2.{i // 200}.{i % 200 + 1}:8000") for i in range(DESTINATIONS)]
    plan = big_plan(destinations)
    payload = encode_plan(plan)
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, seed=1)
    metrics = RouterMetrics(pool, sketch_size=4096, export_key_names=False)
    store = PlanStore(pool, picker, metrics)
    started = time.perf_counter()
    assert asyncio.run(store.process(payload.files, origin="bench"))
    load_s = time.perf_counter() - started
    core = RouterCore(picker, metrics, max_body_bytes=1 << 20)
    rng = np.random.default_rng(1)
    # Some load so that least-loaded and spill checks do real work.
    for e in pool.by_address.values():
        e.in_flight = int(rng.integers(0, 6))
        pool.in_flight_ready += e.in_flight

    planned = [affinity_key_hash(KEYS[i]) for i in rng.integers(0, ROUTES, DECISIONS)]
    unplanned = [affinity_key_hash(f"stranger-{i}") for i in range(DECISIONS)]
    results: dict[str, Any] = {"plan_routes": len(plan), "plan_payload_bytes": payload.total_bytes,
                               "plan_load_ms": round(load_s * 1e3, 1)}

    def timed(fn: Callable[[Any], object], items: Sequence[Any]) -> dict[str, float]:
        clock = time.perf_counter
        samples = []
        for item in items:
            t0 = clock()
            fn(item)
            samples.append(clock() - t0)
        return summary(samples)

    outcomes = {picker.pick(h).outcome for h in planned[:1000]}
    results["pick_planned"] = timed(picker.pick, planned)
    results["pick_unplanned"] = timed(picker.pick, unplanned)
    results["pick_no_key"] = timed(picker.pick, [None] * DECISIONS)
    results["planned_outcomes_seen"] = sorted(outcomes)

    def request(key: str | None) -> pb.ProcessingRequest:
        values = [base_pb2.HeaderValue(key=k, raw_value=v) for k, v in (
            (":method", b"POST"), (":path", b"/v1/chat/completions"), (":authority", b"gateway"),
            ("content-type", b"application/json"), ("content-length", b"512"), ("user-agent", b"bench"),
        )]
        if key is not None:
            values.append(base_pb2.HeaderValue(key="x-affinity-key", raw_value=key.encode()))
        return pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=True)
        )

    messages = [request(KEYS[i]) for i in rng.integers(0, ROUTES, DECISIONS // 4)]

    def whole_message(message: pb.ProcessingRequest) -> None:
        exchange = Exchange(core)
        exchange.handle(message)
        exchange.finish()

    results["ext_proc_message_planned"] = timed(whole_message, messages)
    return results


# --- 2. decisions per second over gRPC -------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _grpc_load(target: str, total: int, concurrency: int, limit_s: float) -> dict[str, Any]:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    rng = np.random.default_rng(3)
    requests = []
    for i in rng.integers(0, ROUTES, 512):
        values = [
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key="x-affinity-key", raw_value=KEYS[int(i)].encode()),
        ]
        requests.append(pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=True)
        ))
    done = 0
    errors = 0
    latencies: list[float] = []
    deadline = time.monotonic() + limit_s
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one(request: pb.ProcessingRequest) -> None:
            call = stub.Process()
            await call.write(request)
            await call.done_writing()
            response = await call.read()
            if response is grpc.aio.EOF or not response.HasField("request_headers"):
                raise RuntimeError("no headers reply")

        await one(requests[0])  # connect

        async def worker(index: int) -> None:
            nonlocal done, errors
            i = index
            while done + errors < total and time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    await one(requests[i % len(requests)])
                    done += 1
                    latencies.append(time.perf_counter() - t0)
                except Exception:
                    errors += 1
                i += concurrency

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"decisions": done, "errors": errors, "seconds": round(elapsed, 3),
            "per_second": round(done / elapsed, 1), "stream_latency": summary(latencies)}


def _grpc_round(target: str, pid: int) -> dict[str, Any]:
    cpu_before = _cpu_seconds(pid)
    result = asyncio.run(_grpc_load(target, GRPC_STREAMS, GRPC_CONCURRENCY, GRPC_TIME_LIMIT))
    cpu = _cpu_seconds(pid) - cpu_before
    result["concurrency"] = GRPC_CONCURRENCY
    result["server_cpu_seconds"] = round(cpu, 2)
    result["server_cpu_us_per_stream"] = round(cpu / max(1, result["decisions"]) * 1e6, 1)
    result["streams_per_server_cpu_second"] = round(result["decisions"] / max(cpu, 1e-9), 1)
    return result


async def _serve_constant(port_file: Path) -> None:
    """The baseline: a grpc.aio ext_proc servicer that answers every message with a constant."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    replies = {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    }

    class Constant(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, requests: Any, context: Any) -> Any:  # noqa: N802
            async for request in requests:
                yield replies[request.WhichOneof("request")]

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Constant(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await asyncio.to_thread(_write_atomically, port_file, str(port))
    await server.wait_for_termination()


def _write_atomically(path: Path, text: str) -> None:
    staged = path.with_suffix(".tmp")
    staged.write_text(text)
    os.replace(staged, path)


def start_constant_server(workdir: Path) -> tuple[ServerProcess, str]:
    port_file = workdir / "constant.port"
    constant = spawn("constant-ext-proc", [sys.executable, __file__, "--constant-server", str(port_file)],
                     log=workdir / "constant.log", detach=False)
    wait_until(port_file.exists, timeout=30, what="the constant ext_proc server", process=constant)
    return constant, f"127.0.0.1:{port_file.read_text()}"


def bench_grpc(router: RouterProcess, constant: ServerProcess, constant_target: str) -> dict[str, Any]:
    baseline = _grpc_round(constant_target, constant.pid)
    result = _grpc_round(router.target, router.process.pid)
    result["baseline_constant_servicer"] = baseline
    result["ratio_to_baseline"] = round(result["per_second"] / baseline["per_second"], 2)
    return result


def bench_reload(router: RouterProcess, volume: PlanVolume, destinations: Sequence[Destination]) -> dict[str, Any]:
    """Seconds from a new 200,000-route plan appearing in the volume to the router following it."""
    samples = []
    for seed in (11, 12, 13):
        version = volume.publish(big_plan(destinations, seed=seed))
        published = time.perf_counter()
        deadline = published + 30
        while f'version="{version}"' not in router.metrics():
            if time.perf_counter() > deadline:
                raise RuntimeError(f"plan {version} not applied within 30 s")
            time.sleep(0.01)
        samples.append(time.perf_counter() - published)
    return {"seconds": [round(s, 3) for s in samples], "max_seconds": round(max(samples), 3)}


# --- 3. latency through Envoy ----------------------------------------------------------------------


def upstream_bootstrap(addresses: Sequence[str]) -> dict[str, Any]:
    """One Envoy answering on every upstream address: a canned completion and vLLM gauges."""
    metrics_text = (
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 0\n"
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 0\n"
    )
    completion = json.dumps({"id": "x", "choices": [{"message": {"role": "assistant", "content": "ok"}}],
                             "usage": {"prompt_tokens": 12, "completion_tokens": 1}})
    listeners = []
    for i, address in enumerate(addresses):
        host, _, port = address.rpartition(":")
        listeners.append({
            "name": f"upstream-{i}",
            "address": {"socket_address": {"address": host, "port_value": int(port)}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
                    "stat_prefix": f"upstream_{i}",
                    "route_config": {"virtual_hosts": [{"name": "engine", "domains": ["*"], "routes": [
                        {"match": {"path": "/metrics"},
                         "direct_response": {"status": 200, "body": {"inline_string": metrics_text}}},
                        {"match": {"prefix": "/"},
                         "direct_response": {"status": 200, "body": {"inline_string": completion}}},
                    ]}]},
                    "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                },
            }]}],
        })
    return {"static_resources": {"listeners": listeners}}


class LoadClient:
    """Open-loop HTTP/1.1 load over keep-alive connections, minimal parsing, asyncio only."""

    def __init__(self, port: int, connections: int) -> None:
        self.port = port
        self.connections = connections
        self._idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def open(self) -> None:
        for _ in range(self.connections):
            self._idle.put_nowait(await asyncio.open_connection("127.0.0.1", self.port))

    async def close(self) -> None:
        while not self._idle.empty():
            _, writer = self._idle.get_nowait()
            writer.close()

    async def _request(self, raw: bytes) -> int:
        reader, writer = await self._idle.get()
        try:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length:
                await reader.readexactly(length)
        except BaseException:
            writer.close()
            self._idle.put_nowait(await asyncio.open_connection("127.0.0.1", self.port))
            raise
        self._idle.put_nowait((reader, writer))
        return status

    async def run(self, requests: Sequence[bytes], rate: float, seconds: float) -> dict[str, Any]:
        count = int(rate * seconds)
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        lag: list[float] = []
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.05

        async def one(i: int, scheduled: float) -> None:
            try:
                status = await self._request(requests[i % len(requests)])
            except (OSError, asyncio.IncompleteReadError, ValueError):
                status = -1
            statuses[status] = statuses.get(status, 0) + 1
            latencies.append(loop.time() - scheduled)

        tasks = []
        for i in range(count):
            scheduled = start + i / rate
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lag.append(max(0.0, loop.time() - scheduled))
            tasks.append(asyncio.create_task(one(i, scheduled)))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        return {"latencies": latencies, "statuses": statuses, "max_send_lag_ms": round(max(lag) * 1e3, 2)}


def http_requests(keys: Sequence[str]) -> list[bytes]:
    out = []
    for key in keys:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hi in one word."}]}).encode()
        out.append(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            + f"x-affinity-key: {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
    return out


async def _latency_rounds(ports: dict[str, int], requests: list[bytes], rate: float) -> dict[str, Any]:
    clients = {name: LoadClient(port, LOAD_CONNECTIONS) for name, port in ports.items()}
    for client in clients.values():
        await client.open()
        await client.run(requests, 200, 0.5)  # warm connections, caches and the router
    collected: dict[str, dict[str, Any]] = {n: {"latencies": [], "statuses": {}, "max_send_lag_ms": 0.0}
                                            for n in ports}
    for _ in range(ROUNDS):
        for name, client in clients.items():
            result = await client.run(requests, rate, ROUND_SECONDS)
            into = collected[name]
            into["latencies"].extend(result["latencies"])
            for status, n in result["statuses"].items():
                into["statuses"][status] = into["statuses"].get(status, 0) + n
            into["max_send_lag_ms"] = max(into["max_send_lag_ms"], result["max_send_lag_ms"])
    for client in clients.values():
        await client.close()
    return collected


def bench_envoy(router: RouterProcess, constant: str, upstreams: Sequence[str], workdir: Path) -> dict[str, Any]:
    started: list[Envoy] = []
    variants = {
        "no_ext_proc": GatewayOptions(with_ext_proc=False),
        # The floor for any grpc.aio ext_proc server here: constant replies, no routing.
        "ext_proc_constant_servicer": GatewayOptions(request_body_mode="NONE"),
        # Request headers and response headers go to the router (the response headers reply
        # keeps the stream, hence the in-flight count, open until the response).
        "ext_proc_headers_only": GatewayOptions(request_body_mode="NONE"),
        "ext_proc_buffered_body": GatewayOptions(request_body_mode="BUFFERED"),
    }
    out: dict[str, Any] = {"rounds": ROUNDS, "round_seconds": ROUND_SECONDS, "by_rate": {}}
    try:
        ports: dict[str, int] = {}
        for name, base in variants.items():
            port = free_port()
            options = GatewayOptions(
                listen_address="127.0.0.1", listen_port=port, request_body_mode=base.request_body_mode,
                with_ext_proc=base.with_ext_proc,
            )
            target = constant if name == "ext_proc_constant_servicer" else router.target
            started.append(start_envoy(gateway_bootstrap(target, upstreams, options), workdir=workdir,
                                       name=f"gateway-{name}"))
            ports[name] = port
        rng = np.random.default_rng(5)
        # Nine in ten requests carry a planned key, the rest an unplanned one.
        keys = [KEYS[int(i)] if i % 10 else f"stranger-{i}" for i in rng.integers(0, ROUTES, 2000)]
        requests = http_requests(keys)
        for rate in RATES:
            cpu_before = _cpu_seconds(router.process.pid)
            collected = asyncio.run(_latency_rounds(ports, requests, rate))
            router_cpu = _cpu_seconds(router.process.pid) - cpu_before
            out["by_rate"][str(int(rate))] = _latency_table(collected, router_cpu)
    finally:
        for envoy in reversed(started):
            envoy.stop()
    return out


def _latency_table(collected: dict[str, dict[str, Any]], router_cpu: float) -> dict[str, Any]:
    base_lat = np.asarray(collected["no_ext_proc"]["latencies"])
    table: dict[str, Any] = {"router_cpu_seconds": round(router_cpu, 2)}
    for name, result in collected.items():
        lat = np.asarray(result["latencies"])
        row: dict[str, Any] = {
            "requests": len(lat),
            "statuses": {str(k): v for k, v in sorted(result["statuses"].items())},
            "max_send_lag_ms": result["max_send_lag_ms"],
            "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
        }
        if name != "no_ext_proc":
            row["added_p50_ms"] = round(float(np.percentile(lat, 50) - np.percentile(base_lat, 50)) * 1e3, 3)
            row["added_p99_ms"] = round(float(np.percentile(lat, 99) - np.percentile(base_lat, 99)) * 1e3, 3)
            row["p50_ratio"] = round(float(np.percentile(lat, 50) / np.percentile(base_lat, 50)), 2)
            row["p99_ratio"] = round(float(np.percentile(lat, 99) / np.percentile(base_lat, 99)), 2)
        table[name] = row
    return table


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    results: dict[str, Any] = {
        "machine": {"python": sys.version.split()[0], "cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()]},
    }
    print("1/3 in-process decisions with a 200,000-route plan ...", flush=True)
    results["in_process"] = in_process = bench_in_process()
    print(f"    plan load (decode + index): {in_process['plan_load_ms']} ms")
    for name in ("pick_planned", "pick_unplanned", "pick_no_key", "ext_proc_message_planned"):
        s = in_process[name]
        print(f"    {name:26s} median {s['median_us']:7.2f} us  p99 {s['p99_us']:7.2f} us  (target median <= 20 us)")

    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        workdir = Path(tmp)
        upstreams = [f"127.0.99.{i + 1}:{free_port()}" for i in range(UPSTREAMS)]
        upstream_envoy = start_envoy(upstream_bootstrap(upstreams), workdir=workdir, name="upstreams")
        destinations = [Destination(f"bench-{i}", upstreams[i % UPSTREAMS]) for i in range(UPSTREAMS)]
        volume = PlanVolume(workdir / "plan")
        volume.publish(big_plan(destinations))
        router = start_router_process(
            ["--plan-dir", str(volume.path), "--scrape-interval", "0.5", "--log-level", "warning"],
            log=workdir / "router.log",
        )
        constant, constant_target = start_constant_server(workdir)
        try:
            print("2/3 decisions per second over gRPC (router in its own process) ...", flush=True)
            results["reload"] = reload = bench_reload(router, volume, destinations)
            print(f"    plan swap to effect (200,000 routes, poll 0.2 s): {reload['seconds']} s (target <= 1 s)")
            results["grpc"] = grpc_result = bench_grpc(router, constant, constant_target)
            baseline = grpc_result["baseline_constant_servicer"]
            print(f"    router:   {grpc_result['per_second']:.0f} decisions/s at concurrency {GRPC_CONCURRENCY} "
                  f"({grpc_result['decisions']} in {grpc_result['seconds']} s, {grpc_result['errors']} errors), "
                  f"server CPU {grpc_result['server_cpu_us_per_stream']} us/stream (target >= 3,000/s)")
            print(f"    baseline: {baseline['per_second']:.0f} streams/s for a constant-reply grpc.aio servicer, "
                  f"server CPU {baseline['server_cpu_us_per_stream']} us/stream; "
                  f"router/baseline {grpc_result['ratio_to_baseline']}x")
            print(f"3/3 latency through Envoy at {', '.join(str(int(r)) for r in RATES)} requests/s, {ROUNDS} "
                  f"interleaved rounds of {ROUND_SECONDS:.0f} s per variant ...", flush=True)
            results["envoy"] = envoy_result = bench_envoy(router, constant_target, upstreams, workdir)
        finally:
            constant.stop()
            router.stop()
            upstream_envoy.stop()
    for rate, table in envoy_result["by_rate"].items():
        base = table["no_ext_proc"]
        print(f"    {rate:>5s}/s no ext_proc              p50 {base['p50_ms']:8.3f} ms  p99 {base['p99_ms']:8.3f} ms  "
              f"{base['statuses']}")
        for name in ("ext_proc_constant_servicer", "ext_proc_headers_only", "ext_proc_buffered_body"):
            row = table[name]
            print(f"    {rate:>5s}/s {name:24s} p50 {row['p50_ms']:8.3f} ms  p99 {row['p99_ms']:8.3f} ms  "
                  f"added p50 {row['added_p50_ms']:+.3f} ms  p99 {row['added_p99_ms']:+.3f} ms  "
                  f"(p50 {row['p50_ratio']}x, p99 {row['p99_ratio']}x)  {row['statuses']}")
    at_1000 = envoy_result["by_rate"]["1000"]
    results["targets"] = {
        "decision_median_us<=20": in_process["pick_planned"]["median_us"] <= 20,
        "plan_in_effect_s<=1": results["reload"]["max_seconds"] <= 1.0,
        "grpc_decisions_per_s>=3000": grpc_result["per_second"] >= 3000,
        "added_p99_ms<=1_at_1000rps_buffered_body": at_1000["ext_proc_buffered_body"]["added_p99_ms"] <= 1.0,
        "added_p99_ms<=1_at_1000rps_headers_only": at_1000["ext_proc_headers_only"]["added_p99_ms"] <= 1.0,
    }
    results["generated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--constant-server":
        asyncio.run(_serve_constant(Path(sys.argv[2])))
    else:
        main()
