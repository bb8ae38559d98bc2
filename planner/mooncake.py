"""Mooncake-format request traces (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

`hash_ids` are prefix-chained ids of 512-token blocks (see `traces/README.md`). The traces carry
no affinity key, so one is derived:

- `first-blocks:K`: the first K block ids (a request with fewer blocks keys on all of its own);
- `thread`: the inferred conversation thread (`infer_threads`);
- `none`: no key (every request unplanned).

Parsing is pure (`parse_mooncake_lines` takes lines); `read_mooncake` is the thin file reader.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from cacheroute.planner.trace import NO_KEY, RequestTrace

MOONCAKE_BLOCK_SIZE = 512
# Bounds of believable trace fields: about 30 years in milliseconds, a 10M-token request.
MAX_TIMESTAMP_MS = 1e12
MAX_TOKENS = 10_000_000
_INT64 = (-(2**63), 2**63 - 1)


class TraceFormatError(ValueError):
    """A trace line that is not valid Mooncake format; the message names the line and field."""


def parse_key_spec(spec: str) -> tuple[str, int]:
    """`first-blocks:4` -> ("first-blocks", 4); `thread` -> ("thread", 0); `none` -> ("none", 0)."""
    s = spec.strip().lower()
    if s in ("thread", "none"):
        return s, 0
    if s.startswith("first-blocks:"):
        try:
            k = int(s.split(":", 1)[1])
        except ValueError:
            k = 0
        if k >= 1:
            return "first-blocks", k
    raise ValueError(f"key {spec!r} is not one of: first-blocks:K (K >= 1), thread, none")


def _field_int(obj: dict[str, object], name: str, where: str, minimum: int, maximum: int = MAX_TOKENS) -> int:
    if name not in obj:
        raise TraceFormatError(f"{where}: field {name!r} is missing")
    v = obj.get(name)
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or not math.isfinite(v)
        or v != int(v)
        or not minimum <= int(v) <= maximum
    ):
        raise TraceFormatError(f"{where}: field {name!r} must be an integer in [{minimum}, {maximum}], got {v!r}")
    return int(v)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_mooncake_lines(
    lines: Iterable[str],
    *,
    key: str = "first-blocks:4",
    name: str = "mooncake",
    block_size: int = MOONCAKE_BLOCK_SIZE,
    source: str | None = None,
) -> RequestTrace:
    """Build a trace from Mooncake JSON lines (blank lines skipped), stably sorted by timestamp.

    Errors name the line in `source` (the file, say), else in `name`."""
    parse_key_spec(key)
    ts: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    lens: list[int] = []
    ids: list[int] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source or name} line {lineno}"
        try:
            obj = json.loads(line, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # NaN/Infinity, integers of thousands of digits, deep nesting
            raise TraceFormatError(f"{where}: not a usable JSON object ({exc or type(exc).__name__})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object")
        t = obj.get("timestamp")
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= MAX_TIMESTAMP_MS:
            raise TraceFormatError(
                f"{where}: field 'timestamp' must be a number of milliseconds in [0, {MAX_TIMESTAMP_MS:g}], got {t!r}"
            )
        n_in = _field_int(obj, "input_length", where, 1)
        n_out = _field_int(obj, "output_length", where, 0)
        h = obj.get("hash_ids")
        lo, hi = _INT64
        if not isinstance(h, list) or not all(type(x) is int and lo <= x <= hi for x in h):
            raise TraceFormatError(f"{where}: field 'hash_ids' must be a list of 64-bit integers")
        expected = -(-n_in // block_size)
        if len(h) != expected:
            raise TraceFormatError(
                f"{where}: {len(h)} hash_ids for input_length {n_in}, expected {expected} "
                f"(blocks of {block_size} tokens)"
            )
        ts.append(float(t) / 1000.0)
        inp.append(n_in)
        out.append(n_out)
        lens.append(len(h))
        ids.extend(h)
    if not ts:
        raise TraceFormatError(f"{name}: no requests")
    order = np.argsort(np.asarray(ts), kind="stable")
    lens_a = np.asarray(lens, dtype=np.int64)
    offs = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens_a, out=offs[1:])
    ids_a = np.asarray(ids, dtype=np.int64)
    if not np.array_equal(order, np.arange(len(order))):
        ids_a = np.concatenate([ids_a[offs[i] : offs[i + 1]] for i in order])
        lens_a = lens_a[order]
        offs = np.zeros(len(lens_a) + 1, dtype=np.int64)
        np.cumsum(lens_a, out=offs[1:])
    base = RequestTrace(
        arrival_s=np.asarray(ts, dtype=np.float64)[order],
        key=np.full(len(ts), NO_KEY, dtype=np.int64),
        input_tokens=np.asarray(inp, dtype=np.int64)[order],
        output_tokens=np.asarray(out, dtype=np.int64)[order],
        block_offsets=offs,
        block_ids=ids_a,
        block_size=block_size,
        key_names=(),
        name=name,
    )
    return with_keys(base, key)


def read_mooncake(path: str | Path, *, key: str = "first-blocks:4", name: str | None = None) -> RequestTrace:
    """Read a Mooncake JSONL file (the only I/O in trace handling)."""
    p = Path(path)
    # utf-8-sig: a file saved with a byte-order mark (as some editors write them) reads the same.
    with p.open("r", encoding="utf-8-sig") as fh:
        return parse_mooncake_lines(fh, key=key, name=name or p.stem, source=str(p))


def _dense(labels: list[tuple[int, ...]] | list[int], prefix: str) -> tuple[npt.NDArray[np.int64], tuple[str, ...]]:
    index: dict[object, int] = {}
    key = np.empty(len(labels), dtype=np.int64)
    names: list[str] = []
    for i, lab in enumerate(labels):
        k = index.get(lab)
        if k is None:
            k = len(names)
            index[lab] = k
            names.append(prefix + ("-".join(map(str, lab)) if isinstance(lab, tuple) else str(lab)))
        key[i] = k
    return key, tuple(names)


def with_keys(trace: RequestTrace, spec: str) -> RequestTrace:
    """The same requests keyed per `spec` (see the module docstring)."""
    kind, k = parse_key_spec(spec)
    n = len(trace)
    if kind == "none":
        key = np.full(n, NO_KEY, dtype=np.int64)
        names: tuple[str, ...] = ()
    elif kind == "first-blocks":
        offs = trace.block_offsets
        ids = trace.block_ids
        labels = [tuple(ids[offs[i] : min(offs[i] + k, offs[i + 1])].tolist()) for i in range(n)]
        key, names = _dense(labels, f"fb{k}:")
    else:
        threads = infer_threads(trace)
        key, names = _dense(threads.tolist(), "thread:")
    return RequestTrace(
        arrival_s=trace.arrival_s,
        key=key,
        input_tokens=trace.input_tokens,
        output_tokens=trace.output_tokens,
        block_offsets=trace.block_offsets,
        block_ids=trace.block_ids,
        block_size=trace.block_size,
        key_names=names,
        name=trace.name,
    )


def infer_parents(trace: RequestTrace) -> npt.NDArray[np.int64]:
    """Thread proxy (traces/README.md): request r continues an earlier request p when r's prompt
    contains the last full block that was new when p arrived; of several such p, the one whose
    block lies deepest in r's prompt. Returns the parent index of every request, -1 for none."""
    n = len(trace)
    offs = trace.block_offsets.tolist()
    ids = trace.block_ids
    full_blocks = (trace.input_tokens // trace.block_size).tolist()
    seen: set[int] = set()
    owner: dict[int, int] = {}
    parent = np.full(n, -1, dtype=np.int64)
    for r in range(n):
        blocks: list[int] = ids[offs[r] : offs[r + 1]].tolist()
        for b in reversed(blocks):
            p = owner.get(b)
            if p is not None:
                parent[r] = p
                break
        marker = None
        for b in blocks[: full_blocks[r]]:
            if b not in seen:
                marker = b
        seen.update(blocks)
        if marker is not None:
            owner[marker] = r
    return parent


def infer_threads(trace: RequestTrace) -> npt.NDArray[np.int64]:
    """Thread id of every request: the index of the first request of its parent chain."""
    parent = infer_parents(trace)
    thread = np.arange(len(trace), dtype=np.int64)
    for r in range(len(trace)):
        p = int(parent[r])
        if p >= 0:
            thread[r] = thread[p]
    return thread
