"""Fixtures for the AffinityPlan control loop on the sandbox: CRDs, the operator's least-RBAC
identity, fleet metrics scraped by the sandbox Prometheus, the test's environment."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheroute.sandbox.cluster import Sandbox
from tests.support.control import ControlEnv, FleetMetrics
from tests.support.operator import install_crds, operator_identity
from tests.support.sandbox import ScopedPrometheus


@pytest.fixture(scope="session")
def operator_kubeconfig(sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CRDs installed, and a kubeconfig holding exactly the operator's ClusterRole."""
    install_crds(sandbox)
    return operator_identity(sandbox, tmp_path_factory.mktemp("operator-identity"))


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
def env(request: pytest.FixtureRequest) -> Iterator[ControlEnv]:
    environment = ControlEnv(
        sandbox=request.getfixturevalue("sandbox"),
        api=request.getfixturevalue("kube_api"),
        namespace=request.getfixturevalue("namespace"),
        tmp_path=request.getfixturevalue("tmp_path"),
        operator_kubeconfig=request.getfixturevalue("operator_kubeconfig"),
        start_fleet=request.getfixturevalue("fleet_metrics"),
    )
    try:
        yield environment
    finally:
        environment.close()
