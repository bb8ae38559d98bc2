"""The plan ConfigMap format: the contract between operator and router.

A plan is a set of files, each gzip-compressed, that the operator stores as `binaryData` of one or
more ConfigMaps and the router reads from a projected volume (all files in one directory) or
from the API:

- `plan.json.gz`: the header (schema, pool, version, destinations, key extraction, spill
  threshold, summary) and the list of route shards with their sha256;
- `routes-NNNN.bin.gz`: route shards, each holding a contiguous run of the sorted key hashes.

Shard layout (little-endian): magic `CRRT`, u16 format, u16 reserved, u32 n, u64[n] key deltas
(first key absolute), u8[n] destination counts, u16[sum(counts)] destination indexes.
Delta-coding the sorted keys lets gzip drop their high zero bytes. Shards keep each ConfigMap
under the API server's 1 MiB object limit; the first shard shares the `<pool>-plan` object with
the header, shard i > 0 goes into `<pool>-plan-<i>`.

The version is a content hash of everything but the generation time (the summary included), so
the same plan gives the same version whenever it is computed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from cacheroute.planner.plan import (
    MAX_DESTINATIONS,
    MAX_DESTINATIONS_PER_ROUTE,
    MAX_ROUTES,
    PLAN_SCHEMA,
    Destination,
    KeyExtraction,
    Plan,
    PlanError,
    PlanSummary,
    validate_plan,
)

HEADER_FILE = "plan.json.gz"
SHARD_MAGIC = b"CRRT"
SHARD_FORMAT = 1
# The API server refuses objects over 1 MiB; leave room for metadata and the header.
DEFAULT_MAX_OBJECT_BYTES = 900_000


class IncompletePayloadError(PlanError):
    """Shards that do not match their header: the payload may be caught between the writes of
    its ConfigMaps (shards first, header last) rather than broken."""


def shard_file(index: int) -> str:
    return f"routes-{index:04d}.bin.gz"


def configmap_name(pool: str, shard_index: int) -> str:
    return f"{pool}-plan" if shard_index == 0 else f"{pool}-plan-{shard_index}"


@dataclass(frozen=True)
class PlanPayload:
    """Encoded plan: file name -> gzip bytes, and which ConfigMap holds which files."""

    version: str
    files: dict[str, bytes]
    configmaps: dict[str, tuple[str, ...]]

    @property
    def total_bytes(self) -> int:
        return sum(len(b) for b in self.files.values())


def _gzip(raw: bytes) -> bytes:
    # mtime=0 keeps the bytes a pure function of the content.
    return gzip.compress(raw, compresslevel=6, mtime=0)


def _encode_shard(plan: Plan, lo: int, hi: int) -> bytes:
    keys = plan.route_keys[lo:hi]
    deltas = np.diff(keys, prepend=np.uint64(0)).astype("<u8") if len(keys) else keys.astype("<u8")
    offsets = plan.route_offsets[lo : hi + 1]
    counts = np.diff(offsets)
    if len(counts) and int(counts.max()) > 255:
        raise PlanError("a key has more than 255 destinations")
    dests = plan.route_dests[int(offsets[0]) : int(offsets[-1])].astype("<u2")
    head = SHARD_MAGIC + np.array([SHARD_FORMAT, 0], "<u2").tobytes() + np.array([hi - lo], "<u4").tobytes()
    return head + deltas.tobytes() + counts.astype("u1").tobytes() + dests.tobytes()


def _decode_shard(
    raw: bytes, name: str
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64], npt.NDArray[np.uint16]]:
    if len(raw) < 12 or raw[:4] != SHARD_MAGIC:
        raise PlanError(f"{name}: not a route shard")
    fmt = int(np.frombuffer(raw, "<u2", 1, 4)[0])
    if fmt != SHARD_FORMAT:
        raise PlanError(f"{name}: shard format {fmt} is not supported (expected {SHARD_FORMAT})")
    n = int(np.frombuffer(raw, "<u4", 1, 8)[0])
    pos = 12
    if len(raw) < pos + 9 * n:
        raise PlanError(f"{name}: truncated")
    keys = np.cumsum(np.frombuffer(raw, "<u8", n, pos), dtype=np.uint64)
    pos += 8 * n
    counts = np.frombuffer(raw, "u1", n, pos).astype(np.int64)
    pos += n
    total = int(counts.sum())
    if len(raw) != pos + 2 * total:
        raise PlanError(f"{name}: size does not match its destination counts")
    dests = np.frombuffer(raw, "<u2", total, pos).astype(np.uint16)
    return keys, counts, dests


def _destination(d: Destination) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": d.id, "address": d.address, "weight": d.weight, "kvCapacityTokens": d.kv_capacity_tokens
    }
    if d.host_kv_capacity_tokens:
        # Only when there is a host tier, so plans of pools without one keep their version hash.
        out["hostKvCapacityTokens"] = d.host_kv_capacity_tokens
    return out


def _entry_credit(plan: Plan) -> dict[str, float]:
    # Only below 1, so plans that keep keys on their entries keep their version hash and routers
    # that predate the field read them as they always have.
    return {"entryCredit": plan.entry_credit} if plan.entry_credit < 1.0 else {}


def _header_body(plan: Plan) -> dict[str, Any]:
    s = plan.summary
    return {
        "schema": PLAN_SCHEMA,
        "pool": plan.pool,
        "destinations": [_destination(d) for d in plan.destinations],
        "spillThreshold": plan.spill_threshold,
        **_entry_credit(plan),
        "keyExtraction": {
            "header": plan.key_extraction.header,
            "bodyField": plan.key_extraction.body_field,
            "sessionHeader": plan.key_extraction.session_header,
            "promptPrefixChars": plan.key_extraction.prompt_prefix_chars,
        },
        "summary": {
            "admittedKeys": s.admitted_keys,
            "admittedRequestShare": s.admitted_request_share,
            "admittedTokenShare": s.admitted_token_share,
            "churn": s.churn,
            "predictedLoad": dict(sorted(s.predicted_load.items())),
            "predictedKvHit": s.predicted_kv_hit,
            "reason": s.reason,
        },
        "routeCount": len(plan),
    } | (
        # Only when some are, so plans without pinned routes keep their version hash.
        {"pinnedKeys": [f"{k:016x}" for k in plan.pinned_keys.tolist()]} if len(plan.pinned_keys) else {}
    )


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _split(plan: Plan, max_object_bytes: int) -> list[tuple[int, int]]:
    n = len(plan)
    shards = 1
    while True:
        bounds = [(n * i // shards, n * (i + 1) // shards) for i in range(shards)]
        sizes = [len(_gzip(_encode_shard(plan, lo, hi))) for lo, hi in bounds]
        if max(sizes) <= max_object_bytes:
            return bounds
        shards = max(shards + 1, math.ceil(shards * max(sizes) / max_object_bytes * 1.05))


def encode_plan(plan: Plan, max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> PlanPayload:
    """Encode a plan into gzip files, sharded so no ConfigMap exceeds `max_object_bytes`."""
    bounds = _split(plan, max_object_bytes)
    raw_shards = [_encode_shard(plan, lo, hi) for lo, hi in bounds]
    body = _header_body(plan)
    body["shards"] = [
        {
            "file": shard_file(i),
            "configMap": configmap_name(plan.pool, i),
            "routes": hi - lo,
            "sha256": hashlib.sha256(raw).hexdigest(),
        }
        for i, ((lo, hi), raw) in enumerate(zip(bounds, raw_shards, strict=True))
    ]
    version = hashlib.sha256(_canonical(body)).hexdigest()[:16]
    header = dict(body, version=version, generatedAt=plan.generated_at)
    files = {HEADER_FILE: _gzip(_canonical(header))}
    configmaps: dict[str, list[str]] = {configmap_name(plan.pool, 0): [HEADER_FILE]}
    for i, raw in enumerate(raw_shards):
        files[shard_file(i)] = _gzip(raw)
        configmaps.setdefault(configmap_name(plan.pool, i), []).append(shard_file(i))
    return PlanPayload(version=version, files=files, configmaps={k: tuple(v) for k, v in configmaps.items()})


def _gunzip(data: bytes, name: str, limit: int) -> bytes:
    """Inflate one gzip member, stopping as soon as the output would pass `limit` bytes.

    Inflating incrementally is what bounds a router's memory: a few kilobytes of gzip can
    expand to gigabytes, and nothing past the limit is ever produced.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PlanError(f"{name}: expected bytes, got {type(data).__name__}")
    if len(data) > max_compressed_bytes(limit):
        raise PlanError(f"{name}: {len(data):,} bytes of gzip for at most {limit:,} bytes of content")
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        raw = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise PlanError(f"{name}: not valid gzip ({exc})") from None
    if len(raw) > limit:
        raise PlanError(f"{name}: inflates past the limit of {limit:,} bytes")
    if not inflater.eof:
        raise PlanError(f"{name}: gzip stream ends early (truncated)")
    if inflater.unused_data:
        raise PlanError(f"{name}: {len(inflater.unused_data):,} bytes after the gzip stream")
    return raw


