"""Fixtures of the operator's integration tests: CRDs, the operator's least-RBAC identity, a running operator."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cacheroute.sandbox.cluster import Sandbox
from tests.support.operator import OperatorProcess, Pools, install_crds, operator_identity


@pytest.fixture(scope="session")
def operator_kubeconfig(sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CRDs installed, and a kubeconfig holding exactly the operator's ClusterRole."""
    install_crds(sandbox)
    return operator_identity(sandbox, tmp_path_factory.mktemp("operator-identity"))


@pytest.fixture
def pools(sandbox: Sandbox, namespace: str) -> Pools:
    return Pools(sandbox, namespace)


@dataclass
class Fleet:
    operator: OperatorProcess
    pools: Pools
    namespace: str


@pytest.fixture
def fleet(operator_kubeconfig: Path, pools: Pools, namespace: str, tmp_path: Path) -> Iterator[Fleet]:
    """One operator serving the test's namespace; its pools are deleted before it stops."""
    operator = OperatorProcess(namespace=namespace, kubeconfig=operator_kubeconfig, workdir=tmp_path).start()
    try:
        yield Fleet(operator, pools, namespace)
    finally:
        pools.remove_all()
        operator.stop()
