"""The pod runtime: watches the pods of the fake nodes and serves those of registered images.

Every pod bound to a sandbox node whose containers use a registered image (and that no Job owns)
is the runtime's: kwok only gives it an address (see `kwok_stages`). Within the runtime's scope
(namespaces, a namespace label selector, a pod label selector) the runtime runs it
(`pod.PodWorker`); outside, it does what kwok does for every other pod: marks it ready at once,
and removes it at once when it is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from cacheroute.sandbox.emulator.args import ENV_LOAD_SECONDS
from cacheroute.sandbox.nodes import SANDBOX_NODE_LABEL
from cacheroute.sandbox.runtime import podenv
from cacheroute.sandbox.runtime.cache import ObjectCache
from cacheroute.sandbox.runtime.containers import mount_namespace_problem
from cacheroute.sandbox.runtime.images import ImageDriver, ImageRegistry, default_registry
from cacheroute.sandbox.runtime.kube import (
    ApiError,
    Credentials,
    KubeClient,
    list_and_watch,
    until_reached,
    worth_retrying,
)
from cacheroute.sandbox.runtime.pod import PodWorker, now_rfc3339
from cacheroute.sandbox.runtime.probes import Prober
from cacheroute.sandbox.runtime.reported import status_shows
from cacheroute.sandbox.runtime.selectors import parse_selector
from cacheroute.sandbox.runtime.volumes import Token, decode_token_status

log = logging.getLogger("cacheroute.sandbox.runtime")

Obj = dict[str, Any]
LOGS_API = "/apis/kwok.x-k8s.io/v1alpha1"
# Containers get this much time at most to stop when the runtime itself shuts down.
SHUTDOWN_GRACE_S = 5.0
_EVENT_REPEAT_S = 5.0


@dataclass(frozen=True)
class RuntimeOptions:
    state_dir: Path
    credentials: Credentials
    api_host: str
    api_port: int
    namespaces: tuple[str, ...] = ()
    namespace_selector: str = ""
    pod_selector: str = ""
    images: tuple[ImageDriver, ...] = ()
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 60.0
    emulator_load_seconds: float | None = None
    health_address: tuple[str, int] | None = None
    kwok_logs: bool = True
    node_label: str = SANDBOX_NODE_LABEL


@dataclass
class _Passthrough:
    removing: bool = False


def _ready_status(pod: Obj) -> Obj:
    """Every container running and ready, as kwok's default stage reports."""
    now = now_rfc3339()
    return {
        "conditions": [
            {"type": kind, "status": "True", "lastTransitionTime": now} for kind in ("ContainersReady", "Ready")
        ],
        "containerStatuses": [
            {
                "name": c["name"], "image": c.get("image", ""), "imageID": c.get("image", ""),
                "ready": True, "started": True, "restartCount": 0, "state": {"running": {"startedAt": now}},
            }
            for c in pod["spec"].get("containers") or []
        ],
    }


