"""Following pods that are Running, with their (local) pod IPs.

`PodWatcher` calls `on_running` once per pod when it is Running with an IP, and `on_gone` when it
stops being so (deleted, terminating, or another phase). The pod runtime (`sandbox.runtime`) is
what serves pods of the CacheRoute and vLLM images; this is for tests and tools that want to follow
pods themselves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


@dataclass(frozen=True)
class PodEndpoint:
    namespace: str
    name: str
    ip: str
    node: str
    uid: str
    labels: Mapping[str, str] = field(default_factory=dict)


PodEvent = tuple[Literal["running", "gone"], PodEndpoint]


def _endpoint(pod: Any) -> PodEndpoint | None:
    """The pod as an endpoint if it is Running with an IP and not terminating."""
    status, meta = pod.status, pod.metadata
    if status is None or status.phase != "Running" or not status.pod_ip or meta.deletion_timestamp is not None:
        return None
    return PodEndpoint(
        namespace=meta.namespace,
        name=meta.name,
        ip=status.pod_ip,
        node=pod.spec.node_name or "",
        uid=meta.uid,
        labels=dict(meta.labels or {}),
    )


def running_pods(
    api_client: ApiClient, *, namespace: str | None = None, label_selector: str | None = None
) -> list[PodEndpoint]:
    """The pods that are Running with a pod IP right now."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    kwargs = {"label_selector": label_selector} if label_selector else {}
    pods = core.list_namespaced_pod(namespace, **kwargs) if namespace else core.list_pod_for_all_namespaces(**kwargs)
    return [ep for pod in pods.items if (ep := _endpoint(pod)) is not None]


def pod_events(
    api_client: ApiClient,
    *,
    namespace: str | None = None,
    label_selector: str | None = None,
    stop: threading.Event | None = None,
    timeout_seconds: int = 2,
) -> Iterator[PodEvent]:
    """("running", endpoint) the first time a pod is Running with an IP, ("gone", endpoint) after.

    The pods already running when called come first. Watches are re-opened every
    `timeout_seconds` (so `stop` is noticed) and after a lost connection.
    """
    from kubernetes import client, watch

    core = client.CoreV1Api(api_client)
    known: dict[str, PodEndpoint] = {}
    kwargs: dict[str, Any] = {"label_selector": label_selector} if label_selector else {}
    # Watch reads the item type from the list method's docstring: pass the bound method itself.
    list_call: Callable[..., Any] = core.list_namespaced_pod if namespace else core.list_pod_for_all_namespaces
    args: tuple[str, ...] = (namespace,) if namespace else ()
    resource_version: str | None = None
    while stop is None or not stop.is_set():
        if resource_version is None:
            listing = list_call(*args, **kwargs)
            resource_version = listing.metadata.resource_version
            current = {p.metadata.uid: ep for p in listing.items if (ep := _endpoint(p)) is not None}
            for uid in list(known):
                if uid not in current:
                    yield "gone", known.pop(uid)
            for uid, listed in current.items():
                if uid not in known:
                    known[uid] = listed
                    yield "running", listed
        watcher = watch.Watch()
        try:
            for event in watcher.stream(
                list_call, *args, resource_version=resource_version, timeout_seconds=timeout_seconds, **kwargs
            ):
                pod = event["object"]
                resource_version = pod.metadata.resource_version
                uid = pod.metadata.uid
                endpoint = None if event["type"] == "DELETED" else _endpoint(pod)
                if endpoint is not None and uid not in known:
                    known[uid] = endpoint
                    yield "running", endpoint
                elif endpoint is None and uid in known:
                    yield "gone", known.pop(uid)
                if stop is not None and stop.is_set():
                    return
        except client.ApiException as exc:
            if exc.status != 410:  # 410 Gone: our resource version expired; list again
                raise
            resource_version = None
        finally:
            watcher.stop()


class PodWatcher:
    """Runs `pod_events` in a background thread and hands each event to a callback."""

    def __init__(
        self,
        api_client: ApiClient,
        on_running: Callable[[PodEndpoint], None],
        on_gone: Callable[[PodEndpoint], None] = lambda _ep: None,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
    ) -> None:
        self._api_client = api_client
        self._on_running = on_running
        self._on_gone = on_gone
        self._namespace = namespace
        self._label_selector = label_selector
        self._stop = threading.Event()
        self._dispatching = threading.RLock()  # a callback may stop its own watcher
        self._thread = threading.Thread(target=self._run, name="pod-watcher", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            for kind, endpoint in pod_events(
                self._api_client, namespace=self._namespace, label_selector=self._label_selector, stop=self._stop
            ):
                with self._dispatching:
                    if self._stop.is_set():
                        return
                    (self._on_running if kind == "running" else self._on_gone)(endpoint)
        except BaseException as exc:  # kept for the owner; a thread cannot raise into it
            self.error = exc

    def start(self) -> PodWatcher:
        if self._thread.ident is None:  # not started yet; starting twice is a no-op
            self._thread.start()
        return self

    def stop(self) -> None:
        """No callback runs once this returns.

        The thread itself ends when its current watch request times out (a few seconds later);
        waiting for that would make every stop slow.
        """
        with self._dispatching:
            self._stop.set()

    def __enter__(self) -> PodWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.stop()
