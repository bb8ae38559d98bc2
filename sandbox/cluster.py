"""A whole simulated GPU cluster on one machine: control plane, fake H100 nodes, Prometheus.

`Sandbox.up()` starts etcd, kube-apiserver (TLS, RBAC, service-account keys),
kube-controller-manager, kube-scheduler, kwok with fake GPU nodes and Prometheus, all on free
loopback ports, and records them in `<state dir>/sandbox.json` so that `Sandbox.attach()` (and
`cacheroute sandbox down` / `status` from another process) find them again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml
from pydantic import BaseModel

from cacheroute.sandbox import network
from cacheroute.sandbox import nodes as fake_nodes
from cacheroute.sandbox import prometheus as prom
from cacheroute.sandbox.binaries import locate
from cacheroute.sandbox.envoy import Envoy, start_envoy
from cacheroute.sandbox.kubeconfig import write_kubeconfig
from cacheroute.sandbox.pki import CertificateAuthority, KeyPair, signing_keypair
from cacheroute.sandbox.pods import PodEndpoint, PodWatcher, running_pods
from cacheroute.sandbox.process import (
    ServerProcess,
    StartError,
    Stoppable,
    free_ports,
    pause_pid,
    paused,
    pid_runs,
    resume_pid,
    spawn,
    stop_all,
    stop_pid,
    wait_until,
)
from cacheroute.sandbox.runtime import kwok_stages
from cacheroute.sandbox.runtime.images import default_registry, parse_image_option

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

STATE_FILE = "sandbox.json"
# One file per server, written the moment it starts: `down` finds servers of an interrupted `up`.
PID_DIR = "pids"
STATE_ROOT_ENV = "CACHEROUTE_SANDBOX_HOME"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_API_IP = "10.96.0.1"
# Stopped in waves, each all at once: the API server's clients, then the API server, then etcd.
_LATE_STOPS = {"kube-apiserver": 1, "etcd": 2}

Reporter = Callable[[str], None]


def default_state_dir(name: str) -> Path:
    root = os.environ.get(STATE_ROOT_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "cacheroute" / "sandbox"
    return base / name


class ComponentRecord(BaseModel):
    name: str
    pid: int
    program: str
    log: str
    url: str | None = None
    health_url: str | None = None


class SandboxState(BaseModel):
    name: str
    state_dir: str
    kubeconfig: str
    api_server: str
    ca_file: str
    client_cert: str
    client_key: str
    prometheus_url: str | None = None
    prometheus_config: str | None = None
    pod_network: str = network.LOOPBACK_NETWORK
    # Whether this sandbox holds a claim on the host's local route of `pod_network` (see `network`).
    pod_network_routed: bool = False
    nodes: list[str]
    components: dict[str, ComponentRecord]
    started_at: float
    startup_seconds: float
    phases: dict[str, float]


@dataclass(frozen=True)
class PodRuntimeOptions:
    """Which pods the pod runtime serves (see `cacheroute.sandbox.runtime`); empty means all."""

    namespaces: tuple[str, ...] = ()
    namespace_selector: str = ""
    pod_selector: str = ""
    # REPOSITORY=COMMAND: more images whose containers run as a local command.
    images: tuple[str, ...] = ()
    restart_backoff_s: float = 1.0
    emulator_load_seconds: float | None = None

    def argv(self) -> list[str]:
        argv = [f"--namespace={n}" for n in self.namespaces]
        if self.namespace_selector:
            argv.append(f"--namespace-selector={self.namespace_selector}")
        if self.pod_selector:
            argv.append(f"--selector={self.pod_selector}")
        argv += [f"--image={i}" for i in self.images]
        argv.append(f"--restart-backoff={self.restart_backoff_s}")
        if self.emulator_load_seconds is not None:
            argv.append(f"--emulator-load-seconds={self.emulator_load_seconds}")
        return argv


@dataclass(frozen=True)
class SandboxOptions:
    name: str = "default"
    state_dir: Path | None = None
    nodes: int = 4
    prometheus: bool = True
    # Detached servers outlive the starting process (the CLI); attached ones die with it (tests).
    detach: bool = True
    timeout: float = 120.0
    # None: no pod runtime, kwok marks every pod ready as it always has.
    pod_runtime: PodRuntimeOptions | None = field(default_factory=PodRuntimeOptions)


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    running: bool
    healthy: bool
    url: str | None
    pid: int
    log: str
    paused: bool = False


class SandboxError(RuntimeError):
    """The sandbox cannot be started, found or stopped as asked."""


class Sandbox:
    """A handle on a started (or attached) sandbox."""

    def __init__(self, state: SandboxState, processes: Mapping[str, ServerProcess] | None = None) -> None:
        self.state = state
        self._processes = dict(processes or {})
        self._api_client: ApiClient | None = None

    # --- finding ---------------------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return Path(self.state.state_dir)

    @property
    def kubeconfig(self) -> Path:
        return Path(self.state.kubeconfig)

    @property
    def pod_network(self) -> network.PodNetwork:
        return network.PodNetwork(self.state.pod_network, self.state.pod_network_routed)

    @classmethod
    def attach(cls, state_dir: Path) -> Sandbox:
        state_file = state_dir / STATE_FILE
        if not state_file.is_file():
            raise SandboxError(f"no sandbox in {state_dir} (no {STATE_FILE}); start one with `cacheroute sandbox up`")
        return cls(SandboxState.model_validate_json(state_file.read_text()))

    def _save(self) -> None:
        staged = self.state_dir / (STATE_FILE + ".tmp")
        staged.write_text(self.state.model_dump_json(indent=2))
        os.replace(staged, self.state_dir / STATE_FILE)

    # --- clients ---------------------------------------------------------------------------------

    def api_client(self) -> ApiClient:
        """A `kubernetes` client authenticated as the sandbox's admin (system:masters)."""
        if self._api_client is None:
            from kubernetes import config

            self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    def tls_context(self) -> ssl.SSLContext:
        """TLS settings that trust the sandbox's CA and present the admin certificate."""
        context = ssl.create_default_context(cafile=self.state.ca_file)
        context.load_cert_chain(self.state.client_cert, self.state.client_key)
        return context

    @property
    def prometheus(self) -> prom.Prometheus:
        if self.state.prometheus_url is None or self.state.prometheus_config is None:
            raise SandboxError(f"sandbox {self.state.name!r} was started without Prometheus")
        return prom.Prometheus(self.state.prometheus_url, Path(self.state.prometheus_config))

    def env(self) -> dict[str, str]:
        """Environment for tools (kubectl, helm) that should talk to this sandbox."""
        return {**os.environ, "KUBECONFIG": self.state.kubeconfig}

    # --- pods ------------------------------------------------------------------------------------

    def running_pods(self, *, namespace: str | None = None, label_selector: str | None = None) -> list[PodEndpoint]:
        """Pods that kwok reports Running, each with its loopback pod IP."""
        return running_pods(self.api_client(), namespace=namespace, label_selector=label_selector)

    def watch_pods(
        self,
        on_running: Callable[[PodEndpoint], None],
        on_gone: Callable[[PodEndpoint], None] = lambda _ep: None,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
    ) -> PodWatcher:
        """Call `on_running` for every pod that runs (already or later) and `on_gone` when it stops.

        The watcher is started; stop it with `.stop()` or use it as a context manager.
        """
        return PodWatcher(
            self.api_client(), on_running, on_gone, namespace=namespace, label_selector=label_selector
        ).start()

    # --- extra servers ---------------------------------------------------------------------------

    def start_envoy(self, bootstrap: str | Mapping[str, Any], *, name: str = "envoy", detach: bool = False) -> Envoy:
        """Start an Envoy that `down` also stops; `name` must be unique in this sandbox."""
        if name in self.state.components:
            raise SandboxError(f"a component named {name!r} already runs in this sandbox")
        envoy = start_envoy(bootstrap, workdir=self.state_dir / "envoy", name=name, detach=detach)
        self.state.components[name] = ComponentRecord(
            name=name,
            pid=envoy.process.pid,
            program=envoy.process.program,
            log=str(envoy.process.log),
            url=envoy.admin_url,
            health_url=f"{envoy.admin_url}/ready",
        )
        self._processes[name] = envoy.process
        _write_pid_file(self.state_dir, envoy.process)
        self._save()
        return envoy

    def forget(self, name: str) -> None:
        """Stop component `name` (an Envoy, typically) and drop it from the state."""
        record = self.state.components.pop(name, None)
        if record is None:
            return
        stop_pid(record.pid, record.program, popen=self._process_popen(name))
        self._processes.pop(name, None)
        (self.state_dir / PID_DIR / f"{name}.pid").unlink(missing_ok=True)
        self._save()

    def _process_popen(self, name: str) -> subprocess.Popen[bytes] | None:
        process = self._processes.get(name)
        return process.popen if process is not None else None

    # --- status and stopping ---------------------------------------------------------------------

    def status(self) -> list[ComponentStatus]:
        try:
            context = self.tls_context()
        except (OSError, ssl.SSLError):  # certificates gone with a half-removed state directory
            context = ssl.create_default_context()
        rows = []
        for record in self.state.components.values():
            running = pid_runs(record.pid, record.program)
            stopped = running and paused(record.pid)
            healthy = running and not stopped and record.health_url is not None and _healthy(record.health_url, context)
            rows.append(ComponentStatus(record.name, running, healthy, record.url, record.pid, record.log, stopped))
        return rows

    def pause(self, name: str) -> bool:
        """Stop component `name` answering (SIGSTOP), as a hung server: a failure drill. False
        when it was paused already."""
        pid = self._running_component(name).pid
        if paused(pid):
            return False
        pause_pid(pid)
        return True

    def resume(self, name: str) -> bool:
        """Let a paused component run again (SIGCONT); False when it was not paused."""
        pid = self._running_component(name).pid
        if not paused(pid):
            return False
        resume_pid(pid)
        return True

    def _running_component(self, name: str) -> ComponentRecord:
        record = self.state.components.get(name)
        if record is None:
            raise SandboxError(f"no component {name!r} in this sandbox (it has {', '.join(self.state.components)})")
        if not pid_runs(record.pid, record.program):
            raise SandboxError(f"component {name} (pid {record.pid}) is not running")
        return record

    def down(self, *, keep_files: bool = False) -> None:
        """Stop every component, then remove the state directory (unless `keep_files`)."""
        if self._api_client is not None:
            self._api_client.close()
            self._api_client = None
        _stop_in_waves(
            {
                name: Stoppable(record.pid, record.program, self._process_popen(name))
                for name, record in self.state.components.items()
            }
        )
        stop_recorded(self.state_dir)
        network.release(self.state_dir, self.pod_network)
        if keep_files:
            self.state.components = {}
            self._save()
        else:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # --- starting --------------------------------------------------------------------------------

    @classmethod
    def up(cls, options: SandboxOptions | None = None, report: Reporter = lambda _msg: None) -> Sandbox:
        """Start a sandbox; on failure everything started is stopped and the error names the culprit."""
        options = options or SandboxOptions()
        if not 1 <= options.nodes <= fake_nodes.MAX_NODES:
            raise SandboxError(f"nodes={options.nodes} must be between 1 and {fake_nodes.MAX_NODES}")
        state_dir = options.state_dir or default_state_dir(options.name)
        _claim_state_dir(state_dir)
        starter = _Starter(options, state_dir, report)
        try:
            return starter.run()
        except BaseException:
            starter.abort()
            raise