@dataclass
class PodRuntime:
    options: RuntimeOptions
    registry: ImageRegistry = field(init=False)
    client: KubeClient = field(init=False)
    cache: ObjectCache = field(init=False)
    prober: Prober = field(init=False)

    def __post_init__(self) -> None:
        self.registry = default_registry(self.options.images)
        self.state_dir = self.options.state_dir
        self.restart_backoff = self.options.restart_backoff_s
        self.max_restart_backoff = self.options.max_restart_backoff_s
        self.service_env = podenv.service_variables(self.options.api_host, self.options.api_port)
        venv_bin = str(Path(sys.executable).parent)
        self.base_env = {
            "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
        }
        self.emulator_env = (
            {ENV_LOAD_SECONDS: str(self.options.emulator_load_seconds)}
            if self.options.emulator_load_seconds is not None
            else {}
        )
        self._workers: dict[str, PodWorker] = {}
        self._worker_tasks: dict[str, asyncio.Task[None]] = {}
        self._passthrough: dict[str, _Passthrough] = {}
        self._finished: set[str] = set()
        self._nodes: set[str] = set()
        self._namespace_labels: dict[str, dict[str, str]] = {}
        self._in_namespace = parse_selector(self.options.namespace_selector)
        self._in_pods = parse_selector(self.options.pod_selector)
        self._events: dict[tuple[str, str, str], float] = {}
        self._posting: set[asyncio.Task[None]] = set()
        self._removing: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.synced = asyncio.Event()

    # -- scope ------------------------------------------------------------------------------------

    async def _is_sandbox_node(self, name: str) -> bool:
        # Asked of the API server for every node not yet known: a node added a moment ago must
        # not be missed for lack of a fresh listing (its pods would never be served).
        if name in self._nodes:
            return True
        node = await self.client.get_or_none(f"/api/v1/nodes/{name}")
        if node is None or (node["metadata"].get("labels") or {}).get(self.options.node_label) != "true":
            return False
        self._nodes.add(name)
        return True

    async def _labels_of_namespace(self, namespace: str) -> dict[str, str]:
        labels = self._namespace_labels.get(namespace)
        if labels is None:
            obj = await self.client.get_or_none(f"/api/v1/namespaces/{namespace}")
            labels = dict((obj or {}).get("metadata", {}).get("labels") or {})
            self._namespace_labels[namespace] = labels
        return labels

    async def in_scope(self, pod: Obj) -> bool:
        meta = pod["metadata"]
        namespace = meta["namespace"]
        if self.options.namespaces and namespace not in self.options.namespaces:
            return False
        if self.options.namespace_selector and not self._in_namespace(await self._labels_of_namespace(namespace)):
            return False
        return self._in_pods(meta.get("labels") or {})

    # -- the watch --------------------------------------------------------------------------------

    async def _on_namespace(self, kind: str, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self._namespace_labels.pop(name, None)
        else:
            self._namespace_labels[name] = dict(obj["metadata"].get("labels") or {})

    async def _on_pod(self, kind: str, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            self._passthrough.pop(uid, None)
            self._finished.discard(uid)
            worker = self._workers.get(uid)
            if worker is not None:
                worker.deleted()
            return
        worker = self._workers.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        if uid in self._finished:
            # A kubelet keeps removing what it ran: a pod whose worker ended without removing it
            # (the worker failed) must not stay Terminating for good.
            if pod["metadata"].get("deletionTimestamp"):
                self._remove_later(pod)
            return
        if uid in self._passthrough and self._passthrough[uid].removing:
            return
        node = pod.get("spec", {}).get("nodeName")
        if not node or not self.registry.served(pod) or not await self._is_sandbox_node(node):
            return
        if uid in self._passthrough or not await self.in_scope(pod):
            await self._pass_through(uid, pod)
            return
        worker = PodWorker(self, pod)
        self._workers[uid] = worker
        worker.update(pod)
        task = asyncio.create_task(worker.run(), name=f"pod {worker.namespace}/{worker.name}")
        self._worker_tasks[uid] = task
        task.add_done_callback(functools.partial(self._worker_done, uid))
        log.info("running pod %s/%s", worker.namespace, worker.name)

    def _worker_done(self, uid: str, _task: object = None) -> None:
        worker = self._workers.pop(uid, None)
        self._worker_tasks.pop(uid, None)
        if worker is not None and not worker.gone:
            self._finished.add(uid)

    async def _pass_through(self, uid: str, pod: Obj) -> None:
        """What kwok does for a pod the runtime does not run: ready at once, removed at once."""
        state = self._passthrough.setdefault(uid, _Passthrough())
        if pod["metadata"].get("deletionTimestamp"):
            state.removing = True
            self._remove_later(pod)
            return
        observed = pod.get("status") or {}
        if not observed.get("podIP"):
            return
        status = _ready_status(pod)
        # Checked against the pod as observed, not against a flag: a stale kwok stage can write
        # "not ready" over the report once more.
        if status_shows(observed, status):
            return
        with contextlib.suppress(ApiError):
            await self.patch_status(pod, status)

    # -- services for the workers ---------------------------------------------------------------

    async def patch_status(self, pod: Obj, status: Obj) -> None:
        meta = pod["metadata"]
        await self.client.patch(
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            {"metadata": {"uid": meta["uid"]}, "status": status},
        )

    async def remove_pod(self, pod: Obj) -> None:
        """Delete the pod object for good (grace period 0), finalizers first, as kwok does."""
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        try:
            if meta.get("finalizers"):
                await self.client.patch(
                    path, {"metadata": {"uid": meta["uid"], "finalizers": None}}, kind="merge-patch"
                )
            await self.client.delete(
                path,
                {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                 "preconditions": {"uid": meta["uid"]}},
            )
        except ApiError as exc:
            if worth_retrying(exc):
                raise
            if exc.status not in (404, 409):
                log.warning("pod %s/%s not removed: %s", meta["namespace"], meta["name"], exc)

    def _remove_later(self, pod: Obj) -> None:
        """Remove a deleted pod that no worker runs, beside the watch (which must not wait on it),
        trying until the API server takes it."""
        meta = pod["metadata"]
        uid = meta["uid"]
        if uid in self._removing:
            return
        what = f"pod {meta['namespace']}/{meta['name']}"
        task = asyncio.get_running_loop().create_task(
            until_reached(functools.partial(self.remove_pod, pod), f"{what}: not removed"), name=f"remove {what}"
        )
        self._removing[uid] = task
        task.add_done_callback(lambda _task: self._removing.pop(uid, None))

    async def token(self, pod: Obj, account: str, audience: str, seconds: int) -> Token:
        meta = pod["metadata"]
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": seconds,
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]},
            },
        }
        reply = await self.client.post(
            f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token", body
        )
        return decode_token_status(reply["status"], time.time())

    async def publish_logs(self, worker: PodWorker) -> None:
        """Point kwok's log server at the container log files (`kubectl logs`)."""
        if not self.options.kwok_logs:
            return
        logs = []
        for slot in worker.slots:
            if slot.log_path is None:
                continue
            entry: Obj = {"containers": [slot.name], "logsFile": str(slot.log_path), "follow": True}
            if slot.previous_log is not None:
                entry["previousLogsFile"] = str(slot.previous_log)
            logs.append(entry)
        path = f"{LOGS_API}/namespaces/{worker.namespace}/logs"
        owners = [{"apiVersion": "v1", "kind": "Pod", "name": worker.name, "uid": worker.uid}]
        body: Obj = {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "Logs",
            "metadata": {
                "name": worker.name,
                "namespace": worker.namespace,
                "ownerReferences": owners,
            },
            "spec": {"logs": logs},
        }
        try:
            try:
                await self.client.post(path, body)
                return
            except ApiError as exc:
                if exc.status != 409:
                    raise
            existing = await self.client.get(f"{path}/{worker.name}")
            owner_uids = [o.get("uid") for o in existing["metadata"].get("ownerReferences") or []]
            if owner_uids != [worker.uid]:
                # Left by an earlier pod of the same name (a StatefulSet's): replace it.
                await self.client.delete(f"{path}/{worker.name}")
                await self.client.post(path, body)
            else:
                await self.client.patch(f"{path}/{worker.name}", {"spec": {"logs": logs}}, kind="merge-patch")
        except ApiError as exc:
            log.warning("logs of %s/%s not published: %s", worker.namespace, worker.name, exc)

    async def event(self, pod: Obj, reason: str, message: str, *, kind: str = "Normal") -> None:
        meta = pod["metadata"]
        key = (meta["uid"], reason, message)
        now = time.monotonic()
        if now - self._events.get(key, -_EVENT_REPEAT_S) < _EVENT_REPEAT_S:
            return
        self._events[key] = now
        if len(self._events) > 10_000:
            self._events.clear()
        stamp = now_rfc3339()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": pod.get("spec", {}).get("nodeName", "")},
            "reportingComponent": "kubelet",
            "reportingInstance": pod.get("spec", {}).get("nodeName", ""),
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        # Posted beside the work, as a kubelet's event recorder does: an API server that hangs
        # must not hold up stopping a container behind its "Killing" Event.
        task = asyncio.get_running_loop().create_task(self._post_event(meta["namespace"], body))
        self._posting.add(task)
        task.add_done_callback(self._posting.discard)

    async def _post_event(self, namespace: str, body: Obj) -> None:
        with contextlib.suppress(ApiError, OSError, httpx.HTTPError):
            await self.client.post(f"/api/v1/namespaces/{namespace}/events", body)

    # -- running ----------------------------------------------------------------------------------

    def describe(self) -> list[Obj]:
        return [
            {
                "namespace": w.namespace,
                "name": w.name,
                "uid": w.uid,
                "ip": w.pod_ip,
                "containers": [s.status() for s in w.slots],
            }
            for w in self._workers.values()
        ]

    async def _health(self, request: web.Request) -> web.Response:
        if request.path == "/pods":
            return web.json_response(self.describe(), dumps=json.dumps)
        return web.Response(status=200 if self.synced.is_set() else 503, text="ok" if self.synced.is_set() else "")

    async def run(self, stop: asyncio.Event) -> None:
        self.client = KubeClient(self.options.credentials)
        self.cache = ObjectCache(self.client)
        self.prober = Prober()
        runner = None
        try:
            if self.options.health_address is not None:
                app = web.Application()
                app.router.add_get("/healthz", self._health)
                app.router.add_get("/pods", self._health)
                runner = web.AppRunner(app, access_log=None, handle_signals=False)
                await runner.setup()
                host, port = self.options.health_address
                await web.TCPSite(runner, host, port, reuse_address=True).start()
            if self.options.namespace_selector:
                namespaces_synced = asyncio.Event()
                self._tasks.append(
                    asyncio.create_task(
                        list_and_watch(self.client, "/api/v1/namespaces", self._on_namespace, synced=namespaces_synced)
                    )
                )
                await namespaces_synced.wait()
            self._tasks.append(
                asyncio.create_task(
                    list_and_watch(
                        self.client, "/api/v1/pods", self._on_pod,
                        params={"fieldSelector": "spec.nodeName!="}, synced=self.synced,
                    ),
                    name="watch pods",
                )
            )
            log.info(
                "pod runtime watching pods of registered images: %s", ", ".join(self.registry.repositories)
            )
            problem = mount_namespace_problem()
            if problem is not None:
                log.warning(
                    "private mount namespaces (unshare --mount) are not permitted here (%s): containers with "
                    "volumes will fail to start; run the sandbox as root",
                    problem,
                )
            await stop.wait()
        finally:
            await self.shutdown()
            if runner is not None:
                await runner.cleanup()

    async def shutdown(self) -> None:
        """Stop watching, then stop every container (briefly: the sandbox is going away)."""
        removing = [*self._tasks, *self._removing.values()]
        for task in removing:
            task.cancel()
        await asyncio.gather(*removing, return_exceptions=True)
        workers = list(self._workers.values())
        for worker in workers:
            worker.shutdown(SHUTDOWN_GRACE_S)
        tasks = list(self._worker_tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE_S + 3.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.cache.close()
        await self.prober.close()
        await self.client.close()


def service_address(server: str) -> tuple[str, int]:
    """(host, port) of an https URL."""
    rest = server.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port or 443)

