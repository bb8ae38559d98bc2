"""The router pod as the operator builds it: `cacheroute router serve` and `cacheroute router envoy`
on one pod IP; Envoy's bootstrap is rendered for that IP and Envoy is exec'd from the wheel."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cacheroute.sandbox.process import ServerProcess, spawn, wait_until
from tests.support.router import Engine, start_engine

pytestmark = pytest.mark.integration


@pytest.fixture
def pod_ip() -> str:
    # A loopback address of its own, as the sandbox gives each pod; the fixed ports cannot clash.
    return f"127.5.{random.randint(1, 250)}.{random.randint(2, 250)}"


@pytest.fixture
def engine(pod_ip: str) -> Iterator[Engine]:
    started = start_engine(pod_ip.rsplit(".", 1)[0] + ".1")
    yield started
    started.server.shutdown()
    started.server.server_close()


def cacheroute(args: list[str], log: Path) -> ServerProcess:
    return spawn(log.stem, [sys.executable, "-m", "cacheroute.operator.cli.main", *args], log=log, detach=False)


def serving(pod_ip: str) -> bool:
    with grpc.insecure_channel(f"{pod_ip}:9002") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def test_router_pod_routes_http_through_envoy_and_fails_closed_without_the_picker(
    pod_ip: str, engine: Engine, tmp_path: Path
) -> None:
    picker = cacheroute(
        ["router", "serve", "--grpc-host", pod_ip, "--grpc-port", "9002", "--metrics-host", pod_ip,
         "--metrics-port", "9090", "--endpoints", engine.address, "--scrape-interval", "0.1", "--fallbacks", "0"],
        tmp_path / "picker.log",
    )
    envoy = cacheroute(
        ["router", "envoy", "--pod-ip", pod_ip, "--no-failure-mode-allow", "--concurrency", "1"],
        tmp_path / "envoy.log",
    )
    try:
        wait_until(lambda: serving(pod_ip), timeout=30, what="the picker's readiness", process=picker)
        wait_until(lambda: httpx.get(f"http://{pod_ip}:8081/ready", timeout=2).status_code == 200,
                   timeout=30, what="Envoy's /ready", process=envoy)
        reply = httpx.post(f"http://{pod_ip}:8080/v1/completions", json={"model": "m", "prompt": "hi", "user": "k1"},
                           timeout=10)
        assert reply.status_code == 200
        assert engine.count() == 1
        # A prompt past Envoy's own 1 MiB buffer is served too (routed by p2c), not refused with a 413.
        long_prompt = {"model": "m", "prompt": "x" * (6 << 20), "user": "k1"}
        assert httpx.post(f"http://{pod_ip}:8080/v1/completions", json=long_prompt, timeout=30).status_code == 200
        assert engine.count() == 2

        picker.stop()
        failed = httpx.post(f"http://{pod_ip}:8080/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
        assert failed.status_code >= 500
        assert engine.count() == 2
    finally:
        envoy.stop()
        picker.stop()
