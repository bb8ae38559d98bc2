"""Running the operator against the sandbox, as in production: a separate process, least RBAC.

- `operator_identity(sandbox)`: a ServiceAccount bound to a ClusterRole rendered from
  `cacheroute.operator.rbac` (the list the Helm chart uses) and a kubeconfig holding its token, so
  a permission missing from that list fails the tests;
- `OperatorProcess`: `cacheroute operator run -n <namespace>` in a subprocess, its JSON log parsed;
- pool helpers: apply, read, await conditions, and a cleanup that deletes pools while an operator
  still runs (kopf's finalizer needs one) before falling back to removing the finalizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from cacheroute.operator.api.common import GROUP, VERSION
from cacheroute.operator.rbac import cluster_role
from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.crds import apply_crds, load_crds
from cacheroute.sandbox.process import ServerProcess, free_port, spawn, wait_until

REPO = Path(__file__).resolve().parents[2]
IDENTITY_NAMESPACE = "cacheroute-system"
IDENTITY_NAME = "cacheroute-operator"
POOLS = "inferencepools"
# The sandbox's nodes carry the GPU taint only; routers must tolerate it there.
TEST_CONFIG: dict[str, Any] = {
    "router": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
}


def install_crds(sandbox: Sandbox) -> None:
    apply_crds(sandbox.api_client(), load_crds((REPO / "crds").glob("*.yaml")))


def operator_identity(sandbox: Sandbox, directory: Path) -> Path:
    """A kubeconfig for a ServiceAccount that holds exactly the operator's ClusterRole."""
    from kubernetes import client

    api = sandbox.api_client()
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    with contextlib.suppress(client.ApiException):
        core.create_namespace({"metadata": {"name": IDENTITY_NAMESPACE}})
    with contextlib.suppress(client.ApiException):
        core.create_namespaced_service_account(IDENTITY_NAMESPACE, {"metadata": {"name": IDENTITY_NAME}})
    role = cluster_role(IDENTITY_NAME)
    try:
        rbac.create_cluster_role(role)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        rbac.replace_cluster_role(IDENTITY_NAME, role)
    with contextlib.suppress(client.ApiException):
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": IDENTITY_NAME},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": IDENTITY_NAME},
                "subjects": [{"kind": "ServiceAccount", "name": IDENTITY_NAME, "namespace": IDENTITY_NAMESPACE}],
            }
        )
    token = core.create_namespaced_service_account_token(
        IDENTITY_NAME, IDENTITY_NAMESPACE, {"spec": {"expirationSeconds": 24 * 3600}}
    ).status.token
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "sandbox",
                "cluster": {"server": sandbox.state.api_server, "certificate-authority": sandbox.state.ca_file},
            }
        ],
        "users": [{"name": IDENTITY_NAME, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "sandbox", "user": IDENTITY_NAME}}],
        "current-context": "operator",
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    return path


def decoy_kubeconfig(directory: Path) -> Path:
    """A kubeconfig whose API server is nowhere (port 1 of loopback: nothing listens there)."""
    path = directory / "decoy.kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "decoy",
        "clusters": [{"name": "decoy", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "decoy", "user": {"token": "decoy"}}],
        "contexts": [{"name": "decoy", "context": {"cluster": "decoy", "user": "decoy"}}],
    }))
    return path


@dataclass
class OperatorProcess:
    """`cacheroute operator run` for one namespace."""

    namespace: str
    kubeconfig: Path
    workdir: Path
    name: str = "operator"
    priority: str = "auto"
    resync: float = 5.0
    status: float = 1.0
    identity: str | None = None
    extra: Sequence[str] = ()
    config: Mapping[str, Any] = field(default_factory=lambda: dict(TEST_CONFIG))
    process: ServerProcess | None = None
    health_port: int = 0

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self, *, wait: bool = True) -> OperatorProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / f"{self.name}-config.yaml"
        config.write_text(yaml.safe_dump(dict(self.config)))
        self.health_port = free_port()
        argv = [
            sys.executable, "-m", "cacheroute.operator.cli.main", "operator", "run",
            "-n", self.namespace,
            "--kubeconfig", str(self.kubeconfig),
            "--config", str(config),
            "--health-address", f"127.0.0.1:{self.health_port}",
            "--priority", self.priority,
            "--resync-interval", str(self.resync),
            "--status-interval", str(self.status),
            *self.extra,
        ]
        # A decoy in the variable: the operator must reach the cluster through --kubeconfig alone,
        # kopf's watches included (`cacheroute.operator.credentials`).
        env = {**os.environ, "KUBECONFIG": str(decoy_kubeconfig(self.workdir))}
        if self.identity:
            env["POD_ID"] = self.identity
        self.process = spawn(self.name, argv, log=self.log, env=env, detach=False)
        if wait:
            wait_until(self.healthy, timeout=60, what=f"{self.name} /healthz", process=self.process)
        return self

    def healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def stop(self) -> None:
        if self.process is not None and self.process.alive():
            self.process.stop(timeout=20)

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when a node dies."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        if self.process.popen is not None:
            self.process.popen.wait(timeout=10)

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines() if self.log.exists() else []:
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out

    def events(self, reason: str, pool: str | None = None) -> list[dict[str, Any]]:
        return [
            r for r in self.records()
            if r.get("event_reason") == reason and (pool is None or r.get("pool") == pool)
        ]


