"""Queue depth from each endpoint's Prometheus /metrics.

Both current and older engine metric names are accepted (renames have broken other routers):
series of the same meaning are summed across names and label sets (one per model or engine).
An endpoint that does not answer 200 in time, or whose response cannot be read (cut short,
malformed, over the size limit, an address that does not resolve), is taken out of the ready set
until it does; no answer of an endpoint can stop the scraper itself.

Scrapes go over one kept-alive HTTP/1.1 connection per endpoint with a minimal client on asyncio
streams: the router shares its event loop with every routing decision, and a general-purpose
HTTP client costs it milliseconds of CPU per scrape where this costs tens of microseconds (see
docs/router.md), which matters at a 0.5 s interval over a fleet of 60.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable

from cacheroute.router.endpoints import Endpoint, EndpointPool

log = logging.getLogger(__name__)

RUNNING_NAMES = ("vllm:num_requests_running", "vllm_num_requests_running", "sglang:num_running_reqs")
# V0 engines also report swapped (preempted) requests, which wait to resume like queued ones.
WAITING_NAMES = (
    "vllm:num_requests_waiting",
    "vllm_num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm_num_requests_swapped",
    "sglang:num_queue_reqs",
)
_RUNNING = frozenset(n.encode() for n in RUNNING_NAMES)
# One sample line of any of the names: name, optional labels, whitespace, value.
_SAMPLE = re.compile(
    rb"^(" + b"|".join(re.escape(n.encode()) for n in RUNNING_NAMES + WAITING_NAMES) + rb")(?:\{[^\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)
MAX_METRICS_BYTES = 16 * 1024 * 1024
# Queue gauges above this are not believed (a broken exporter); they count as this much.
MAX_QUEUE = 1_000_000


class ScrapeError(Exception):
    """The endpoint's /metrics could not be read (the message says why)."""


def parse_queue(text: str | bytes) -> tuple[int, int]:
    """(running, waiting) from Prometheus text exposition; absent series count as 0."""
    data = text.encode() if isinstance(text, str) else text
    running = 0.0
    waiting = 0.0
    for match in _SAMPLE.finditer(data):
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        value = min(max(value, 0.0), MAX_QUEUE)
        if match.group(1) in _RUNNING:
            running += value
        else:
            waiting += value
    return min(round(running), MAX_QUEUE), min(round(waiting), MAX_QUEUE)


class MetricsConnection:
    """GET /metrics over a kept-alive HTTP/1.1 connection to one endpoint."""

    def __init__(self, address: str, *, deadline: float) -> None:
        self.deadline = deadline
        host, _, port = address.rpartition(":")
        self.host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ScrapeError(f"address {address!r} is not host:port")
        self.port = int(port)
        self._request = f"GET /metrics HTTP/1.1\r\nHost: {address}\r\nAccept: text/plain\r\n\r\n".encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def get(self) -> tuple[int, bytes]:
        """(status, body) within `deadline` seconds; raises ScrapeError, OSError or TimeoutError."""
        try:
            async with asyncio.timeout(self.deadline):
                reused = self._writer is not None
                try:
                    return await self._exchange()
                except (ConnectionError, ScrapeError):
                    if not reused:
                        raise
                    # The endpoint closed the idle connection since the last scrape: reconnect once.
                    self.close()
                    return await self._exchange()
        except BaseException:
            self.close()
            raise

    async def _exchange(self) -> tuple[int, bytes]:
        try:
            return await self._read_response()
        except asyncio.IncompleteReadError as exc:
            raise ScrapeError(f"response cut short after {len(exc.partial)} bytes of a part") from None
        except asyncio.LimitOverrunError as exc:
            raise ScrapeError(f"response line too long ({exc})") from None

    async def _read_response(self) -> tuple[int, bytes]:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(self._request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise ScrapeError(f"no HTTP response head ({exc})") from exc
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ScrapeError(f"not an HTTP/1.x response: {lines[0][:60]!r}")
        status = int(parts[1])
        length: int | None = None
        chunked = False
        keep_alive = parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == b"content-length" and value.isdigit():
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value:
                chunked = True
            elif name == b"connection":
                keep_alive = value == b"keep-alive" or (keep_alive and value != b"close")
        if chunked:
            body = await self._read_chunked(reader)
        elif length is not None:
            if length > MAX_METRICS_BYTES:
                raise ScrapeError(f"/metrics of {length} bytes is over {MAX_METRICS_BYTES}")
            body = await reader.readexactly(length)
        else:
            # No length: the body runs to the end of the connection.
            body = await reader.read(MAX_METRICS_BYTES + 1)
            while len(body) <= MAX_METRICS_BYTES and (more := await reader.read(MAX_METRICS_BYTES + 1 - len(body))):
                body += more
            if len(body) > MAX_METRICS_BYTES:
                raise ScrapeError(f"/metrics over {MAX_METRICS_BYTES} bytes")
            keep_alive = False
        if not keep_alive:
            self.close()
        return status, body

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        size_total = 0
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            except ValueError:
                raise ScrapeError(f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                # Trailers (normally none) end with an empty line.
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                return b"".join(parts)
            size_total += size
            if size_total > MAX_METRICS_BYTES:
                raise ScrapeError(f"/metrics over {MAX_METRICS_BYTES} bytes")
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)


class Scraper:
    def __init__(
        self,
        pool: EndpointPool,
        *,
        interval: float,
        timeout: float,
        on_failure: Callable[[Endpoint], None] = lambda _e: None,
    ) -> None:
        self.pool = pool
        self.interval = interval
        self.timeout = timeout
        self._on_failure = on_failure
        self.rounds = 0
        self._wake = asyncio.Event()
        self._round_listeners: list[Callable[[], None]] = []
        self._connections: dict[str, MetricsConnection] = {}

    def on_round(self, listener: Callable[[], None]) -> None:
        self._round_listeners.append(listener)

    def wake(self) -> None:
        """Scrape now (new endpoints should not wait a whole interval to become ready)."""
        self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                self._wake.clear()
                started = time.monotonic()
                await self.scrape_all()
                for listener in self._round_listeners:
                    try:
                        listener()
                    except Exception:
                        log.exception("a listener of scrape rounds failed")
                # Next round after `interval`, or at once when woken.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wake.wait(), timeout=max(0.0, self.interval - (time.monotonic() - started))
                    )
        finally:
            for connection in self._connections.values():
                connection.close()

    async def scrape_all(self) -> None:
        endpoints = list(self.pool.by_address.values())
        for address in set(self._connections) - {e.address for e in endpoints}:
            self._connections.pop(address).close()
        await asyncio.gather(*(self._scrape(e) for e in endpoints))
        self.rounds += 1

    async def _scrape(self, endpoint: Endpoint) -> None:
        try:
            connection = self._connections.get(endpoint.address)
            if connection is None:
                connection = self._connections[endpoint.address] = MetricsConnection(
                    endpoint.address, deadline=self.timeout
                )
            status, body = await connection.get()
            ok = status == 200
            running, waiting = parse_queue(body) if ok else (0, 0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever the endpoint answers, it is this endpoint's failure only
            log.debug("scrape of %s failed: %r", endpoint.address, exc)
            ok, running, waiting = False, 0, 0
        if not ok:
            self._on_failure(endpoint)
            if endpoint.ready:
                log.info("endpoint %s left the ready set (metrics not scrapable)", endpoint.address)
        elif not endpoint.ready and endpoint.member_ready:
            log.info("endpoint %s is ready", endpoint.address)
        self.pool.record_scrape(endpoint, ok=ok, running=running, waiting=waiting)