def max_shard_bytes(routes: int) -> int:
    """Largest raw shard of `routes` routes: head, key deltas, counts, destination indexes."""
    return _SHARD_HEAD + routes * (8 + 1 + 2 * MAX_DESTINATIONS_PER_ROUTE)


def max_compressed_bytes(limit: int) -> int:
    """Largest gzip of `limit` bytes of content (stored blocks cost 5 bytes per 64 KiB, plus framing)."""
    return limit + limit // 1000 + 1024


# The inflated-size limit of a payload, derived from the route cap: the header, plus the largest
# shards MAX_ROUTES routes of MAX_DESTINATIONS_PER_ROUTE destinations each can take.
MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_SHARDS = 256
_SHARD_HEAD = 12
MAX_INFLATED_BYTES = MAX_HEADER_BYTES + MAX_SHARDS * _SHARD_HEAD + max_shard_bytes(MAX_ROUTES) - _SHARD_HEAD
MAX_PAYLOAD_BYTES = max_compressed_bytes(MAX_INFLATED_BYTES)
_SHARD_NAME = re.compile(r"^routes-\d{4}\.bin\.gz$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_VERSION = re.compile(r"^[0-9a-f]{16}$")
_KEY_HASH = _VERSION


def _reject_constant(name: str) -> None:
    raise PlanError(f"{HEADER_FILE}: {name} is not a JSON number")


def read_header(files: Mapping[str, bytes]) -> dict[str, Any]:
    """The decoded header, checked for size, encoding and schema; raises PlanError."""
    if HEADER_FILE not in files:
        raise PlanError(f"{HEADER_FILE} is missing")
    raw = _gunzip(files[HEADER_FILE], HEADER_FILE, MAX_HEADER_BYTES)
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise PlanError(f"{HEADER_FILE}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise PlanError(f"{HEADER_FILE}: nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{HEADER_FILE}: not JSON ({exc})") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise PlanError(f"{HEADER_FILE}: not a usable JSON document ({exc})") from None
    if not isinstance(header, dict) or header.get("schema") != PLAN_SCHEMA:
        got = header.get("schema") if isinstance(header, dict) else type(header).__name__
        raise PlanError(f"{HEADER_FILE}: schema {got!r} is not {PLAN_SCHEMA!r}")
    version = header.get("version")
    if not isinstance(version, str) or not _VERSION.match(version):
        raise PlanError(f"{HEADER_FILE}: version {version!r} is not 16 hex digits")
    return header


class _Fields:
    """Typed access to one JSON object of the header; errors name the field's path."""

    def __init__(self, obj: object, where: str) -> None:
        if not isinstance(obj, dict):
            raise PlanError(f"{where} must be an object, got {type(obj).__name__}")
        self.obj = obj
        self.where = where

    def _get(self, key: str, optional: bool) -> object:
        if key not in self.obj:
            if optional:
                return None
            raise PlanError(f"{self.where}.{key} is missing")
        return self.obj[key]

    def text(self, key: str, *, optional: bool = False) -> str | None:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise PlanError(f"{self.where}.{key} must be a string, got {_show(value)}")
        return value

    def integer(self, key: str) -> int:
        value = self._get(key, False)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{self.where}.{key} must be an integer, got {_show(value)}")
        return value

    def number(self, key: str, *, optional: bool = False) -> float | None:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PlanError(f"{self.where}.{key} must be a number, got {_show(value)}")
        x = float(value)
        if not math.isfinite(x):
            raise PlanError(f"{self.where}.{key} is {_show(value)}: not a finite number")
        return x

    def items(self, key: str, limit: int) -> list[Any]:
        value = self._get(key, False)
        if not isinstance(value, list):
            raise PlanError(f"{self.where}.{key} must be a list, got {_show(value)}")
        if len(value) > limit:
            raise PlanError(f"{self.where}.{key} has {len(value):,} entries, at most {limit:,} allowed")
        return value

    def child(self, key: str) -> _Fields:
        return _Fields(self._get(key, False), f"{self.where}.{key}")


def _show(value: object) -> str:
    text = repr(value) if isinstance(value, str | int | float | bool) or value is None else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _destinations(header: _Fields) -> tuple[Destination, ...]:
    out = []
    for i, item in enumerate(header.items("destinations", MAX_DESTINATIONS)):
        d = _Fields(item, f"destinations[{i}]")
        out.append(
            Destination(
                str(d.text("id")),
                str(d.text("address")),
                float(d.number("weight") or 0.0),
                d.integer("kvCapacityTokens"),
                d.integer("hostKvCapacityTokens") if "hostKvCapacityTokens" in d.obj else 0,
            )
        )
    return tuple(out)


def _key_extraction(header: _Fields) -> KeyExtraction:
    ke = header.child("keyExtraction")
    return KeyExtraction(
        str(ke.text("header")),
        ke.text("bodyField", optional=True),
        ke.text("sessionHeader", optional=True),
        ke.integer("promptPrefixChars"),
    )


def _summary(header: _Fields) -> PlanSummary:
    sm = header.child("summary")
    loads = sm.child("predictedLoad")
    if len(loads.obj) > MAX_DESTINATIONS:
        raise PlanError(f"summary.predictedLoad has more than {MAX_DESTINATIONS} entries")
    return PlanSummary(
        admitted_keys=sm.integer("admittedKeys"),
        admitted_request_share=float(sm.number("admittedRequestShare") or 0.0),
        admitted_token_share=float(sm.number("admittedTokenShare") or 0.0),
        churn=float(sm.number("churn") or 0.0),
        predicted_load={str(k): float(loads.number(k) or 0.0) for k in loads.obj},
        predicted_kv_hit=sm.number("predictedKvHit", optional=True),
        reason=str(sm.text("reason")),
    )


def _shards(header: _Fields) -> list[tuple[str, str, int, str]]:
    """(file, configMap, routes, sha256) of every shard, checked against the route cap."""
    shards = []
    total = 0
    for i, item in enumerate(header.items("shards", MAX_SHARDS)):
        sh = _Fields(item, f"shards[{i}]")
        name = str(sh.text("file"))
        if not _SHARD_NAME.match(name):
            raise PlanError(f"shards[{i}].file {name[:40]!r} is not routes-NNNN.bin.gz")
        routes = sh.integer("routes")
        if not 0 <= routes <= MAX_ROUTES:
            raise PlanError(f"shards[{i}].routes is {routes}: must be in 0-{MAX_ROUTES:,}")
        digest = str(sh.text("sha256"))
        if not _SHA256.match(digest):
            raise PlanError(f"shards[{i}].sha256 is not 64 lower-case hex digits")
        total += routes
        shards.append((name, str(sh.text("configMap")), routes, digest))
    if total > MAX_ROUTES:
        raise PlanError(f"the shards hold {total:,} routes: a plan holds at most {MAX_ROUTES:,}")
    count = header.integer("routeCount")
    if count != total:
        raise PlanError(f"routeCount {count:,} does not match the {total:,} routes of the shards")
    if len({s[0] for s in shards}) != len(shards):
        raise PlanError("a shard file is listed twice")
    return shards


def _pinned_keys(header: _Fields) -> npt.NDArray[np.uint64]:
    """The pinned route keys (`Plan.pinned_keys`), 16 hex digits each; none when absent."""
    if "pinnedKeys" not in header.obj:
        return np.zeros(0, dtype=np.uint64)
    out = []
    for i, item in enumerate(header.items("pinnedKeys", MAX_ROUTES)):
        if not isinstance(item, str) or not _KEY_HASH.match(item):
            raise PlanError(f"header.pinnedKeys[{i}] is {_show(item)}: not 16 lower-case hex digits")
        out.append(int(item, 16))
    return np.array(out, dtype=np.uint64)


def decode_plan(files: Mapping[str, bytes]) -> Plan:
    """Decode and verify a plan payload (all files of all its ConfigMaps); raises PlanError.

    Every field is type-checked, every file is inflated only up to its limit (derived from the
    route counts the header declares, themselves capped by MAX_ROUTES), and the result passes
    `validate_plan`; nothing else is raised, whatever the bytes.
    """
    try:
        return _decode(files)
    except PlanError:
        raise
    except RecursionError:
        raise PlanError("plan nested too deeply") from None
    except (ValueError, TypeError, KeyError, OverflowError, MemoryError) as exc:
        raise PlanError(f"malformed plan: {exc!r}") from None


def _decode(files: Mapping[str, bytes]) -> Plan:
    raw_header = read_header(files)
    header = _Fields(raw_header, "header")
    body = {k: v for k, v in raw_header.items() if k not in ("version", "generatedAt")}
    if hashlib.sha256(_canonical(body)).hexdigest()[:16] != raw_header["version"]:
        raise PlanError("header does not match its version hash")
    destinations = _destinations(header)
    key_extraction = _key_extraction(header)
    summary = _summary(header)
    spill_threshold = float(header.number("spillThreshold") or 0.0)
    credit = header.number("entryCredit", optional=True)
    keys_parts, count_parts, dest_parts = [], [], []
    for name, configmap, routes, digest in _shards(header):
        if name not in files:
            raise IncompletePayloadError(f"shard {name} is missing (expected in ConfigMap {configmap[:253]})")
        raw = _gunzip(files[name], name, max_shard_bytes(routes))
        if hashlib.sha256(raw).hexdigest() != digest:
            raise IncompletePayloadError(f"shard {name} does not belong to plan version {raw_header['version']}")
        k, c, d = _decode_shard(raw, name)
        if len(k) != routes:
            raise PlanError(f"shard {name} holds {len(k):,} routes, the header says {routes:,}")
        keys_parts.append(k)
        count_parts.append(c)
        dest_parts.append(d)
    counts = np.concatenate(count_parts) if count_parts else np.zeros(0, np.int64)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    plan = Plan(
        pool=str(header.text("pool")),
        destinations=destinations,
        route_keys=np.concatenate(keys_parts) if keys_parts else np.zeros(0, np.uint64),
        route_offsets=offsets,
        route_dests=np.concatenate(dest_parts) if dest_parts else np.zeros(0, np.uint16),
        generated_at=header.text("generatedAt", optional=True) or "",
        spill_threshold=spill_threshold,
        entry_credit=1.0 if credit is None else float(credit),
        key_extraction=key_extraction,
        summary=summary,
        pinned_keys=_pinned_keys(header),
    )
    validate_plan(plan)
    return plan


def plan_version(files: Mapping[str, bytes]) -> str:
    """Version of a payload without decoding its routes (cheap change detection)."""
    return str(read_header(files)["version"])
