"""Plans and endpoints read through the Kubernetes API (list, then watch; relist when expired).

- `ConfigMapPlanWatch`: the ConfigMaps `<pool>-plan` and `<pool>-plan-<i>`; their `binaryData`
  files together are one plan payload.
- `EndpointSliceWatch`: the EndpointSlices of the pool's (headless) Service, for addresses and
  readiness of destinations.

The kubernetes client blocks, so each watch runs in a daemon thread and hands results to the
event loop with `call_soon_threadsafe`. `run()` is the watch as the router's supervisor sees it:
it starts the thread and ends (raising) only if the thread does, so a dead watch is restarted
with backoff like any other background task. Errors of the API server are retried inside the
thread with their own backoff.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cacheroute.planner.plan import host_port
from cacheroute.planner.plan_format import MAX_PAYLOAD_BYTES
from cacheroute.router.endpoints import SliceEndpoint
from cacheroute.router.settings import SettingsError, parse_address

log = logging.getLogger(__name__)

_WATCH_SECONDS = 120
_BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def api_client(kubeconfig: Path | None = None) -> Any:
    """An API client: the given kubeconfig, else in-cluster credentials, else the default kubeconfig."""
    from kubernetes import client, config

    if kubeconfig is not None:
        return config.new_client_from_config(config_file=str(kubeconfig))
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        return config.new_client_from_config()
    return client.ApiClient(configuration)


class _ListWatch:
    """List objects of one kind in a namespace, then follow changes; calls `changed` with all of them."""

    def __init__(
        self,
        what: str,
        list_call: Callable[..., Any],
        namespace: str,
        accept: Callable[[Any], bool],
        changed: Callable[[dict[str, Any]], None],
        *,
        label_selector: str | None = None,
    ) -> None:
        self.what = what
        self._list = list_call
        self._namespace = namespace
        self._accept = accept
        self._changed = changed
        self._selector = label_selector
        self._stop = threading.Event()
        self.synced = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Run the watch thread until cancelled; raises if the thread ends on its own."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[BaseException | None] = loop.create_future()

        def body() -> None:
            failure: BaseException | None = None
            try:
                self._run()
            except BaseException as exc:
                failure = exc
            finally:
                # The loop may have closed since (the router stopped): then nobody waits any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, ended, failure)

        self._stop.clear()
        threading.Thread(target=body, name=f"watch-{self.what}", daemon=True).start()
        try:
            failure = await ended
        finally:
            self._stop.set()
        raise RuntimeError(f"the watch of {self.what} stopped: {failure!r}")

    def _kwargs(self) -> dict[str, Any]:
        return {"label_selector": self._selector} if self._selector else {}

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        failures = 0
        while not self._stop.is_set():
            try:
                # Objects stay JSON (dicts): the client's models refuse some valid objects (an
                # EndpointSlice with no endpoints, as a Service with no pod has).
                response = self._list(self._namespace, _request_timeout=30, _preload_content=False, **self._kwargs())
                listed = json.loads(response.data)
                objects = {_name(o): o for o in listed.get("items") or [] if self._accept(o)}
                self._changed(dict(objects))
                self.synced.set()
                failures = 0
                version = listed["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    stream = watch.Watch(return_type="object")
                    for event in stream.stream(
                        self._list, self._namespace, resource_version=version,
                        timeout_seconds=_WATCH_SECONDS, _request_timeout=_WATCH_SECONDS + 30, **self._kwargs(),
                    ):
                        obj = event["object"]
                        if self._stop.is_set():
                            stream.stop()
                            break
                        if not isinstance(obj, dict) or not _name(obj) or not self._accept(obj):
                            continue
                        if event["type"] == "DELETED":
                            objects.pop(_name(obj), None)
                        else:
                            objects[_name(obj)] = obj
                        self._changed(dict(objects))
                    version = stream.resource_version or version
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch of %s expired; listing again", self.what)
                    continue
                failures += 1
                log.warning("watching %s failed (%s %s); retrying", self.what, exc.status, exc.reason)
            except Exception as exc:  # the API server may be down or unreachable for a while
                failures += 1
                log.warning("watching %s failed (%s); retrying", self.what, exc)
            self._stop.wait(_BACKOFF_SECONDS[min(failures, len(_BACKOFF_SECONDS)) - 1] if failures else 0)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _settle(future: asyncio.Future[BaseException | None], failure: BaseException | None) -> None:
    if not future.done():
        future.set_result(failure)


def _in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None]) -> Callable[[Any], None]:
    def call(value: Any) -> None:
        try:
            fn(value)
        except Exception:
            log.exception("handling a watch result failed")

    def hand_over(value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the router is stopping
            loop.call_soon_threadsafe(call, value)

    return hand_over


class PayloadError(ValueError):
    """ConfigMaps whose binaryData cannot be a plan payload (bad base64, too large)."""


def configmap_files(configmaps: Mapping[str, Any]) -> dict[str, bytes]:
    """The plan payload held by a set of ConfigMaps (their binaryData, base64 in the API)."""
    files: dict[str, bytes] = {}
    total = 0
    for cm in configmaps.values():
        for name, data in (cm.get("binaryData") or {}).items():
            if not isinstance(data, str | bytes):
                raise PayloadError(f"ConfigMap {_name(cm)}: binaryData {name!r} is not base64 text")
            total += len(data) * 3 // 4
            if total > MAX_PAYLOAD_BYTES:
                raise PayloadError(f"binaryData of more than {MAX_PAYLOAD_BYTES:,} bytes")
            try:
                files[name] = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise PayloadError(f"ConfigMap {_name(cm)}: binaryData {name!r} is not base64 ({exc})") from None
    return files


class ConfigMapPlanWatch:
    def __init__(
        self,
        api: Any,
        *,
        namespace: str,
        pool: str,
        on_files: Callable[[dict[str, bytes]], None],
        loop: asyncio.AbstractEventLoop,
        on_error: Callable[[str], None] = lambda _error: None,
    ) -> None:
        from kubernetes import client

        pattern = re.compile(rf"^{re.escape(pool)}-plan(-\d+)?$")
        core = client.CoreV1Api(api)
        deliver = _in_loop(loop, on_files)
        refuse = _in_loop(loop, on_error)

        def changed(objects: dict[str, Any]) -> None:
            # Decoding base64 here keeps megabytes of work off the event loop.
            if not objects:
                return
            try:
                files = configmap_files(objects)
            except PayloadError as exc:
                # A payload that cannot be assembled is a rejected plan, not a failed watch.
                refuse(str(exc))
                return
            deliver(files)

        self.watch = _ListWatch(
            f"ConfigMaps {namespace}/{pool}-plan*",
            core.list_namespaced_config_map,
            namespace,
            lambda cm: bool(pattern.match(_name(cm))),
            changed,
        )

    def stop(self) -> None:
        self.watch.stop()

    async def run(self) -> None:
        await self.watch.run()


def slice_endpoints(slices: Mapping[str, Any], target_port: int | None) -> dict[str, SliceEndpoint]:
    """Addresses (`ip:port`) of the slices' endpoints with their pod and readiness."""
    found: dict[str, SliceEndpoint] = {}
    for item in slices.values():
        ports = item.get("ports") or []
        if target_port is not None:
            port = target_port
        elif ports and ports[0].get("port"):
            port = int(ports[0]["port"])
        else:
            continue
        for ep in item.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            # An absent `ready` means ready (EndpointSlice API semantics).
            ready = conditions.get("ready") is None or bool(conditions["ready"])
            if conditions.get("terminating"):
                ready = False
            pod = str((ep.get("targetRef") or {}).get("name") or "")
            for ip in ep.get("addresses") or []:
                try:
                    address = parse_address(host_port(ip, port))
                except SettingsError:
                    continue
                found[address] = SliceEndpoint(address, pod, ready)
    return found


class EndpointSliceWatch:
    def __init__(
        self,
        api: Any,
        *,
        namespace: str,
        service: str,
        target_port: int | None,
        on_endpoints: Callable[[dict[str, SliceEndpoint]], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        from kubernetes import client

        discovery = client.DiscoveryV1Api(api)
        deliver = _in_loop(loop, on_endpoints)
        self.watch = _ListWatch(
            f"EndpointSlices of service {namespace}/{service}",
            discovery.list_namespaced_endpoint_slice,
            namespace,
            lambda _s: True,
            lambda objects: deliver(slice_endpoints(objects, target_port)),
            label_selector=f"{SERVICE_NAME_LABEL}={service}",
        )

    def stop(self) -> None:
        self.watch.stop()

    async def run(self) -> None:
        await self.watch.run()
