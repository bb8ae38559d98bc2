"""The router pod as the operator builds it: `cacheroute router serve` and `cacheroute router envoy`
on one pod IP; Envoy's bootstrap is rendered for that IP and Envoy is exec'd from the wheel."""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

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


@pytest.fixture
def run_dir() -> Iterator[Path]:
    # The pod's emptyDir for Envoy's admin socket: a Unix socket path must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="cr-run-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


def scrape(pod_ip: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The picker's /metrics: each family's samples, by the family's name."""
    text = httpx.get(f"http://{pod_ip}:9090/metrics", timeout=5).text
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def ingress_replies(families: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    """Envoy's client listener's replies by status class ("2", "4", "5")."""
    samples = families.get("envoy_http_downstream_rq_xx", [])
    return {labels["envoy_response_code_class"]: value for labels, value in samples
            if labels.get("envoy_http_conn_manager_prefix") == "ingress"}


def test_the_pickers_metrics_serve_envoys_statistics_and_say_when_envoy_is_gone(
    pod_ip: str, engine: Engine, tmp_path: Path, run_dir: Path
) -> None:
    socket = run_dir / "envoy-admin.sock"
    picker = cacheroute(
        ["router", "serve", "--grpc-host", pod_ip, "--grpc-port", "9002", "--metrics-host", pod_ip,
         "--metrics-port", "9090", "--endpoints", engine.address, "--scrape-interval", "0.1", "--fallbacks", "0",
         "--envoy-admin-socket", str(socket)],
        tmp_path / "picker.log",
    )
    envoy = cacheroute(
        ["router", "envoy", "--pod-ip", pod_ip, "--no-failure-mode-allow", "--concurrency", "1",
         "--admin-socket", str(socket), "--max-request-bytes", str(1 << 20)],
        tmp_path / "envoy.log",
    )
    try:
        wait_until(lambda: serving(pod_ip), timeout=30, what="the picker's readiness", process=picker)
        wait_until(lambda: httpx.get(f"http://{pod_ip}:8081/ready", timeout=2).status_code == 200,
                   timeout=30, what="Envoy's /ready", process=envoy)
        # Its bootstrap beside the socket, in the pod's emptyDir: it goes with the pod.
        assert (run_dir / f"cacheroute-envoy-{pod_ip}.yaml").is_file()
        # Every statistic is there from Envoy's start, at 0: the first 413 is counted by `rate`.
        assert ingress_replies(scrape(pod_ip)) == {"1": 0, "2": 0, "3": 0, "4": 0, "5": 0}
        url = f"http://{pod_ip}:8080/v1/completions"
        for _ in range(2):
            assert httpx.post(url, json={"model": "m", "prompt": "hi", "user": "k1"}, timeout=10).status_code == 200
        # Refused by Envoy itself: the picker never sees it, only Envoy's statistics count it.
        too_big = {"model": "m", "prompt": "x" * (2 << 20), "user": "k1"}
        assert httpx.post(url, json=too_big, timeout=30).status_code == 413
        counted = (2.0, 1.0, 0.0)
        wait_until(lambda: tuple(ingress_replies(scrape(pod_ip)).get(c, 0.0) for c in "245") == counted,
                   timeout=10, what="Envoy's replies (two 200s, one 413) on the picker's /metrics")
        families = scrape(pod_ip)
        assert families["cacheroute_router_envoy_up"] == [({}, 1.0)]
        # The picker decided the two it saw, and not the one Envoy refused.
        assert sum(value for _, value in families["cacheroute_router_decisions"]) == 2
        # Envoy gone: the picker's own series are still served, at once, and say so.
        envoy.stop()
        started = time.monotonic()
        families = scrape(pod_ip)
        assert time.monotonic() - started < 3
        assert families["cacheroute_router_envoy_up"] == [({}, 0.0)]
        assert not [name for name in families if name.startswith("envoy_")]
        assert "cacheroute_router_decisions" in families
    finally:
        envoy.stop()
        picker.stop()