def _write_pid_file(state_dir: Path, process: ServerProcess) -> None:
    directory = state_dir / PID_DIR
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{process.name}.pid").write_text(f"{process.pid}\n{process.program}\n")


def recorded_pids(state_dir: Path) -> dict[str, tuple[int, str]]:
    """Server name -> (pid, program) from the pid files of `state_dir`."""
    found = {}
    for path in sorted((state_dir / PID_DIR).glob("*.pid")):
        lines = path.read_text().splitlines()
        if len(lines) >= 2 and lines[0].isdigit():
            found[path.stem] = (int(lines[0]), lines[1])
    return found


def stop_recorded(state_dir: Path) -> list[str]:
    """Stop every server with a pid file in `state_dir`; returns the names of those that ran."""
    running = {
        name: Stoppable(pid, program)
        for name, (pid, program) in recorded_pids(state_dir).items()
        if pid_runs(pid, program)
    }
    _stop_in_waves(running)
    return sorted(running)


def shutdown(state_dir: Path, *, keep_files: bool = False) -> None:
    """Stop the sandbox of `state_dir`, also one whose `up` was interrupted before it finished."""
    if (state_dir / STATE_FILE).is_file():
        Sandbox.attach(state_dir).down(keep_files=keep_files)
    elif (state_dir / PID_DIR).is_dir():
        stop_recorded(state_dir)
        network.release(state_dir, network.PodNetwork(network.LOCAL_NETWORK, routed=True))
        if not keep_files:
            shutil.rmtree(state_dir, ignore_errors=True)
    else:
        raise SandboxError(f"no sandbox in {state_dir}")


