"""ConfigMaps and Secrets of the namespaces that have served pods, kept current by watches.

The kubelet reads what volumes and environment variables refer to from a watch-based cache; so
does the runtime. A namespace's watches start with its first served pod; listeners hear of every
change, so mounted contents follow updates within the watch's latency. They stop when its last
served pod is gone: each holds a connection to the API server, and a runtime that outlives many
namespaces (a sandbox reused by test runs) must not run out of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from cacheroute.sandbox.runtime.kube import KubeClient, list_and_watch

Obj = dict[str, Any]
Listener = Callable[[str, str, str], None]
KINDS = {"configmap": "configmaps", "secret": "secrets"}


class ObjectCache:
    def __init__(self, client: KubeClient) -> None:
        self._client = client
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._synced: dict[str, list[asyncio.Event]] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._users: dict[str, int] = {}
        self._listeners: list[Listener] = []

    def lookup(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self._objects.get((kind, namespace, name))

    def listen(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    async def watch_namespace(self, namespace: str) -> None:
        """Start the namespace's watches (once) and return when both have listed; each call is
        matched by one `release_namespace`."""
        self._users[namespace] = self._users.get(namespace, 0) + 1
        events = self._synced.get(namespace)
        if events is None:
            events = []
            for kind, plural in KINDS.items():
                synced = asyncio.Event()
                events.append(synced)
                self._tasks.setdefault(namespace, []).append(
                    asyncio.create_task(
                        list_and_watch(
                            self._client,
                            f"/api/v1/namespaces/{namespace}/{plural}",
                            self._handler(kind),
                            synced=synced,
                        ),
                        name=f"watch {plural} in {namespace}",
                    )
                )
            self._synced[namespace] = events
        for event in events:
            await event.wait()

    def release_namespace(self, namespace: str) -> None:
        """One user of the namespace is done; the last one stops its watches and drops its objects."""
        users = self._users.get(namespace, 0) - 1
        if users > 0:
            self._users[namespace] = users
            return
        self._users.pop(namespace, None)
        self._synced.pop(namespace, None)
        for task in self._tasks.pop(namespace, []):
            task.cancel()
        for key in [key for key in self._objects if key[1] == namespace]:
            del self._objects[key]

    def _handler(self, kind: str) -> Callable[[str, Obj], None]:
        def handle(event: str, obj: Obj) -> None:
            meta = obj["metadata"]
            key = (kind, meta["namespace"], meta["name"])
            if event == "DELETED":
                self._objects.pop(key, None)
            else:
                self._objects[key] = obj
            for listener in list(self._listeners):
                listener(*key)

        return handle

    async def close(self) -> None:
        tasks = [task for tasks in self._tasks.values() for task in tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
