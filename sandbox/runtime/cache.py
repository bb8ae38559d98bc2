"""ConfigMaps and Secrets of the namespaces that have served pods, kept current by watches.

The kubelet reads what volumes and environment variables refer to from a watch-based cache; so
does the runtime. A namespace's watches start with its first served pod; listeners hear of every
change, so mounted contents follow updates within the watch's latency.
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
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list[Listener] = []

    def lookup(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self._objects.get((kind, namespace, name))

    def listen(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    async def watch_namespace(self, namespace: str) -> None:
        """Start the namespace's watches (once) and return when both have listed."""
        events = self._synced.get(namespace)
        if events is None:
            events = []
            for kind, plural in KINDS.items():
                synced = asyncio.Event()
                events.append(synced)
                self._tasks.append(
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
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
