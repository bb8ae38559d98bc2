"""Plan payloads as an adversary (or a buggy producer) would write them, for tests of the readers.

`forge` re-signs a modified header (the version hash matches again), so what a reader rejects
is the content itself, not a stale hash; `bad_payloads` lists one payload per class of defect.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import zlib
from collections.abc import Callable
from typing import Any

from cacheroute.planner.plan import Plan
from cacheroute.planner.plan_format import HEADER_FILE, MAX_HEADER_BYTES, encode_plan

Files = dict[str, bytes]


def header_of(files: Files) -> dict[str, Any]:
    header: dict[str, Any] = json.loads(gzip.decompress(files[HEADER_FILE]))
    return header


def sign(header: dict[str, Any]) -> dict[str, Any]:
    """The header with `version` recomputed the way the encoder does it."""
    body = {k: v for k, v in header.items() if k not in ("version", "generatedAt")}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return dict(header, version=hashlib.sha256(canonical).hexdigest()[:16])


def with_header(files: Files, header: dict[str, Any]) -> Files:
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return {**files, HEADER_FILE: gzip.compress(raw, mtime=0)}


def forge(files: Files, change: Callable[[dict[str, Any]], None]) -> Files:
    """`files` with `change` applied to a copy of the header, re-signed."""
    header = copy.deepcopy(header_of(files))
    change(header)
    return with_header(files, sign(header))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        target: Any = header
        parts = path.split(".")
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        last = parts[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return change


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        target: Any = header
        parts = path.split(".")
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        del target[parts[-1]]

    return change


def bomb(size: int) -> bytes:
    """A little gzip that inflates to `size` zero bytes (made without holding them all)."""
    packer = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1 << 20)
    parts = []
    for _ in range(size >> 20):
        parts.append(packer.compress(chunk))
    parts.append(packer.compress(bytes(size & ((1 << 20) - 1))))
    parts.append(packer.flush())
    return b"".join(parts)


def bad_payloads(plan: Plan) -> dict[str, Files]:
    """One payload per class of defect, each derived from the valid `plan`."""
    good = dict(encode_plan(plan).files)
    deep = b'{"schema":"cacheroute.dev/plan/v1","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return {
        "header not gzip": {**good, HEADER_FILE: b"plain text"},
        "header not UTF-8": {**good, HEADER_FILE: gzip.compress(b'{"schema": "\xff\xfe"}', mtime=0)},
        "header nested deeply": {**good, HEADER_FILE: gzip.compress(deep, mtime=0)},
        "header is a list": {**good, HEADER_FILE: gzip.compress(b"[1, 2, 3]", mtime=0)},
        "header with NaN": {
            **good,
            HEADER_FILE: gzip.compress(
                json.dumps(dict(sign(header_of(good)), spillThreshold=float("nan"))).encode(), mtime=0
            ),
        },
        "header inflates past its limit": {**good, HEADER_FILE: bomb(MAX_HEADER_BYTES + 1)},
        "header cut short": {**good, HEADER_FILE: good[HEADER_FILE][:-10]},
        "missing pool": forge(good, _drop("pool")),
        "missing destinations": forge(good, _drop("destinations")),
        "missing shards": forge(good, _drop("shards")),
        "pool is a number": forge(good, _set("pool", 7)),
        "destinations is a string": forge(good, _set("destinations", "all")),
        "destination id is a list": forge(good, _set("destinations.0.id", ["a"])),
        "weight is a string": forge(good, _set("destinations.0.weight", "1.0")),
        "weight is a bool": forge(good, _set("destinations.0.weight", True)),
        "kv capacity is a float": forge(good, _set("destinations.0.kvCapacityTokens", 1.5)),
        "address not an address": forge(good, _set("destinations.0.address", "not-an-address")),
        "address port out of range": forge(good, _set("destinations.0.address", "10.0.0.1:70000")),
        "address without port": forge(good, _set("destinations.0.address", "10.0.0.1")),
        "spill threshold a string": forge(good, _set("spillThreshold", "1.5")),
        "spill threshold below 1": forge(good, _set("spillThreshold", 0.5)),
        "spill threshold huge": forge(good, _set("spillThreshold", 1e308)),
        "key header a number": forge(good, _set("keyExtraction.header", 5)),
        "key header not a header name": forge(good, _set("keyExtraction.header", "x key\n")),
        "body field a list": forge(good, _set("keyExtraction.bodyField", ["user"])),
        "prompt prefix negative": forge(good, _set("keyExtraction.promptPrefixChars", -1)),
        "prompt prefix huge": forge(good, _set("keyExtraction.promptPrefixChars", 10**30)),
        "route count lies": forge(good, _set("routeCount", 12345)),
        "shard routes past the cap": forge(good, _set("shards.0.routes", 10**9)),
        "shard sha not hex": forge(good, _set("shards.0.sha256", "zz")),
        "shard file name odd": forge(good, _set("shards.0.file", "../../etc/passwd")),
        "version mismatch": with_header(good, dict(header_of(good), pool="other")),
        "shard cut short": {**good, "routes-0000.bin.gz": good["routes-0000.bin.gz"][:-8]},
        "shard inflates past its limit": {**good, "routes-0000.bin.gz": bomb(4 << 20)},
        "shard missing": {k: v for k, v in good.items() if k != "routes-0000.bin.gz"},
        "shard with trailing bytes": {**good, "routes-0000.bin.gz": good["routes-0000.bin.gz"] + b"junk"},
    }