def _stop_in_waves(targets: Mapping[str, Stoppable], timeout: float = 10.0) -> None:
    for wave in range(max(_LATE_STOPS.values()) + 1):
        stop_all([t for name, t in targets.items() if _LATE_STOPS.get(name, 0) == wave], timeout=timeout)


def _healthy(url: str, context: ssl.SSLContext) -> bool:
    try:
        return httpx.get(url, verify=context, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _claim_state_dir(state_dir: Path) -> None:
    running = [name for name, (pid, program) in recorded_pids(state_dir).items() if pid_runs(pid, program)]
    if running:
        raise SandboxError(
            f"a sandbox already runs from {state_dir} ({', '.join(running)}); "
            "stop it with `cacheroute sandbox down` first"
        )
    if (state_dir / STATE_FILE).is_file() or (state_dir / PID_DIR).is_dir():
        shutil.rmtree(state_dir)  # the remains of a sandbox whose servers are gone
    elif state_dir.exists() and any(state_dir.iterdir()):
        raise SandboxError(f"{state_dir} is not empty and holds no sandbox; choose another state directory")
    state_dir.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class _Pki:
    ca: Path
    ca_key: Path
    apiserver: tuple[Path, Path]
    admin: tuple[Path, Path]
    sa_key: Path
    sa_pub: Path
    controller_manager_serving: tuple[Path, Path]
    scheduler_serving: tuple[Path, Path]
    kwok_serving: tuple[Path, Path]
    client_files: dict[str, tuple[Path, Path]]
    clients: dict[str, KeyPair]
    ca_pem: bytes


def _write_pki(directory: Path) -> _Pki:
    directory.mkdir(parents=True, exist_ok=True)
    authority = CertificateAuthority()
    ca, ca_key = authority.keypair.write(directory, "ca")
    loopback = ("127.0.0.1",)
    apiserver = authority.issue(
        "kube-apiserver",
        dns_names=(
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ),
        ip_addresses=(*loopback, SERVICE_API_IP),
        server=True,
    ).write(directory, "apiserver")
    clients = {
        "admin": authority.issue("cacheroute-admin", organizations=("system:masters",), client=True),
        # The controllers share the manager's identity (see --use-service-account-credentials), so it
        # needs every controller's rights.
        "kube-controller-manager": authority.issue(
            "system:kube-controller-manager", organizations=("system:masters",), client=True
        ),
        "kube-scheduler": authority.issue("system:kube-scheduler", client=True),
        # kwok plays every kubelet; system:masters spares it a node-authorizer setup.
        "kwok": authority.issue("kwok", organizations=("system:masters",), client=True),
        # The pod runtime is the kubelet of the pods it runs (status, tokens, deletion).
        "pod-runtime": authority.issue("cacheroute-pod-runtime", organizations=("system:masters",), client=True),
        "prometheus": authority.issue("cacheroute-prometheus", organizations=("system:masters",), client=True),
        # How the API server presents itself to the kubelets (kwok) for logs.
        "kubelet-client": authority.issue(
            "kube-apiserver-kubelet-client", organizations=("system:masters",), client=True
        ),
    }
    admin = clients["admin"].write(directory, "admin")
    serving = {
        name: authority.issue(name, dns_names=("localhost",), ip_addresses=loopback, server=True).write(
            directory, f"{name}-serving"
        )
        for name in ("kube-controller-manager", "kube-scheduler", "kwok")
    }
    client_files = {
        name: clients[name].write(directory, name) for name in ("pod-runtime", "prometheus", "kubelet-client")
    }
    private, public = signing_keypair()
    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    sa_key.write_bytes(private)
    sa_key.chmod(0o600)
    sa_pub.write_bytes(public)
    return _Pki(
        ca=ca,
        ca_key=ca_key,
        apiserver=apiserver,
        admin=admin,
        sa_key=sa_key,
        sa_pub=sa_pub,
        controller_manager_serving=serving["kube-controller-manager"],
        scheduler_serving=serving["kube-scheduler"],
        kwok_serving=serving["kwok"],
        client_files=client_files,
        clients=clients,
        ca_pem=authority.keypair.cert_pem,
    )


class _Starter:
    """One start attempt: spawns the components in dependency order and waits for each."""

    def __init__(self, options: SandboxOptions, state_dir: Path, report: Reporter) -> None:
        self.options = options
        self.state_dir = state_dir
        self.report = report
        self.processes: dict[str, ServerProcess] = {}
        self.records: dict[str, ComponentRecord] = {}
        self.phases: dict[str, float] = {}
        self.started = time.monotonic()
        self.deadline = self.started + options.timeout
        self.network: network.PodNetwork | None = None

    def _remaining(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def _phase(self, name: str) -> None:
        self.phases[name] = round(time.monotonic() - self.started, 2)

    def _spawn(self, name: str, argv: list[str], url: str | None, health_url: str | None) -> ServerProcess:
        process = spawn(
            name, argv, log=self.state_dir / "logs" / f"{name}.log", detach=self.options.detach, cwd=self.state_dir
        )
        _write_pid_file(self.state_dir, process)
        self.processes[name] = process
        self.records[name] = ComponentRecord(
            name=name,
            pid=process.pid,
            program=process.program,
            log=str(process.log),
            url=url,
            health_url=health_url,
        )
        return process

    def _wait_http(
        self,
        process: ServerProcess,
        url: str,
        context: ssl.SSLContext | None = None,
        accept: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
    ) -> None:
        self.report(f"waiting for {process.name}")
        with httpx.Client(verify=context if context is not None else True, timeout=2.0) as client:
            wait_until(
                lambda: accept(client.get(url)), timeout=self._remaining(), what=url, process=process, interval=0.05
            )
        self._phase(f"{process.name} ready")

    def abort(self) -> None:
        _stop_in_waves({name: Stoppable(p.pid, p.program, p.popen) for name, p in self.processes.items()}, timeout=5.0)
        if self.network is not None:
            network.release(self.state_dir, self.network)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def run(self) -> Sandbox:
        binaries = {
            name: locate(name).path
            for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
        }
        prometheus_binary = locate("prometheus").path if self.options.prometheus else None
        names = ["etcd", "etcd-peer", "apiserver", "kcm", "scheduler", "kwok", "prometheus", "pod-runtime"]
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        pki = _write_pki(self.state_dir / "pki")
        self._phase("certificates")
        self.network, fallback = network.claim(self.state_dir)
        if fallback is not None:
            self.report(f"pod network: loopback ({fallback}); EndpointSlices will refuse pod addresses")
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(*map(str, pki.admin))

        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        self.report("starting etcd")
        etcd = self._spawn(
            "etcd", self._etcd_argv(binaries["etcd"], etcd_url, ports["etcd-peer"]), etcd_url, f"{etcd_url}/health"
        )
        prometheus_process = None
        api_url = f"https://127.0.0.1:{ports['apiserver']}"
        if prometheus_binary is not None:
            access = prom.KubernetesAccess(api_url, str(pki.ca), *map(str, pki.client_files["prometheus"]))
            prometheus_process = self._start_prometheus(prometheus_binary, ports["prometheus"], access)
        self._wait_http(
            etcd, f"{etcd_url}/health", accept=lambda r: r.status_code == 200 and r.json().get("health") == "true"
        )

        self.report("starting kube-apiserver")
        apiserver = self._spawn(
            "kube-apiserver",
            self._apiserver_argv(binaries["kube-apiserver"], pki, etcd_url, ports["apiserver"]),
            api_url,
            f"{api_url}/readyz",
        )
        network.set_owner(self.state_dir, apiserver.pid, apiserver.program)
        kubeconfigs = {
            user: write_kubeconfig(
                self.state_dir / f"{user}.kubeconfig", server=api_url, ca_pem=pki.ca_pem, client=keypair, user=user
            )
            for user, keypair in pki.clients.items()
        }
        admin_kubeconfig = self.state_dir / "kubeconfig"
        kubeconfigs["admin"].rename(admin_kubeconfig)
        self._wait_http(apiserver, f"{api_url}/readyz", context)

        self.report("starting controllers, scheduler and kwok")
        kcm_url = f"https://127.0.0.1:{ports['kcm']}"
        kcm = self._spawn(
            "kube-controller-manager",
            self._controller_manager_argv(
                binaries["kube-controller-manager"], pki, kubeconfigs["kube-controller-manager"], ports["kcm"]
            ),
            kcm_url,
            f"{kcm_url}/healthz",
        )
        scheduler_url = f"https://127.0.0.1:{ports['scheduler']}"
        scheduler = self._spawn(
            "kube-scheduler",
            self._scheduler_argv(binaries["kube-scheduler"], pki, kubeconfigs["kube-scheduler"], ports["scheduler"]),
            scheduler_url,
            f"{scheduler_url}/healthz",
        )
        kwok_url = f"http://127.0.0.1:{ports['kwok']}"
        kwok_config = self.state_dir / "kwok.yaml"
        kwok_config.write_text(self._kwok_config(ports["kwok"], pki))
        if self.options.pod_runtime is not None:
            self._install_logs_crd(api_url, context)
        kwok = self._spawn(
            "kwok",
            [str(binaries["kwok"]), f"--kubeconfig={kubeconfigs['kwok']}", f"--config={kwok_config}"],
            kwok_url,
            f"{kwok_url}/healthz",
        )

        runtime = None
        if self.options.pod_runtime is not None:
            runtime = self._start_pod_runtime(api_url, pki, ports["pod-runtime"], self.options.pod_runtime)
        sandbox = Sandbox(self._state(api_url, admin_kubeconfig, pki, ports), self.processes)
        # Plain REST rather than the kubernetes package: importing that takes seconds.
        with httpx.Client(base_url=api_url, verify=context, timeout=10.0) as api:
            sandbox.state.nodes = self._create_nodes(api)
            self._wait_http(kwok, f"{kwok_url}/healthz")
            self._wait_http(kcm, f"{kcm_url}/healthz", context)
            self._wait_http(scheduler, f"{scheduler_url}/healthz", context)
            self._wait_nodes_ready(api, sandbox.state.nodes, kwok)
            self._wait_default_service_account(api, kcm)
            if runtime is not None:
                self._wait_http(runtime, f"http://127.0.0.1:{ports['pod-runtime']}/healthz")
        if prometheus_process is not None:
            self._wait_http(prometheus_process, f"http://127.0.0.1:{ports['prometheus']}/-/ready")
        sandbox.state.startup_seconds = round(time.monotonic() - self.started, 2)
        sandbox.state.phases = dict(self.phases)
        sandbox.state.components = dict(self.records)
        sandbox._save()
        return sandbox

    def _state(self, api_url: str, kubeconfig: Path, pki: _Pki, ports: dict[str, int]) -> SandboxState:
        prometheus_url = f"http://127.0.0.1:{ports['prometheus']}" if self.options.prometheus else None
        return SandboxState(
            name=self.options.name,
            state_dir=str(self.state_dir),
            kubeconfig=str(kubeconfig),
            api_server=api_url,
            ca_file=str(pki.ca),
            client_cert=str(pki.admin[0]),
            client_key=str(pki.admin[1]),
            prometheus_url=prometheus_url,
            prometheus_config=str(self.state_dir / "prometheus.yml") if prometheus_url else None,
            pod_network=self.network.cidr if self.network else network.LOOPBACK_NETWORK,
            pod_network_routed=bool(self.network and self.network.routed),
            nodes=[],
            components=dict(self.records),
            started_at=time.time(),
            startup_seconds=0.0,
            phases={},
        )

    # --- command lines ---------------------------------------------------------------------------

    def _etcd_argv(self, binary: Path, url: str, peer_port: int) -> list[str]:
        peer = f"http://127.0.0.1:{peer_port}"
        argv = [
            str(binary),
            "--name=sandbox",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=sandbox={peer}",
            "--log-level=warn",
        ]
        if _supports_flag(binary, "--unsafe-no-fsync"):
            argv.append("--unsafe-no-fsync=true")
        return argv

    def _apiserver_argv(self, binary: Path, pki: _Pki, etcd_url: str, port: int) -> list[str]:
        return [
            str(binary),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={pki.ca.parent}",
            f"--tls-cert-file={pki.apiserver[0]}",
            f"--tls-private-key-file={pki.apiserver[1]}",
            f"--client-ca-file={pki.ca}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer=https://127.0.0.1:{port}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            "--event-ttl=1h",
            f"--kubelet-client-certificate={pki.client_files['kubelet-client'][0]}",
            f"--kubelet-client-key={pki.client_files['kubelet-client'][1]}",
            "--kubelet-preferred-address-types=InternalIP",
        ]

    @staticmethod
    def _component_argv(binary: Path, kubeconfig: Path, port: int, serving: tuple[Path, Path]) -> list[str]:
        """Flags every control-plane component shares: its identity, and a loopback serving port."""
        return [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--tls-cert-file={serving[0]}",
            f"--tls-private-key-file={serving[1]}",
            "--leader-elect=false",
            "--profiling=false",
        ]

    def _controller_manager_argv(self, binary: Path, pki: _Pki, kubeconfig: Path, port: int) -> list[str]:
        return [
            *self._component_argv(binary, kubeconfig, port, pki.controller_manager_serving),
            f"--root-ca-file={pki.ca}",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--cluster-signing-cert-file={pki.ca}",
            f"--cluster-signing-key-file={pki.ca_key}",
            # One token per controller (the production setting) costs seconds of start-up, one
            # TokenRequest after another; the controllers behave the same either way.
            "--use-service-account-credentials=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--cluster-name=cacheroute-sandbox",
        ]

    def _scheduler_argv(self, binary: Path, pki: _Pki, kubeconfig: Path, port: int) -> list[str]:
        return self._component_argv(binary, kubeconfig, port, pki.scheduler_serving)

    def _kwok_config(self, port: int, pki: _Pki) -> str:
        runtime = self.options.pod_runtime
        served = None
        if runtime is not None:
            extra = tuple(parse_image_option(option) for option in runtime.images)
            served = default_registry(extra).kwok_predicate()
        documents = [
            fake_nodes.kwok_configuration(
                server_port=port,
                tls=(str(pki.kwok_serving[0]), str(pki.kwok_serving[1])),
                enable_crds=("Logs",) if runtime is not None else (),
            )
        ]
        if served is not None:
            documents += kwok_stages.pod_stages(served)
        return yaml.safe_dump_all(documents, sort_keys=False)

    def _install_logs_crd(self, api_url: str, context: ssl.SSLContext) -> None:
        with httpx.Client(base_url=api_url, verify=context, timeout=10.0) as api:
            response = api.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=kwok_stages.logs_crd())
            if response.status_code not in (201, 409):
                raise StartError(f"installing kwok's Logs resource failed: {response.text}")

            def established() -> bool:
                crd = api.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/logs.kwok.x-k8s.io").json()
                conditions = crd.get("status", {}).get("conditions") or []
                return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

            wait_until(established, timeout=self._remaining(), what="kwok's Logs resource", interval=0.05)

    def _start_pod_runtime(self, api_url: str, pki: _Pki, port: int, options: PodRuntimeOptions) -> ServerProcess:
        self.report("starting the pod runtime")
        cert, key = pki.client_files["pod-runtime"]
        argv = [
            sys.executable,
            "-m",
            "cacheroute.sandbox.runtime",
            f"--state-dir={self.state_dir / 'runtime'}",
            f"--server={api_url}",
            f"--ca={pki.ca}",
            f"--cert={cert}",
            f"--key={key}",
            f"--health-address=127.0.0.1:{port}",
            *options.argv(),
        ]
        url = f"http://127.0.0.1:{port}"
        return self._spawn("pod-runtime", argv, url, f"{url}/healthz")

    def _start_prometheus(self, binary: Path, port: int, access: prom.KubernetesAccess) -> ServerProcess:
        self.report("starting prometheus")
        url = f"http://127.0.0.1:{port}"
        config = self.state_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(prom.base_config(f"127.0.0.1:{port}", access), sort_keys=False))
        argv = prom.command_line(binary, config=config, data=self.state_dir / "prometheus-data", port=port)
        return self._spawn("prometheus", argv, url, f"{url}/-/ready")

    # --- cluster contents ------------------------------------------------------------------------

    def _create_nodes(self, api: httpx.Client) -> list[str]:
        self.report(f"creating {self.options.nodes} fake GPU nodes")
        created = []
        for index in range(self.options.nodes):
            manifest = fake_nodes.node_manifest(index, network=self.network)
            response = api.post("/api/v1/nodes", json=manifest)
            if response.status_code != 201:
                raise StartError(f"creating node {manifest['metadata']['name']} failed: {response.text}")
            created.append(manifest["metadata"]["name"])
        return created

    def _wait_nodes_ready(self, api: httpx.Client, names: list[str], kwok: ServerProcess) -> None:
        self.report("waiting for the nodes to be Ready")

        def all_ready() -> bool:
            listed = api.get("/api/v1/nodes", params={"labelSelector": f"{fake_nodes.SANDBOX_NODE_LABEL}=true"})
            ready = {
                node["metadata"]["name"]
                for node in listed.json()["items"]
                if any(
                    c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", [])
                )
            }
            return ready >= set(names)

        wait_until(all_ready, timeout=self._remaining(), what="fake nodes Ready", process=kwok, interval=0.1)
        self._phase("nodes ready")

    def _wait_default_service_account(self, api: httpx.Client, kcm: ServerProcess) -> None:
        # Pods need their namespace's default ServiceAccount; its presence shows the controllers work.
        def exists() -> bool:
            return api.get("/api/v1/namespaces/default/serviceaccounts/default").status_code == 200

        wait_until(exists, timeout=self._remaining(), what="the default ServiceAccount", process=kcm, interval=0.1)
        self._phase("controllers ready")


def _supports_flag(binary: Path, flag: str) -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        result = subprocess.run([str(binary), "--help"], check=False, capture_output=True, text=True, timeout=10)
        return flag in result.stdout + result.stderr
    return False


def temporary_state_dir(prefix: str = "cacheroute-sandbox-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


__all__ = [
    "ComponentStatus",
    "Sandbox",
    "SandboxError",
    "SandboxOptions",
    "SandboxState",
    "StartError",
    "default_state_dir",
    "shutdown",
    "temporary_state_dir",
]
