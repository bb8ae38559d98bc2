"""A small asynchronous Kubernetes REST client: what the pod runtime needs and nothing more.

Plain JSON over httpx with a client certificate; watches are list-then-watch loops that resume
from the last resource version and list again when it has expired (410 Gone).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger("cacheroute.sandbox.runtime")

Obj = dict[str, Any]


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def worth_retrying(exc: BaseException) -> bool:
    """Whether the same call may succeed later: the API server was not reached, or could not act
    just now (overloaded, timed out, a webhook failing), as opposed to refusing the request."""
    if isinstance(exc, httpx.HTTPError):
        return True
    return isinstance(exc, ApiError) and (exc.status >= 500 or exc.status == 429)


async def until_reached(call: Callable[[], Awaitable[Any]], what: str) -> None:
    """Await `call` until the API server takes it, as a kubelet retries: errors worth retrying are
    logged (`what` names the call) and tried again with a back-off up to 5 s; others are raised."""
    delay = 0.5
    while True:
        try:
            await call()
            return
        except (httpx.HTTPError, ApiError) as exc:
            if not worth_retrying(exc):
                raise
            if isinstance(exc, httpx.HTTPError):
                why = f"the API server did not answer ({type(exc).__name__})"
            else:
                why = f"the API server could not take it ({exc})"
            log.warning("%s, %s; trying again", what, why)
        await asyncio.sleep(delay)
        delay = min(2 * delay, 5.0)


@dataclass(frozen=True)
class Credentials:
    server: str
    ca_file: str
    cert_file: str
    key_file: str


class KubeClient:
    def __init__(self, credentials: Credentials, *, timeout: float = 30.0) -> None:
        context = ssl.create_default_context(cafile=credentials.ca_file)
        context.load_cert_chain(credentials.cert_file, credentials.key_file)
        self.server = credentials.server.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.server,
            verify=context,
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        content = None if body is None else json.dumps(body).encode()
        response = await self._http.request(
            method, path, content=content, params=params, headers={"Content-Type": content_type}
        )
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise ApiError(response.status_code, message)
        result: Obj = response.json() if response.content else {}
        return result

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> Obj:
        return await self.request("GET", path, params=params)

    async def get_or_none(self, path: str) -> Obj | None:
        try:
            return await self.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def post(self, path: str, body: Any) -> Obj:
        return await self.request("POST", path, body=body)

    async def patch(self, path: str, body: Any, *, kind: str = "strategic-merge-patch") -> Obj:
        return await self.request("PATCH", path, body=body, content_type=f"application/{kind}+json")

    async def delete(self, path: str, body: Any = None) -> Obj:
        return await self.request("DELETE", path, body=body)

    async def _watch_stream(self, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        timeout = httpx.Timeout(None, connect=5.0)
        async with self._http.stream("GET", path, params=params, timeout=timeout) as response:
            if response.status_code >= 400:
                await response.aread()
                raise ApiError(response.status_code, response.text)
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)


Handler = Callable[[str, Obj], Awaitable[None] | None]


async def list_and_watch(
    client: KubeClient,
    path: str,
    handler: Handler,
    *,
    params: Mapping[str, str] | None = None,
    synced: asyncio.Event | None = None,
    watch_seconds: int = 300,
) -> None:
    """Call `handler(event_type, object)` for every object (listed as ADDED) and every change, forever.

    After a re-list, objects that disappeared meanwhile are reported as DELETED.
    """
    base = dict(params or {})
    known: dict[str, Obj] = {}
    version: str | None = None
    delay = 0.5
    while True:
        try:
            if version is None:
                listing = await client.get(path, base)
                version = listing["metadata"]["resourceVersion"]
                current = {o["metadata"]["uid"]: o for o in listing.get("items") or []}
                for uid in list(known):
                    if uid not in current:
                        await _call(handler, "DELETED", known.pop(uid))
                for uid, obj in current.items():
                    known[uid] = obj
                    await _call(handler, "ADDED", obj)
                if synced is not None:
                    synced.set()
            watch_params = {
                **base,
                "watch": "true",
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(watch_seconds),
            }
            async for event in client._watch_stream(path, watch_params):
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        version = None
                        break
                    raise ApiError(int(obj.get("code", 500)), str(obj.get("message")))
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if kind == "BOOKMARK":
                    continue
                uid = obj["metadata"]["uid"]
                if kind == "DELETED":
                    known.pop(uid, None)
                else:
                    known[uid] = obj
                await _call(handler, str(kind), obj)
            delay = 0.5
        except asyncio.CancelledError:
            raise
        except ApiError as exc:
            if exc.status == 410:
                version = None
                continue
            log.warning("watch %s failed: %s; retrying in %.1fs", path, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.warning("watch %s interrupted: %s; retrying in %.1fs", path, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)


async def _call(handler: Handler, kind: str, obj: Obj) -> None:
    result = handler(kind, obj)
    if result is not None:
        await result
