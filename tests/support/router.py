"""Helpers for tests and benchmarks of the router, behind the pytest fixtures.

- `Engine`: an HTTP server on its own loopback address (127.0.0.x) that records what it
  receives and serves a vLLM-style /metrics whose queue gauges the caller sets;
- `PlanVolume`: a directory laid out and updated like a kubelet ConfigMap volume;
- `RouterProcess`: `cacheroute router serve` in a subprocess, waited for over gRPC health;
- direct ext_proc calls (`exchange`), for checks that need no Envoy.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cacheroute.planner.plan import Destination, KeyExtraction, Plan, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import encode_plan
from cacheroute.planner.routing import DEFAULT_SPILL_THRESHOLD
from cacheroute.sandbox.process import ServerProcess, free_port, spawn, wait_until

# --- engines ---------------------------------------------------------------------------------------


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Engine:
    """A stand-in for one vLLM replica on `host` (its own loopback address)."""

    host: str
    server: ThreadingHTTPServer = field(repr=False)
    received: list[Received] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    metrics_ok: bool = True
    # Announce a longer /metrics body than is sent, then close (a response cut short).
    metrics_truncated: bool = False
    # While set, requests wait for it to be released (to keep them in flight).
    gate: threading.Event | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.server.server_address[1]}"

    def count(self) -> int:
        with self.lock:
            return len(self.received)

    def keys(self, header: str = "x-affinity-key") -> list[str]:
        with self.lock:
            return [r.headers.get(header, "") for r in self.received]

    def metrics_text(self) -> str:
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {float(self.running)}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {float(self.waiting)}\n'
        )


def _handler(engine_ref: list[Engine]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            engine = engine_ref[0]
            if self.path == "/metrics":
                if engine.metrics_truncated:
                    body = engine.metrics_text().encode()
                    self.send_response(200)
                    self.send_header("content-type", "text/plain; version=0.0.4")
                    self.send_header("content-length", str(len(body) + 100))
                    self.end_headers()
                    self.wfile.write(body)
                    self.close_connection = True
                    return
                if engine.metrics_ok:
                    self._reply(200, engine.metrics_text().encode(), "text/plain; version=0.0.4")
                else:
                    self._reply(503, b"not ready\n", "text/plain")
                return
            self._serve(b"")

        def do_POST(self) -> None:
            self._serve(self._body())

        def _body(self) -> bytes:
            # Envoy streams a body it may mutate (full-duplex ext_proc) with chunked encoding.
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                parts: list[bytes] = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(self.headers.get("content-length") or 0)
            return self.rfile.read(length) if length else b""

        def _serve(self, body: bytes) -> None:
            engine = engine_ref[0]
            headers = {k.lower(): v for k, v in self.headers.items()}
            with engine.lock:
                engine.received.append(Received(self.command, self.path, headers, body))
            gate = engine.gate
            if gate is not None:
                gate.wait(30)
            reply = {"served_by": engine.address, "usage": {"prompt_tokens": 7, "completion_tokens": 1}}
            self._reply(200, json.dumps(reply).encode())

        def log_message(self, format: str, *args: object) -> None:  # keep test output clean
            pass

    return Handler


def start_engine(host: str) -> Engine:
    ref: list[Engine] = []
    server = ThreadingHTTPServer((host, 0), _handler(ref))
    server.daemon_threads = True
    engine = Engine(host=host, server=server)
    ref.append(engine)
    threading.Thread(target=server.serve_forever, name=f"engine-{host}", daemon=True).start()
    return engine


# --- plans -----------------------------------------------------------------------------------------


def make_plan(
    engines: Sequence[Engine],
    routes: Mapping[str, Sequence[int]],
    *,
    spill_threshold: float = DEFAULT_SPILL_THRESHOLD,
    key_extraction: KeyExtraction | None = None,
) -> Plan:
    """A plan routing clear keys to engines (by index)."""
    destinations = [Destination(f"pool-{i}", e.address) for i, e in enumerate(engines)]
    return plan_from_routes(
        "pool",
        destinations,
        {affinity_key_hash(k): [f"pool-{i}" for i in idx] for k, idx in routes.items()},
        spill_threshold=spill_threshold,
        key_extraction=key_extraction or KeyExtraction(),
    )


class PlanVolume:
    """A directory laid out like a kubelet ConfigMap volume, updated by swapping `..data`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self._generation = itertools.count()

    def publish_files(self, files: dict[str, bytes]) -> None:
        stamp = self.path / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{next(self._generation)}"
        stamp.mkdir()
        for name, data in files.items():
            (stamp / name).write_bytes(data)
        staged = self.path / "..data_tmp"
        if staged.is_symlink():
            staged.unlink()
        staged.symlink_to(stamp.name)
        os.replace(staged, self.path / "..data")
        for name in files:
            link = self.path / name
            if not link.is_symlink():
                link.symlink_to(Path("..data") / name)

    def publish(self, plan: Plan) -> str:
        payload = encode_plan(plan)
        self.publish_files(payload.files)
        return payload.version


