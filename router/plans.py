"""Loading plans: validate, swap atomically, keep the last good one.

Sources hand payloads (file name -> gzip bytes) to `PlanStore.submit`; one worker decodes the
newest payload off the event loop (the header included) and swaps the picker's table in a single
assignment. Whatever is wrong with a payload (bad gzip, bytes past the size limits, JSON of the
wrong shape, a field `validate_plan` refuses, or any exception at all while loading it) makes it
a rejected plan: counted once, logged once with the reason, and the plan in effect stays.
Payloads assembled from several ConfigMaps can be caught half-written (shards that do not match
their header); those get `settle` seconds to complete before they count as rejected. Any other
failure counts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cacheroute.planner.plan import PlanError
from cacheroute.planner.plan_format import (
    HEADER_FILE,
    MAX_PAYLOAD_BYTES,
    MAX_SHARDS,
    IncompletePayloadError,
    decode_plan,
    plan_version,
)
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.table import RoutingTable, build_table

log = logging.getLogger(__name__)

PLAN_FILE = re.compile(r"^(plan\.json\.gz|routes-\d{4}\.bin\.gz)$")


@dataclass(frozen=True)
class _Loaded:
    """What the worker thread made of one payload: a table, the version in effect, or an error."""

    digest: str
    table: RoutingTable | None = None
    error: str | None = None
    # Shards that do not match their header: perhaps a payload caught half-written.
    incomplete: bool = False


def payload_digest(files: Mapping[str, bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(files):
        data = files[name]
        h.update(name.encode("utf-8", "replace") + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def describe(exc: BaseException) -> str:
    """The reason a payload failed, in one line."""
    if isinstance(exc, PlanError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load(files: Mapping[str, bytes], current: str | None, current_digest: str | None) -> _Loaded:
    """Decode one payload (in a worker thread); a bad payload gives an error, never an exception.

    The same bytes as the plan in effect are not decoded again; a payload that claims the
    version in effect with other bytes is decoded and checked all the same (a broken copy of
    the plan in effect is still a broken payload), but not installed again.
    """
    digest = payload_digest(files)
    if digest == current_digest:
        return _Loaded(digest)
    try:
        version = plan_version(files)
        table = build_table(decode_plan(files), version)
        return _Loaded(digest, None if version == current else table)
    except Exception as exc:  # any failure of a payload is a rejected plan, whatever its type
        return _Loaded(digest, error=describe(exc), incomplete=isinstance(exc, IncompletePayloadError))


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
        # The payload rejected last: offered again unchanged, it is neither counted nor logged again.
        self._rejected_digest: str | None = None
        self._applied_digest: str | None = None

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
            try:
                await self.process(files, origin=origin, settle=settle)
            except Exception as exc:
                # process() turns every failure of a payload into a rejection; this one is ours.
                log.exception("applying the plan from %s failed", origin)
                self._reject(origin, f"internal error: {describe(exc)}", None)

    async def process(self, files: Mapping[str, bytes], *, origin: str, settle: float = 0.0) -> bool:
        """Validate and apply one payload now; True when a new plan took effect."""
        started = time.monotonic()
        submission = self._submissions
        try:
            loaded = await asyncio.to_thread(_load, files, self.version, self._applied_digest)
        except Exception as exc:  # the worker thread itself failed (out of memory, say)
            loaded = _Loaded("", error=describe(exc))
        if loaded.error is not None:
            if settle > 0 and loaded.incomplete:
                asyncio.get_running_loop().call_later(
                    settle, self._reject_if_current, submission, origin, loaded.error, loaded.digest
                )
            else:
                self._reject(origin, loaded.error, loaded.digest)
            return False
        if loaded.table is None:  # the plan in effect (these bytes, or a valid copy of it)
            self._rejected_digest = None
            self._applied_digest = loaded.digest
            return False
        return self._apply(loaded.table, loaded.digest, origin, started)

    def _apply(self, table: RoutingTable, digest: str, origin: str, started: float) -> bool:
        previous = self.picker.table
        try:
            self.pool.set_plan_destinations(table.destinations)
            self.picker.install(table)
        except Exception as exc:
            # Put the last good plan back as it was, then count this one as rejected.
            with contextlib.suppress(Exception):
                self.pool.set_plan_destinations(previous.destinations)
                self.picker.install(previous)
            log.exception("installing plan %s failed", table.version)
            self._reject(origin, f"cannot install: {describe(exc)}", digest)
            return False
        version = table.version
        self.version = version
        self.last_error = None
        self._rejected_digest = None
        self._applied_digest = digest
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
            try:
                listener()
            except Exception:
                log.exception("a listener of plan %s failed", version)
        return True

    def _reject_if_current(self, submission: int, origin: str, error: str, digest: str) -> None:
        if self._submissions == submission:
            self._reject(origin, error, digest)

    def reject(self, origin: str, error: str) -> None:
        """Count a payload its source could not even assemble (unreadable files, bad base64)."""
        self._reject(origin, error, f"{origin}: {error}")

    def _reject(self, origin: str, error: str, digest: str | None) -> None:
        if digest and digest == self._rejected_digest:
            return
        self._rejected_digest = digest or None
        self.last_error = error
        if self.metrics is not None:
            self.metrics.plan_rejected_total.inc()
        kept = f"keeping plan {self.version}" if self.version else "no plan in effect"
        log.warning("plan from %s rejected (%s); %s", origin, error, kept)


class DirectoryPlanSource:
    """A mounted ConfigMap directory, polled for changes.

    The kubelet updates a ConfigMap volume by writing a new timestamped directory and swapping
    the `..data` symlink; files are read through the resolved link so one read never mixes two
    versions. A plain directory (written by hand or by tests) works too. File types and sizes
    are checked before anything is read (a payload past `MAX_PAYLOAD_BYTES` is rejected unread),
    and `run` reads in a worker thread.
    """

    def __init__(self, path: Path, store: PlanStore, *, interval: float, settle: float = 0.0) -> None:
        self.path = path
        self.store = store
        self.interval = interval
        # The plan volume projects several ConfigMaps: the kubelet may write it between the
        # operator's shard writes and its header write.
        self.settle = settle
        self._last: object = None
        self._failing = False

    def _base(self) -> Path:
        data = self.path / "..data"
        return Path(os.path.realpath(data)) if data.exists() else self.path

    def _entries(self) -> tuple[Path, list[tuple[str, os.stat_result]]]:
        base = self._base()
        names = sorted(n for n in os.listdir(base) if PLAN_FILE.match(n))
        return base, [(name, os.stat(base / name)) for name in names]

    def signature(self) -> object:
        """Changes whenever the payload may have changed (link target, inode, mtime, size)."""
        try:
            base, entries = self._entries()
        except OSError:
            return None
        return (str(base), tuple((n, st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode) for n, st in entries))

    def read(self) -> dict[str, bytes] | None:
        """The payload's files; None while the kubelet swaps the directory (read again next poll).

        Raises PlanError for files that can never be a plan: a plan file that is not a regular
        file, more files than a plan has, or more bytes than a plan may hold.
        """
        try:
            base, entries = self._entries()
            if len(entries) > MAX_SHARDS + 1:
                raise PlanError(f"{len(entries)} plan files: a plan has at most {MAX_SHARDS} shards and a header")
            total = 0
            for name, st in entries:
                if not stat.S_ISREG(st.st_mode):
                    raise PlanError(f"{name} is not a regular file")
                total += st.st_size
            if total > MAX_PAYLOAD_BYTES:
                raise PlanError(f"plan files of {total:,} bytes: a payload holds at most {MAX_PAYLOAD_BYTES:,}")
            files: dict[str, bytes] = {}
            budget = MAX_PAYLOAD_BYTES
            for name, _st in entries:
                with open(base / name, "rb") as handle:
                    # Bounded even when a file grows between stat and read.
                    files[name] = data = handle.read(budget + 1)
                budget -= len(data)
                if budget < 0:
                    raise PlanError(f"plan files grew past {MAX_PAYLOAD_BYTES:,} bytes while read")
            return files
        except OSError:
            return None

    def poll(self) -> bool:
        """Submit the payload if it changed since the last poll; True when something was submitted."""
        signature = self.signature()
        if signature is None or signature == self._last:
            return False
        try:
            files = self.read()
        except PlanError as exc:
            return self._refuse(signature, exc)
        return self._submit(signature, files)

    async def poll_async(self) -> bool:
        """`poll`, with the files read in a worker thread."""
        signature = self.signature()
        if signature is None or signature == self._last:
            return False
        try:
            files = await asyncio.to_thread(self.read)
        except PlanError as exc:
            return self._refuse(signature, exc)
        return self._submit(signature, files)

    def _refuse(self, signature: object, exc: PlanError) -> bool:
        self._last = signature
        self.store.reject(str(self.path), str(exc))
        return False

    def _submit(self, signature: object, files: dict[str, bytes] | None) -> bool:
        if files is None:
            return False
        self._last = signature
        if HEADER_FILE not in files:
            log.warning("plan directory %s has no %s yet", self.path, HEADER_FILE)
            return False
        self.store.submit(files, origin=str(self.path), settle=self.settle)
        return True

    async def run(self) -> None:
        while True:
            try:
                await self.poll_async()
                self._failing = False
            except Exception as exc:
                # Logged when polling starts to fail, not on every poll while it keeps failing.
                if not self._failing:
                    log.warning("polling plan directory %s failed: %s", self.path, describe(exc))
                self._failing = True
            # Polling period: a changed plan takes effect within `interval` plus decode time.
            await asyncio.sleep(self.interval)
