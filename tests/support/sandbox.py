"""Test helpers behind the pytest fixtures in tests/conftest.py.

One sandbox serves a whole test session. Set `CACHEROUTE_TEST_SANDBOX` to the state directory of
a sandbox started with `cacheroute sandbox up` to reuse it (faster edit-test loops); otherwise a
fresh one is started in a temporary directory and stopped at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from cacheroute.sandbox import nativecopy
from cacheroute.sandbox.cluster import PodRuntimeOptions, Sandbox, SandboxOptions, temporary_state_dir
from cacheroute.sandbox.envoy import Envoy, start_envoy
from cacheroute.sandbox.process import wait_until
from cacheroute.sandbox.prometheus import Prometheus, ScrapeJob

REUSE_ENV = "CACHEROUTE_TEST_SANDBOX"
NAMESPACE_LABEL = "cacheroute.dev/test"
# The session's pod runtime runs the pods of namespaces with this label only; elsewhere pods of
# the CacheRoute and vLLM images are marked ready at once, as kwok marks every other pod.
RUNTIME_LABEL = "cacheroute.dev/pod-runtime"
TEST_RUNTIME = PodRuntimeOptions(namespace_selector=f"{RUNTIME_LABEL}=enabled", restart_backoff_s=0.5)


@contextlib.contextmanager
def session_sandbox(nodes: int = 4) -> Iterator[Sandbox]:
    reuse = os.environ.get(REUSE_ENV)
    if reuse:
        yield Sandbox.attach(Path(reuse).expanduser())
        return
    # The routers the operator starts run the compiled request path, as the image's do.
    nativecopy.ensure()
    sandbox = Sandbox.up(
        SandboxOptions(
            name="pytest", state_dir=temporary_state_dir(), nodes=nodes, detach=False, pod_runtime=TEST_RUNTIME
        )
    )
    try:
        yield sandbox
    finally:
        sandbox.down()


def _dns_label(text: str, limit: int = 40) -> str:
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].rstrip("-")
    return label or "test"


@contextlib.contextmanager
def fresh_namespace(
    sandbox: Sandbox, test_name: str, timeout: float = 30.0, *, pod_runtime: bool = False
) -> Iterator[str]:
    """A new namespace (named after the test) with its default ServiceAccount; deleted afterwards.

    With `pod_runtime`, the sandbox's pod runtime really runs the namespace's pods.
    """
    from kubernetes import client

    core = client.CoreV1Api(sandbox.api_client())
    labels = {NAMESPACE_LABEL: "true"}
    if pod_runtime:
        labels[RUNTIME_LABEL] = "enabled"
    created = core.create_namespace({"metadata": {"generateName": f"{_dns_label(test_name)}-", "labels": labels}})
    name: str = created.metadata.name
    try:
        # Pod admission needs the ServiceAccount that the controller manager adds.
        wait_until(
            lambda: bool(core.list_namespaced_service_account(name).items),
            timeout=timeout,
            what=f"the default ServiceAccount of namespace {name}",
        )
        yield name
    finally:
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(name, propagation_policy="Background")


class EnvoyStarter(Protocol):
    def __call__(self, bootstrap: str | Mapping[str, Any], *, name: str = ...) -> Envoy: ...


@contextlib.contextmanager
def envoy_starter(workdir: Path) -> Iterator[EnvoyStarter]:
    """A function that starts Envoys (stopped when the context ends)."""
    started: list[Envoy] = []

    def start(bootstrap: str | Mapping[str, Any], *, name: str = "") -> Envoy:
        envoy = start_envoy(bootstrap, workdir=workdir, name=name or f"envoy-{len(started)}")
        started.append(envoy)
        return envoy

    try:
        yield start
    finally:
        for envoy in started:
            envoy.stop()


class ScopedPrometheus(Prometheus):
    """The sandbox Prometheus; the scrape jobs a test adds are removed when it ends."""

    def __init__(self, base: Prometheus) -> None:
        super().__init__(base.url, base.config_path)
        self.added: list[str] = []

    def add_scrape_job(self, job: ScrapeJob) -> None:
        super().add_scrape_job(job)
        self.added.append(job.name)

    def close(self) -> None:
        for name in self.added:
            self.remove_scrape_job(name)
        self.added.clear()


@contextlib.contextmanager
def scoped_prometheus(sandbox: Sandbox) -> Iterator[ScopedPrometheus]:
    scoped = ScopedPrometheus(sandbox.prometheus)
    try:
        yield scoped
    finally:
        scoped.close()


def wait_for(
    check: Callable[[], bool], *, timeout: float = 30.0, what: str = "condition", interval: float = 0.1
) -> None:
    """Poll `check()` until true (exceptions count as not yet); fail with `what` after `timeout`."""
    wait_until(check, timeout=timeout, what=what, interval=interval)