# --- pools ---------------------------------------------------------------------------------------


def pool_manifest(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferencePool", "metadata": {"name": name}, "spec": dict(spec)}


LLAMA_70B_FP8_TP2: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "fp8"},
    "tensorParallelSize": 2,
    "replicas": 4,
}


class Pools:
    """InferencePools of one namespace through the admin client."""

    def __init__(self, sandbox: Sandbox, namespace: str) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.api = client.CustomObjectsApi(sandbox.api_client())
        self.core = client.CoreV1Api(sandbox.api_client())
        self.apps = client.AppsV1Api(sandbox.api_client())

    def create(self, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.api.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, POOLS, pool_manifest(name, spec)
        )
        return out

    def patch_spec(self, name: str, spec: Mapping[str, Any]) -> None:
        self.api.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, POOLS, name, {"spec": dict(spec)})

    def get(self, name: str) -> dict[str, Any] | None:
        from kubernetes import client

        try:
            out: dict[str, Any] = self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, POOLS, name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return out

    def names(self) -> list[str]:
        listing = self.api.list_namespaced_custom_object(GROUP, VERSION, self.namespace, POOLS)
        return [item["metadata"]["name"] for item in listing.get("items", [])]

    def delete(self, name: str) -> None:
        from kubernetes import client

        with contextlib.suppress(client.ApiException):
            self.api.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, POOLS, name)

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        pool = self.get(name) or {}
        for cond in (pool.get("status") or {}).get("conditions") or []:
            if cond.get("type") == kind:
                return dict(cond)
        return None

    def await_condition(
        self, name: str, kind: str, status: str, reason: str | None = None, *, timeout: float = 90.0
    ) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def check() -> bool:
            cond = self.condition(name, kind)
            if cond and cond.get("status") == status and (reason is None or cond.get("reason") == reason):
                found[:] = [cond]
                return True
            return False

        try:
            wait_until(check, timeout=timeout, what=f"{name} {kind}={status} ({reason})", interval=0.2)
        except Exception as exc:
            raise AssertionError(f"{exc}; last {kind}: {self.condition(name, kind)}") from None
        return found[0]

    def await_status(
        self, name: str, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = 90.0
    ) -> None:
        wait_until(lambda: check((self.get(name) or {}).get("status") or {}), timeout=timeout, what=what, interval=0.2)

    def remove_all(self, timeout: float = 60.0) -> None:
        """Delete every pool and wait until gone; an operator must be running to release the finalizers."""
        for name in self.names():
            self.delete(name)
        with contextlib.suppress(Exception):
            wait_until(lambda: not self.names(), timeout=timeout, what="pools deleted", interval=0.2)
        for name in self.names():  # no operator left to release them
            with contextlib.suppress(Exception):
                self.api.patch_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, POOLS, name, {"metadata": {"finalizers": []}}
                )


@contextlib.contextmanager
def running_operator(
    namespace: str, kubeconfig: Path, workdir: Path, **kwargs: Any
) -> Iterator[OperatorProcess]:
    operator = OperatorProcess(namespace=namespace, kubeconfig=kubeconfig, workdir=workdir, **kwargs).start()
    try:
        yield operator
    finally:
        operator.stop()


def until(check: Callable[[], bool], what: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    wait_until(check, timeout=timeout, what=what, interval=interval)


def sleep_observing(seconds: float, check: Callable[[], None], interval: float = 0.2) -> None:
    """Call `check` (which asserts) for `seconds`: a property that must hold throughout, not a wait."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        check()
        time.sleep(interval)


def observe_until(
    done: Callable[[], bool], invariant: Callable[[], None], what: str, timeout: float = 120.0, interval: float = 0.1
) -> None:
    """Await `done()` while asserting `invariant()` at every look: a property that holds all along."""
    deadline = time.monotonic() + timeout
    while not done():
        invariant()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
