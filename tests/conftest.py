"""Shared fixtures. The sandbox starts lazily, once per session, only when a test asks for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheroute.sandbox.cluster import Sandbox
from tests.support import sandbox as testing


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    """The session's cluster: control plane, 4 fake 8xH100 nodes, Prometheus."""
    with testing.session_sandbox() as started:
        yield started


@pytest.fixture
def kube_api(sandbox: Sandbox) -> Any:
    """A `kubernetes.client.ApiClient` for the sandbox's admin."""
    return sandbox.api_client()


@pytest.fixture
def namespace(sandbox: Sandbox, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards."""
    with testing.fresh_namespace(sandbox, request.node.name) as name:
        yield name


@pytest.fixture
def runtime_namespace(sandbox: Sandbox, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace whose pods the sandbox's pod runtime really runs; deleted afterwards."""
    with testing.fresh_namespace(sandbox, request.node.name, pod_runtime=True) as name:
        yield name


@pytest.fixture
def prometheus(sandbox: Sandbox) -> Iterator[testing.ScopedPrometheus]:
    """The sandbox's Prometheus; scrape jobs added by the test are removed afterwards."""
    with testing.scoped_prometheus(sandbox) as scoped:
        yield scoped


@pytest.fixture
def envoy(tmp_path: Path) -> Iterator[testing.EnvoyStarter]:
    """`envoy(bootstrap_yaml)` starts Envoy on a free admin port and waits for /ready."""
    with testing.envoy_starter(tmp_path / "envoy") as start:
        yield start
