"""Loading plans: validate, swap atomically, keep the last good one.

Sources hand payloads (file name -> gzip bytes) to `PlanStore.submit`; one worker decodes the
newest payload off the event loop and swaps the picker's table in a single assignment. A payload
that fails validation is logged and counted, and the plan in effect stays. Payloads assembled
from several ConfigMaps can be caught half-written; those get `settle` seconds to complete
before they count as rejected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from cacheroute.planner.plan import PlanError
from cacheroute.planner.plan_format import HEADER_FILE, decode_plan, plan_version
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.table import RoutingTable, build_table

log = logging.getLogger(__name__)

PLAN_FILE = re.compile(r"^(plan\.json\.gz|routes-\d{4}\.bin\.gz)$")


def _decode(files: Mapping[str, bytes], version: str) -> RoutingTable:
    return build_table(decode_plan(files), version)


class PlanStore:
    def __init__(self, pool: EndpointPool, picker: Picker, metrics: RouterMetrics | None = None) -> None:
        self.pool = pool
        self.picker = picker
        self.metrics = metrics
        self.version: str | None = None
        self.last_error: str | None = None
        self.applied_at = 0.0
        self._latest: tuple[dict[str, bytes], str, float] | None = None
        self._submissions = 0
        self._wake = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []

    def on_applied(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    @property
    def loaded(self) -> bool:
        return self.version is not None

    def submit(self, files: Mapping[str, bytes], *, origin: str, settle: float = 0.0) -> None:
        """Offer a payload; only the newest one submitted before the worker gets to it counts."""
        self._latest = (dict(files), origin, settle)
        self._submissions += 1
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._latest is None:
                continue
            files, origin, settle = self._latest
            self._latest = None
            await self.process(files, origin=origin, settle=settle)

    async def process(self, files: Mapping[str, bytes], *, origin: str, settle: float = 0.0) -> bool:
        """Validate and apply one payload now; True when a new plan took effect."""
        started = time.monotonic()
        submission = self._submissions
        try:
            version = plan_version(files)
            if version == self.version:
                return False
            table = await asyncio.to_thread(_decode, files, version)
        except PlanError as exc:
            if settle > 0:
                asyncio.get_running_loop().call_later(settle, self._reject_if_current, submission, origin, str(exc))
            else:
                self._reject(origin, str(exc))
            return False
        self.pool.set_plan_destinations(table.destinations)
        self.picker.install(table)
        self.version = version
        self.last_error = None
        self.applied_at = time.time()
        if self.metrics is not None:
            self.metrics.plan_info.info(
                {"pool": table.pool, "version": version, "generated_at": table.generated_at, "origin": origin}
            )
            self.metrics.plan_routes.set(len(table))
            self.metrics.plan_applied.set(self.applied_at)
            self.metrics.plan_applied_total.inc()
        log.info(
            "plan %s of pool %r applied from %s: %d routes, %d destinations, in %.0f ms",
            version, table.pool, origin, len(table), len(table.destinations), (time.monotonic() - started) * 1e3,
        )
        for listener in self._listeners:
            listener()
        return True

    def _reject_if_current(self, submission: int, origin: str, error: str) -> None:
        if self._submissions == submission:
            self._reject(origin, error)

    def _reject(self, origin: str, error: str) -> None:
        self.last_error = error
        if self.metrics is not None:
            self.metrics.plan_rejected_total.inc()
        kept = f"keeping plan {self.version}" if self.version else "no plan in effect"
        log.warning("plan from %s rejected (%s); %s", origin, error, kept)


class DirectoryPlanSource:
    """A mounted ConfigMap directory, polled for changes.

    The kubelet updates a ConfigMap volume by writing a new timestamped directory and swapping
    the `..data` symlink; files are read through the resolved link so one read never mixes two
    versions. A plain directory (written by hand or by tests) works too.
    """

    def __init__(self, path: Path, store: PlanStore, *, interval: float) -> None:
        self.path = path
        self.store = store
        self.interval = interval
        self._last: object = None

    def _base(self) -> Path:
        data = self.path / "..data"
        return Path(os.path.realpath(data)) if data.exists() else self.path

    def signature(self) -> object:
        """Changes whenever the payload may have changed (link target, inode, mtime, size)."""
        try:
            base = self._base()
            names = sorted(n for n in os.listdir(base) if PLAN_FILE.match(n))
            stats = []
            for name in names:
                st = os.stat(base / name)
                stats.append((name, st.st_ino, st.st_mtime_ns, st.st_size))
            return (str(base), tuple(stats))
        except OSError:
            return None

    def read(self) -> dict[str, bytes] | None:
        try:
            base = self._base()
            return {n: (base / n).read_bytes() for n in os.listdir(base) if PLAN_FILE.match(n)}
        except OSError:
            # The kubelet removed the old directory while we read it; the next poll sees the new one.
            return None

    def poll(self) -> bool:
        """Submit the payload if it changed since the last poll; True when something was submitted."""
        signature = self.signature()
        if signature is None or signature == self._last:
            return False
        files = self.read()
        if files is None:
            return False
        self._last = signature
        if HEADER_FILE not in files:
            log.warning("plan directory %s has no %s yet", self.path, HEADER_FILE)
            return False
        self.store.submit(files, origin=str(self.path))
        return True

    async def run(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.poll()
            # Polling period: a changed plan takes effect within `interval` plus decode time.
            await asyncio.sleep(self.interval)