# --- the router ------------------------------------------------------------------------------------


@dataclass
class RouterProcess:
    grpc_port: int
    metrics_port: int
    process: ServerProcess

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def health(self, service: str) -> int:
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)

    def ready(self) -> bool:
        return self.health("readiness") == int(health_pb2.HealthCheckResponse.SERVING)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def sample(self, name: str, **labels: str) -> float:
        """The value of one series on /metrics (0 when absent)."""
        return metric_value(self.metrics(), name, **labels)

    def stop(self) -> None:
        self.process.stop()


def metric_value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def start_router_process(
    args: Sequence[str], *, log: Path, env: dict[str, str] | None = None, wait_ready: bool = True,
    prefix: Sequence[str] = (), timeout: float = 30,
) -> RouterProcess:
    """Run `cacheroute router serve` on free loopback ports; returns once it is ready (or alive).
    `prefix` runs it under another program (a profiler), given `timeout` seconds to get ready."""
    grpc_port, metrics_port = free_port(), free_port()
    argv = [
        *prefix, sys.executable, "-m", "cacheroute.router.cli", "serve",
        "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
        *args,
    ]
    process = spawn(log.stem, argv, log=log, env={**os.environ, **(env or {})}, detach=False)
    router = RouterProcess(grpc_port, metrics_port, process)
    serving = health_pb2.HealthCheckResponse.SERVING
    check = router.ready if wait_ready else (lambda: router.health("liveness") == serving)
    try:
        wait_until(check, timeout=timeout, what="router readiness over gRPC health", process=process)
    except BaseException:
        process.stop()
        raise
    return router


# --- speaking ext_proc directly ------------------------------------------------------------------


def headers_request(key: str | None, subset: list[str] | None = None) -> pb.ProcessingRequest:
    values = [base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")]
    if key is not None:
        values.append(base_pb2.HeaderValue(key="x-affinity-key", raw_value=key.encode()))
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=True)
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        request.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return request


def exchange(router: RouterProcess, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
    with grpc.insecure_channel(router.target) as channel:
        stream = pb_grpc.ExternalProcessorStub(channel).Process(iter([request]), timeout=5)
        return next(iter(stream))


def destination(response: pb.ProcessingResponse) -> tuple[str, str]:
    """(header value, metadata value) of a headers reply."""
    common = response.request_headers.response
    assert common.clear_route_cache
    (option,) = common.header_mutation.set_headers
    assert option.header.key == "x-gateway-destination-endpoint"
    metadata = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return option.header.raw_value.decode(), metadata["x-gateway-destination-endpoint"].string_value


# --- waiting ---------------------------------------------------------------------------------------


def await_condition(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll `check` (exceptions count as not yet) until it holds; fail naming `what` after `timeout`."""
    wait_until(check, timeout=timeout, what=what, interval=0.05)


@dataclass
class Gateway:
    """An Envoy in front of the router: where clients send requests, and its admin interface."""

    url: str
    admin_url: str


RouterStarter = Callable[..., RouterProcess]
GatewayStarter = Callable[..., Gateway]
