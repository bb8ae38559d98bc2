"""Fixtures for the AffinityPlan control loop on the sandbox: CRDs, fleet metrics scraped by the
sandbox Prometheus, engines, the operator process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.crds import apply_crds, load_crds
from tests.support.control import CRD_DIR, ControlEnv, FleetMetrics, OperatorProcess, start_operator
from tests.support.router import Engine, start_engine
from tests.support.sandbox import ScopedPrometheus

_subnet = iter(range(120, 250))


@pytest.fixture(scope="session")
def crds(sandbox: Sandbox) -> None:
    apply_crds(sandbox.api_client(), load_crds(CRD_DIR.glob("*.yaml")))


@pytest.fixture
def fleet_metrics(prometheus: ScopedPrometheus) -> Iterator[Callable[..., FleetMetrics]]:
    """`fleet_metrics(namespace, pool, routers=, engines=)`: exporters the sandbox Prometheus scrapes."""
    started: list[FleetMetrics] = []

    def start(namespace: str, pool: str, **options: Any) -> FleetMetrics:
        fleet = FleetMetrics(namespace, pool, **options)
        started.append(fleet)
        for job in fleet.jobs():
            prometheus.add_scrape_job(job)
        return fleet

    yield start
    for fleet in started:
        fleet.stop()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Two engines on their own loopback addresses (the pool's destinations)."""
    subnet = next(_subnet)
    started = [start_engine(f"127.0.{subnet}.{n + 2}") for n in range(2)]
    yield started
    for engine in started:
        engine.server.shutdown()
        engine.server.server_close()


@pytest.fixture
def operator(sandbox: Sandbox, tmp_path: Path) -> Iterator[Callable[..., OperatorProcess]]:
    """`operator(namespace, prometheus_url=...)`: the operator process, stopped afterwards."""
    started: list[OperatorProcess] = []

    def start(namespace: str, *, prometheus_url: str | None = None) -> OperatorProcess:
        op = start_operator(
            sandbox.kubeconfig, namespace, log=tmp_path / f"operator-{len(started)}.log", prometheus_url=prometheus_url
        )
        started.append(op)
        return op

    yield start
    for op in started:
        if op.alive():
            op.stop()


@pytest.fixture
def env(request: pytest.FixtureRequest) -> ControlEnv:
    request.getfixturevalue("crds")
    return ControlEnv(
        sandbox=request.getfixturevalue("sandbox"),
        api=request.getfixturevalue("kube_api"),
        namespace=request.getfixturevalue("namespace"),
        engines=request.getfixturevalue("engines"),
        tmp_path=request.getfixturevalue("tmp_path"),
        start_fleet=request.getfixturevalue("fleet_metrics"),
        start_operator=request.getfixturevalue("operator"),
    )
