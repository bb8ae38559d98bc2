"""One served pod, from its IP to its deletion: volumes, containers, probes, status.

The lifecycle follows the kubelet's:
1. kwok gives the pod an IP and phase Running (see `kwok_stages`); the runtime writes the pod's
   volumes (retrying while a ConfigMap or Secret is missing: the container waits in
   ContainerCreating);
2. each container runs under a supervisor: environment and command line resolved at every
   start, a log file per run, startup then readiness and liveness probes, and restarts per the
   pod's `restartPolicy` with an exponential back-off (`CrashLoopBackOff`) and `restartCount`;
3. the pod's status (container states, `Ready`/`ContainersReady`, phase) is patched whenever it
   changes; readiness gates are honoured;
4. on deletion: preStop hooks, SIGTERM, the grace period, SIGKILL; then the pod object is removed
   (grace period 0), as the kubelet's status manager does.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cacheroute.sandbox.emulator.args import EmulatorArgsError
from cacheroute.sandbox.emulator.host import container_emulator
from cacheroute.sandbox.runtime import podenv
from cacheroute.sandbox.runtime.containers import (
    ContainerStartError,
    EmulatorRun,
    Mount,
    ProcessRun,
    Run,
)
from cacheroute.sandbox.runtime.images import ImageDriver
from cacheroute.sandbox.runtime.kube import ApiError, until_reached, worth_retrying
from cacheroute.sandbox.runtime.logs import LogFile
from cacheroute.sandbox.runtime.probes import ProbeSpec, ProbeState
from cacheroute.sandbox.runtime.reported import status_shows
from cacheroute.sandbox.runtime.volumes import PodVolumes

if TYPE_CHECKING:
    from cacheroute.sandbox.runtime.kubelet import PodRuntime

log = logging.getLogger("cacheroute.sandbox.runtime")

Obj = dict[str, Any]
# A container that ran this long without failing starts its back-off afresh (as the kubelet's).
_BACKOFF_RESET_S = 600.0
_DEFAULT_GRACE_S = 30.0
_RETRY_CONFIG_S = 1.0


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _local_command(driver: ImageDriver | None, argv: list[str]) -> list[str]:
    """`argv` with a first word naming the image's entry point replaced by the local command
    standing for it (a container's command, an exec hook's)."""
    if driver is not None and argv and os.path.basename(argv[0]) == (driver.entrypoint_name or None):
        return [*driver.entrypoint, *argv[1:]]
    return argv


def _existing_dir(path: object, fallback: Path) -> Path:
    """The container's working directory when it exists on this machine, else the pod's directory."""
    candidate = Path(str(path)) if path else fallback
    return candidate if candidate.is_dir() else fallback


def _exit_reason(code: int) -> str:
    return "Completed" if code == 0 else "Error"


@dataclass
class ContainerSlot:
    """One container of the pod and what the kubelet reports about it."""

    spec: Obj
    driver: ImageDriver | None
    restarts: int = 0
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Obj = field(default_factory=dict)
    started: bool = False
    ready: bool = False
    run: Run | None = None
    container_id: str = ""
    log_path: Path | None = None
    previous_log: Path | None = None
    exec_prefix: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.spec.get("name", ""))

    @property
    def image(self) -> str:
        return str(self.spec.get("image", ""))

    def ports(self) -> dict[str, int]:
        return {str(p["name"]): int(p["containerPort"]) for p in self.spec.get("ports") or [] if p.get("name")}

    def status(self) -> Obj:
        status: Obj = {
            "name": self.name,
            "image": self.image,
            "imageID": self.image,
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restarts,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


class PodWorker:
    """Runs one pod for the runtime."""

    def __init__(self, runtime: PodRuntime, pod: Obj) -> None:
        self.runtime = runtime
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.directory = runtime.state_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid}"
        self.slots = [
            ContainerSlot(spec=c, driver=runtime.registry.driver(c.get("image")))
            for c in pod["spec"].get("containers") or []
        ]
        self._changed = asyncio.Event()
        self._volumes_dirty = asyncio.Event()
        self._status_dirty = asyncio.Event()
        self.terminating = asyncio.Event()
        self.gone = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._conditions: dict[str, Obj] = {}
        self._patched: Obj | None = None
        self.volumes: PodVolumes | None = None
        self._forget_listener: Callable[[], None] | None = None
        self._watching = False
        self.finished = asyncio.Event()
        # Set when the runtime itself stops: containers get at most this grace, the pod object stays.
        self.shutdown_grace: float | None = None

    # -- inputs from the watch --------------------------------------------------------------------

    @property
    def pod_ip(self) -> str:
        return str(self.pod.get("status", {}).get("podIP") or "")

    def update(self, pod: Obj) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.terminating.set()
        self._changed.set()
        self._status_dirty.set()

    def shutdown(self, grace: float) -> None:
        self.shutdown_grace = grace
        self.terminating.set()
        self._changed.set()

    def deleted(self) -> None:
        """The pod object is gone (force-deleted, or our own final deletion)."""
        self.gone = True
        self.terminating.set()
        self._changed.set()

    # -- the main line ------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        except Exception:
            log.exception("pod %s/%s: the runtime failed", self.namespace, self.name)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._forget_listener is not None:
                self._forget_listener()
            if self._watching:
                self.runtime.cache.release_namespace(self.namespace)
            if self.volumes is not None:
                self.volumes.remove()
            self.finished.set()

    async def _run(self) -> None:
        while not self.pod_ip and not self.terminating.is_set():
            self._changed.clear()
            await self._changed.wait()
        if self.terminating.is_set():
            await self._remove()
            return
        self._tasks.append(asyncio.create_task(self._status_loop(), name=f"status {self.name}"))
        self._watching = True
        await self.runtime.cache.watch_namespace(self.namespace)
        self.volumes = PodVolumes(self.pod, self.directory / "volumes", self.runtime.cache.lookup, self._token)
        refs = self.volumes.references()
        self._forget_listener = self.runtime.cache.listen(
            lambda kind, ns, name: self._volumes_dirty.set() if (kind, ns, name) in refs else None
        )
        if not await self._first_volumes():
            await self._terminate()
            return
        self._tasks.append(asyncio.create_task(self._volume_loop(), name=f"volumes {self.name}"))
        supervisors = [asyncio.create_task(self._supervise(slot), name=f"container {slot.name}") for slot in self.slots]
        self._tasks.extend(supervisors)
        await self.terminating.wait()
        await self._terminate()

    async def _first_volumes(self) -> bool:
        assert self.volumes is not None
        while not self.terminating.is_set():
            # Cleared before reading: a change that lands during the render is seen next time.
            self._volumes_dirty.clear()
            try:
                await self.volumes.render()
                return True
            except (podenv.ConfigError, ApiError) as exc:
                self._waiting_all("ContainerCreating", f"MountVolume.SetUp failed: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._volumes_dirty.wait(), _RETRY_CONFIG_S)
        return False

    def _waiting_all(self, reason: str, message: str) -> None:
        for slot in self.slots:
            if "waiting" in slot.state:
                slot.state = {"waiting": {"reason": reason, "message": message}}
        self._status_dirty.set()

    async def _token(self, account: str, audience: str, seconds: int) -> Any:
        return await self.runtime.token(self.pod, account, audience, seconds)

    async def _volume_loop(self) -> None:
        assert self.volumes is not None
        while True:
            refresh = self.volumes.next_refresh()
            timeout = None if refresh is None else max(0.5, refresh - time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._volumes_dirty.wait(), timeout)
            self._volumes_dirty.clear()
            try:
                await self.volumes.render()
            except (podenv.ConfigError, ApiError) as exc:
                log.warning("pod %s/%s: volumes not updated: %s", self.namespace, self.name, exc)

    # -- containers -----------------------------------------------------------------------------

    def _mounts(self, slot: ContainerSlot, env: Mapping[str, str]) -> list[Mount]:
        assert self.volumes is not None
        mounts = []
        for mount in slot.spec.get("volumeMounts") or []:
            source = self.volumes.path(str(mount.get("name", "")))
            sub = mount.get("subPath") or (
                podenv.expand(str(mount["subPathExpr"]), env) if mount.get("subPathExpr") else ""
            )
            if sub:
                source = source / str(sub)
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            mounts.append(Mount(source, str(mount.get("mountPath", "")), bool(mount.get("readOnly"))))
        return mounts

    async def _start(self, slot: ContainerSlot, log_file: LogFile) -> Run:
        driver = slot.driver
        env = podenv.container_env(self.pod, slot.spec, self.runtime.cache.lookup, self.runtime.service_env)
        env.setdefault("HOSTNAME", self.name)
        slot.env = env
        if driver is not None and driver.kind == "emulator":
            try:
                emulator = container_emulator(
                    [podenv.expand(str(p), env) for p in slot.spec.get("command") or []] or None,
                    [podenv.expand(str(p), env) for p in slot.spec.get("args") or []],
                    {**self.runtime.emulator_env, **env},
                    self.pod_ip,
                    log=log_file.line,
                )
            except EmulatorArgsError as exc:
                log_file.line(f"ERROR {exc}", "stderr")
                raise ContainerStartError(str(exc)) from None
            slot.exec_prefix = None
            return EmulatorRun(emulator, log_file)
        entrypoint = list(driver.entrypoint) if driver is not None else []
        argv = _local_command(driver, podenv.command_line(slot.spec, env, entrypoint))
        if not argv:
            raise ContainerStartError("no command to run (the image's entry point is unknown here)")
        process_env = {**self.runtime.base_env, **(driver.env if driver is not None else {}), **env}
        if driver is not None:
            podenv.map_python_path(process_env, driver.python_paths)
        mounts = self._mounts(slot, env)
        working_dir = _existing_dir(slot.spec.get("workingDir"), self.directory)
        run = await ProcessRun.start(argv, env=process_env, cwd=working_dir, mounts=mounts, log=log_file)
        slot.exec_prefix = ["nsenter", f"--target={run.pid}", "--mount", "--"] if mounts else []
        slot.env = process_env
        return run

    async def _stub(self, slot: ContainerSlot) -> None:
        """A container of an image the runtime does not know: reported running, as kwok would, never run."""
        slot.state = {"running": {"startedAt": now_rfc3339()}}
        slot.started = slot.ready = True
        self._status_dirty.set()
        await self.terminating.wait()
        slot.ready = False
        slot.state = {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now_rfc3339()}}

    async def _supervise(self, slot: ContainerSlot) -> None:
        if slot.driver is None:
            await self._stub(slot)
            return
        backoff = self.runtime.restart_backoff
        policy = self.pod["spec"].get("restartPolicy", "Always")
        while not self.terminating.is_set():
            log_path = self.directory / "logs" / slot.name / f"{slot.restarts}.log"
            log_file = LogFile(log_path)
            slot.previous_log, slot.log_path = slot.log_path, log_path
            try:
                slot.run = await self._start(slot, log_file)
            except podenv.ConfigError as exc:
                log_file.close()
                slot.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                self._status_dirty.set()
                await self._sleep_or_terminate(_RETRY_CONFIG_S)
                continue
            except (ContainerStartError, OSError) as exc:
                if not isinstance(exc, ContainerStartError):
                    log.exception("pod %s/%s: container %s did not start", self.namespace, self.name, slot.name)
                log_file.close()
                started = now_rfc3339()
                code = 1 if slot.driver is not None and slot.driver.kind == "emulator" else 128
                slot.state = {
                    "terminated": {
                        "exitCode": code, "reason": "StartError" if code == 128 else "Error",
                        "message": str(exc), "startedAt": started, "finishedAt": started,
                    }
                }
                ran_for = 0.0
            else:
                started_at = time.monotonic()
                slot.container_id = f"cacheroute://{self.uid}-{slot.name}-{slot.restarts}"
                slot.state = {"running": {"startedAt": now_rfc3339()}}
                slot.started = slot.ready = False
                self._status_dirty.set()
                await self.runtime.publish_logs(self)
                await self.runtime.event(self.pod, "Started", f"Started container {slot.name}")
                probes = asyncio.create_task(self._probe(slot), name=f"probes {slot.name}")
                started = slot.state["running"]["startedAt"]
                code = await slot.run.wait()
                probes.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probes
                ran_for = time.monotonic() - started_at
                slot.state = {
                    "terminated": {
                        "exitCode": code, "reason": _exit_reason(code), "startedAt": started,
                        "finishedAt": now_rfc3339(), "containerID": slot.container_id,
                    }
                }
            slot.run = None
            slot.started = slot.ready = False
            self._status_dirty.set()
            if self.terminating.is_set():
                return
            code = int(slot.state["terminated"]["exitCode"])
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                self._changed.set()
                return
            if ran_for >= _BACKOFF_RESET_S:
                backoff = self.runtime.restart_backoff
            slot.last_state = slot.state
            slot.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {backoff:.0f}s restarting failed container={slot.name} pod={self.name}",
                }
            }
            slot.restarts += 1
            self._status_dirty.set()
            await self.runtime.event(
                self.pod, "BackOff", f"Back-off restarting failed container {slot.name}", kind="Warning"
            )
            await self._sleep_or_terminate(backoff)
            backoff = min(backoff * 2, self.runtime.max_restart_backoff)

    async def _sleep_or_terminate(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.terminating.wait(), seconds)

    async def _probe(self, slot: ContainerSlot) -> None:
        """Startup, then readiness and liveness, for one run of the container."""
        spec = slot.spec
        started = time.monotonic()
        startup = ProbeSpec.parse(spec.get("startupProbe"), kind="startup")
        if startup is not None and not await self._until_verdict(slot, startup, "Startup", started):
            await self._kill(slot, "failed startup probe")
            return
        slot.started = True
        self._status_dirty.set()
        readiness = ProbeSpec.parse(spec.get("readinessProbe"), kind="readiness")
        liveness = ProbeSpec.parse(spec.get("livenessProbe"), kind="liveness")
        loops: list[Awaitable[None]] = []
        if readiness is None:
            slot.ready = True
            self._status_dirty.set()
        else:
            loops.append(self._readiness(slot, readiness, started))
        if liveness is not None:
            loops.append(self._liveness(slot, liveness, started))
        if loops:
            await asyncio.gather(*loops)

    async def _attempt(self, slot: ContainerSlot, spec: ProbeSpec) -> tuple[bool, str]:
        command = (spec.handler.get("exec") or {}).get("command")
        if command:
            local = _local_command(slot.driver, [str(part) for part in command])
            spec = replace(spec, handler={**spec.handler, "exec": {"command": local}})
        return await self.runtime.prober.attempt(
            spec, self.pod_ip, slot.ports(), exec_in=slot.exec_prefix, env=slot.env
        )

    async def _wait_initial(self, spec: ProbeSpec, started: float) -> None:
        delay = spec.initial_delay - (time.monotonic() - started)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _until_verdict(self, slot: ContainerSlot, spec: ProbeSpec, kind: str, started: float) -> bool:
        await self._wait_initial(spec, started)
        state = ProbeState(spec)
        while True:
            ok, message = await self._attempt(slot, spec)
            verdict = state.record(ok)
            if not ok:
                await self.runtime.event(self.pod, "Unhealthy", f"{kind} probe failed: {message}", kind="Warning")
            if verdict is not None:
                return verdict
            await asyncio.sleep(spec.period)

    async def _readiness(self, slot: ContainerSlot, spec: ProbeSpec, started: float) -> None:
        await self._wait_initial(spec, started)
        state = ProbeState(spec, initial=False)
        while True:
            ok, message = await self._attempt(slot, spec)
            ready = bool(state.record(ok))
            if ready != slot.ready:
                slot.ready = ready
                self._status_dirty.set()
                if not ready:
                    await self.runtime.event(
                        self.pod, "Unhealthy", f"Readiness probe failed: {message}", kind="Warning"
                    )
            await asyncio.sleep(spec.period)

    async def _liveness(self, slot: ContainerSlot, spec: ProbeSpec, started: float) -> None:
        await self._wait_initial(spec, started)
        state = ProbeState(spec, initial=True)
        while True:
            ok, message = await self._attempt(slot, spec)
            if state.record(ok) is False:
                await self.runtime.event(self.pod, "Unhealthy", f"Liveness probe failed: {message}", kind="Warning")
                await self._kill(slot, "failed liveness probe, will be restarted")
                return
            await asyncio.sleep(spec.period)

    async def _kill(self, slot: ContainerSlot, why: str) -> None:
        await self.runtime.event(self.pod, "Killing", f"Container {slot.name} {why}")
        run = slot.run
        if run is not None:
            await self._pre_stop(slot)
            await run.stop(self._grace())

    # -- termination ----------------------------------------------------------------------------

    def _grace(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        value = meta.get("deletionGracePeriodSeconds")
        if value is None:
            value = spec.get("terminationGracePeriodSeconds", _DEFAULT_GRACE_S)
        grace = float(value if value is not None else _DEFAULT_GRACE_S)
        return grace if self.shutdown_grace is None else min(grace, self.shutdown_grace)

    async def _pre_stop(self, slot: ContainerSlot) -> None:
        hook = (slot.spec.get("lifecycle") or {}).get("preStop")
        if not hook:
            return
        if "sleep" in hook:
            await asyncio.sleep(float(hook["sleep"].get("seconds", 0)))
            return
        spec = ProbeSpec(hook, 0.0, 1.0, self._grace(), 1, 1)
        await self._attempt(slot, spec)

    async def _terminate(self) -> None:
        """Stop every container (preStop, SIGTERM, grace, SIGKILL), then remove the pod object."""
        grace = 2.0 if self.gone else self._grace()
        for slot in self.slots:
            slot.ready = False
        self._status_dirty.set()

        async def stop(slot: ContainerSlot) -> None:
            run = slot.run
            if run is None:
                return
            await self.runtime.event(self.pod, "Killing", f"Stopping container {slot.name}")
            deadline = time.monotonic() + grace
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pre_stop(slot), grace)
            await run.stop(max(0.0, deadline - time.monotonic()))

        await asyncio.gather(*(stop(slot) for slot in self.slots))
        supervisors = [task for task in self._tasks if task.get_name().startswith("container ")]
        # A supervisor that failed must not keep the pod from being removed.
        for outcome in await asyncio.gather(*supervisors, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.error("pod %s/%s: a container's supervisor failed: %r", self.namespace, self.name, outcome)
        if self.shutdown_grace is not None:
            return
        # A pod must not stay Terminating because the API server hung or failed when it ended:
        # the last status and the removal are tried again until it takes them, as a kubelet does.
        await self._flush_status_until_taken()
        await self._remove()

    async def _remove(self) -> None:
        if self.gone or self.shutdown_grace is not None:
            return
        await until_reached(lambda: self.runtime.remove_pod(self.pod), f"pod {self.namespace}/{self.name}: not removed")

    # -- status ---------------------------------------------------------------------------------

    def _condition(self, kind: str, true: bool, reason: str | None = None) -> Obj:
        status = "True" if true else "False"
        previous = self._conditions.get(kind)
        if previous is None or previous["status"] != status:
            previous = {"type": kind, "status": status, "lastTransitionTime": now_rfc3339()}
            if reason and not true:
                previous["reason"] = reason
            self._conditions[kind] = previous
        return previous

    def status(self) -> Obj:
        gates = [g.get("conditionType") for g in self.pod["spec"].get("readinessGates") or []]
        present = {c.get("type"): c.get("status") for c in self.pod.get("status", {}).get("conditions") or []}
        containers_ready = bool(self.slots) and all(s.ready for s in self.slots)
        ready = containers_ready and all(present.get(g) == "True" for g in gates)
        conditions = [
            self._condition("ContainersReady", containers_ready, "ContainersNotReady"),
            self._condition("Ready", ready, "ContainersNotReady" if not containers_ready else "ReadinessGatesNotReady"),
        ]
        terminated = [s.state["terminated"] for s in self.slots if "terminated" in s.state]
        phase = "Running"
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if self.slots and len(terminated) == len(self.slots) and policy != "Always":
            codes = [int(t.get("exitCode", 0)) for t in terminated]
            if policy == "Never" or all(c == 0 for c in codes):
                phase = "Succeeded" if all(c == 0 for c in codes) else "Failed"
        return {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": [s.status() for s in self.slots],
        }

    async def _status_loop(self) -> None:
        while True:
            await self._status_dirty.wait()
            self._status_dirty.clear()
            await self._flush_status_until_taken()

    async def _flush_status_until_taken(self) -> None:
        await until_reached(self._flush_status, f"pod {self.namespace}/{self.name}: status not patched")

    async def _flush_status(self) -> None:
        """Patch the pod's status if it changed; raises only what is worth trying again."""
        if self.gone:
            return
        status = self.status()
        # What was patched may have been written over since (a stale kwok stage): the pod as
        # observed decides, not the memory of the last patch.
        if status == self._patched and status_shows(self.pod.get("status") or {}, status):
            return
        try:
            await self.runtime.patch_status(self.pod, status)
        except ApiError as exc:
            if worth_retrying(exc):
                raise
            if exc.status not in (404, 409):
                log.warning("pod %s/%s: status not patched: %s", self.namespace, self.name, exc)
            return
        self._patched = status
