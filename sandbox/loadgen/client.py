"""Open-loop HTTP load: every request leaves at its scheduled time, whatever came before it.

Each request streams (`stream: true`, with `stream_options.include_usage`), so the client sees the
first token: time to first token is measured from the moment the request is sent to the first
chunk that carries text, end-to-end latency to the end of the stream. The affinity key goes in a
header or in a body field (OpenAI's `user` by default). Only loopback targets are accepted: this
is a tool for the sandbox, not for load-testing someone else's servers.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from cacheroute.sandbox.loadgen.prompts import prompt_parts
from cacheroute.sandbox.loadgen.schedule import PlannedRequest, Schedule
from cacheroute.sandbox.network import is_pod_address

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class TargetError(ValueError):
    """The target URL is not one the load generator may send to."""


def check_target(url: str) -> str:
    """`url` if it is an http URL on a loopback address, or on a sandbox pod address routed to this
    namespace's loopback (`cacheroute sandbox isolate`)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(f"target {url!r} is not an http:// URL")
    host = parts.hostname
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and not is_pod_address(host):
            raise TargetError(
                f"target {url!r} is not a loopback address; the load generator only sends to this machine"
            )
    return url


@dataclass
class LoadSettings:
    url: str
    api: str = "completions"
    model: str | None = None
    key_header: str | None = None
    key_field: str | None = "user"
    timeout_s: float = 300.0
    max_in_flight: int = 4096
    headers: dict[str, str] = field(default_factory=dict)

    def endpoint(self) -> str:
        base = check_target(self.url)
        if urlsplit(base).path.strip("/"):
            return base
        return base.rstrip("/") + API_PATHS[self.api]


@dataclass
class RequestResult:
    index: int
    key: str | None
    scheduled_s: float
    sent_s: float = math.nan
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    status: int = 0
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and not math.isnan(self.e2e_s)


def request_body(request: PlannedRequest, schedule: Schedule, settings: LoadSettings) -> dict[str, Any]:
    tr = schedule.trace
    parts = prompt_parts(tr.blocks(request.index).tolist(), request.input_tokens, tr.block_size, salt=request.index)
    body: dict[str, Any] = {
        "max_tokens": request.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        # vLLM's extension: produce exactly max_tokens, as the trace says.
        "ignore_eos": True,
    }
    if settings.model:
        body["model"] = settings.model
    if settings.api == "chat":
        # One message per prefix block: the context a client resends (documents, earlier turns)
        # comes before the newest message, the request's last block, as in a conversation.
        body["messages"] = [{"role": "user", "content": part} for part in parts]
    else:
        body["prompt"] = " ".join(parts)
    if request.key is not None and settings.key_field:
        body[settings.key_field] = request.key
    return body


async def _send(
    *,
    session: aiohttp.ClientSession,
    endpoint: str,
    request: PlannedRequest,
    schedule: Schedule,
    settings: LoadSettings,
    result: RequestResult,
    origin: float,
) -> None:
    loop = asyncio.get_running_loop()
    body = json.dumps(request_body(request, schedule, settings)).encode()
    headers = {"Content-Type": "application/json", **settings.headers}
    if request.key is not None and settings.key_header:
        headers[settings.key_header] = request.key
    sent = loop.time()
    result.sent_s = sent - origin
    try:
        async with session.post(endpoint, data=body, headers=headers) as response:
            result.status = response.status
            if response.status != 200:
                result.error = (await response.text())[:300]
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    result.e2e_s = loop.time() - sent
                    break
                chunk = json.loads(payload)
                if math.isnan(result.ttft_s):
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            result.ttft_s = loop.time() - sent
                            break
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
            else:
                result.error = "the stream ended without [DONE]"
    except TimeoutError:
        result.error = f"timed out after {settings.timeout_s:.0f}s"
    except (aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]


async def run_load(
    schedule: Schedule,
    settings: LoadSettings,
    *,
    progress: Callable[[int, int], None] | None = None,
    lead_s: float = 0.2,
    interruptible: bool = False,
) -> list[RequestResult]:
    """Send every request of `schedule` at its time; return one result per request, in schedule order.

    `interruptible`: SIGINT (through `asyncio.run`) or SIGTERM stops the run: nothing more is sent,
    requests in flight are cancelled, and the results of the requests that had finished come back,
    fewer than scheduled."""
    results = [
        RequestResult(
            index=r.index, key=r.key, scheduled_s=r.at_s, input_tokens=r.input_tokens, output_tokens=r.output_tokens
        )
        for r in schedule.requests
    ]
    finished: set[int] = set()
    if not interruptible:
        await _send_all(schedule, settings, results, finished=finished, progress=progress, lead_s=lead_s)
        return results
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    try:
        await _send_all(schedule, settings, results, finished=finished, progress=progress, lead_s=lead_s)
    except asyncio.CancelledError:
        main.uncancel()
        return [results[i] for i in sorted(finished)]
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    return results


async def _send_all(
    schedule: Schedule,
    settings: LoadSettings,
    results: list[RequestResult],
    *,
    finished: set[int],
    progress: Callable[[int, int], None] | None,
    lead_s: float,
) -> None:
    """Send the requests open loop; `finished` gets the position of each request whose outcome is known."""
    endpoint = settings.endpoint()
    total = len(results)
    in_flight = 0

    def done_with(position: int) -> None:
        finished.add(position)
        if progress is not None:
            progress(len(finished), total)

    def ended(position: int, task: asyncio.Task[None]) -> None:
        nonlocal in_flight
        in_flight -= 1
        if not task.cancelled():
            done_with(position)

    connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        try:
            origin = loop.time() + lead_s
            for position, (request, result) in enumerate(zip(schedule.requests, results, strict=True)):
                delay = origin + request.at_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if in_flight >= settings.max_in_flight:
                    result.error = f"not sent: {in_flight} requests already in flight (the client's limit)"
                    done_with(position)
                    continue
                in_flight += 1
                task = asyncio.create_task(
                    _send(
                        session=session, endpoint=endpoint, request=request, schedule=schedule, settings=settings,
                        result=result, origin=origin,
                    )
                )
                task.add_done_callback(functools.partial(ended, position))
                tasks.append(task)
            if tasks:
                await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

