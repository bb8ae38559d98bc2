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

The version is a content hash of everything but the generation time, so the same routes give
the same version whenever they are computed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from cacheroute.planner.plan import (
    PLAN_SCHEMA,
    Destination,
    KeyExtraction,
    Plan,
    PlanError,
    PlanSummary,
)

HEADER_FILE = "plan.json.gz"
SHARD_MAGIC = b"CRRT"
SHARD_FORMAT = 1
# The API server refuses objects over 1 MiB; leave room for metadata and the header.
DEFAULT_MAX_OBJECT_BYTES = 900_000


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


def _header_body(plan: Plan) -> dict[str, Any]:
    s = plan.summary
    return {
        "schema": PLAN_SCHEMA,
        "pool": plan.pool,
        "destinations": [_destination(d) for d in plan.destinations],
        "spillThreshold": plan.spill_threshold,
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


def _gunzip(data: bytes, name: str) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as exc:
        raise PlanError(f"{name}: not valid gzip ({exc})") from exc


def read_header(files: Mapping[str, bytes]) -> dict[str, Any]:
    """The decoded header, validated for schema; raises PlanError."""
    if HEADER_FILE not in files:
        raise PlanError(f"{HEADER_FILE} is missing")
    try:
        header = json.loads(_gunzip(files[HEADER_FILE], HEADER_FILE))
    except json.JSONDecodeError as exc:
        raise PlanError(f"{HEADER_FILE}: not JSON ({exc})") from exc
    if not isinstance(header, dict) or header.get("schema") != PLAN_SCHEMA:
        got = header.get("schema") if isinstance(header, dict) else type(header).__name__
        raise PlanError(f"{HEADER_FILE}: schema {got!r} is not {PLAN_SCHEMA!r}")
    return header


def decode_plan(files: Mapping[str, bytes]) -> Plan:
    """Decode and verify a plan payload (all files of all its ConfigMaps); raises PlanError."""
    header = read_header(files)
    try:
        body = {k: v for k, v in header.items() if k not in ("version", "generatedAt")}
        if hashlib.sha256(_canonical(body)).hexdigest()[:16] != header["version"]:
            raise PlanError("header does not match its version hash")
        keys_parts, count_parts, dest_parts = [], [], []
        for shard in header["shards"]:
            name = shard["file"]
            if name not in files:
                raise PlanError(f"shard {name} is missing (expected in ConfigMap {shard['configMap']})")
            raw = _gunzip(files[name], name)
            if hashlib.sha256(raw).hexdigest() != shard["sha256"]:
                raise PlanError(f"shard {name} does not belong to plan version {header['version']}")
            k, c, d = _decode_shard(raw, name)
            keys_parts.append(k)
            count_parts.append(c)
            dest_parts.append(d)
        counts = np.concatenate(count_parts) if count_parts else np.zeros(0, np.int64)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ke = header["keyExtraction"]
        sm = header["summary"]
        return Plan(
            pool=header["pool"],
            destinations=tuple(
                Destination(d["id"], d["address"], float(d["weight"]), int(d["kvCapacityTokens"]),
                            int(d.get("hostKvCapacityTokens", 0)))
                for d in header["destinations"]
            ),
            route_keys=np.concatenate(keys_parts) if keys_parts else np.zeros(0, np.uint64),
            route_offsets=offsets,
            route_dests=np.concatenate(dest_parts) if dest_parts else np.zeros(0, np.uint16),
            generated_at=header.get("generatedAt", ""),
            spill_threshold=float(header["spillThreshold"]),
            pinned_keys=np.array([int(k, 16) for k in header.get("pinnedKeys", [])], dtype=np.uint64),
            key_extraction=KeyExtraction(
                ke["header"], ke["bodyField"], ke["sessionHeader"], int(ke["promptPrefixChars"])
            ),
            summary=PlanSummary(
                admitted_keys=int(sm["admittedKeys"]),
                admitted_request_share=float(sm["admittedRequestShare"]),
                admitted_token_share=float(sm["admittedTokenShare"]),
                churn=float(sm["churn"]),
                predicted_load={str(k): float(v) for k, v in sm["predictedLoad"].items()},
                predicted_kv_hit=sm["predictedKvHit"],
                reason=str(sm["reason"]),
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"malformed plan header: {exc!r}") from exc


def plan_version(files: Mapping[str, bytes]) -> str:
    """Version of a payload without decoding its routes (cheap change detection)."""
    return str(read_header(files)["version"])
