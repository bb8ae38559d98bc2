"""Fixtures for the router's integration tests: engines, router processes, an Envoy gateway.

Envoy itself is started by the sandbox's launcher (the `envoy` fixture in tests/conftest.py) on
the router's own standalone bootstrap (`cacheroute.router.envoy.gateway_bootstrap`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from cacheroute.router.envoy import GatewayOptions, gateway_bootstrap
from cacheroute.sandbox.process import free_port
from tests.support.router import (
    Engine,
    Gateway,
    GatewayStarter,
    PlanVolume,
    RouterProcess,
    RouterStarter,
    start_engine,
    start_router_process,
)
from tests.support.sandbox import EnvoyStarter

_subnets = itertools.count()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Three engines, each on its own loopback address."""
    subnet = 40 + next(_subnets) % 200
    started = [start_engine(f"127.0.{subnet}.{n + 2}") for n in range(3)]
    yield started
    for engine in started:
        if engine.gate is not None:
            engine.gate.set()
        engine.server.shutdown()
        engine.server.server_close()


@pytest.fixture
def volume(tmp_path: Path) -> PlanVolume:
    return PlanVolume(tmp_path / "plan")


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[RouterStarter]:
    """`start_router(*args, wait_ready=True)`: `cacheroute router serve` with fast scraping plus `args`."""
    started: list[RouterProcess] = []

    def start(*args: str, wait_ready: bool = True) -> RouterProcess:
        router = start_router_process(
            ["--scrape-interval", "0.1", "--scrape-timeout", "0.5", "--log-level", "debug", *args],
            log=tmp_path / f"router-{len(started)}.log",
            wait_ready=wait_ready,
        )
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()


@pytest.fixture
def gateway(envoy: EnvoyStarter) -> GatewayStarter:
    """`gateway(router, engines, request_body_mode=...)`: an Envoy in front of them."""

    def start(router: RouterProcess | None, engines: Sequence[Engine], **options: Any) -> Gateway:
        listen = free_port()
        router_address = f"127.0.0.1:{router.grpc_port if router else free_port()}"
        config = gateway_bootstrap(
            router_address,
            [e.address for e in engines],
            GatewayOptions(listen_address="127.0.0.1", listen_port=listen, route_timeout="60s", **options),
        )
        proxy = envoy(config)
        return Gateway(f"http://127.0.0.1:{listen}", proxy.admin_url)

    return start
