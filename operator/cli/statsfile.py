"""Per-key statistics files for `cacheroute plan --stats`.

Two formats, one row per key, with the columns `key, rate, prompt_tokens, prefix_tokens,
output_tokens` (rate in requests per second, the others mean tokens per request):

- CSV with a header row (`.csv`, or any file whose first character is not `{`);
- JSON lines, one object per line (`.jsonl`, `.ndjson`, `.json`, or a first character `{`), keys
  strings and numbers JSON numbers.

A row whose key is empty (or null in JSON) describes the traffic that carries no key (its
prefix_tokens is ignored); at most one such row.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic

COLUMNS = ("key", "rate", "prompt_tokens", "prefix_tokens", "output_tokens")
_NUMERIC = COLUMNS[1:]
# Beyond these a row describes no fleet (a million requests a second into one pool, prompts of ten
# million tokens), and sums over rows would overflow to inf.
_MAXIMA = {"rate": 1e6, "prompt_tokens": 1e7, "prefix_tokens": 1e7, "output_tokens": 1e7}


class StatsFileError(ValueError):
    """A statistics file that cannot be read; the message names the line and the column."""


def _number(value: object, column: str, where: str) -> float:
    if isinstance(value, bool):
        raise StatsFileError(f"{where}: column {column!r} must be a number, got {value!r}")
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise StatsFileError(f"{where}: column {column!r} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x < 0:
        raise StatsFileError(f"{where}: column {column!r} must be finite and >= 0, got {value!r}")
    if x > _MAXIMA[column]:
        raise StatsFileError(f"{where}: column {column!r} must be at most {_MAXIMA[column]:g}, got {value!r}")
    return x


def _csv_rows(text: str, source: str) -> Iterator[tuple[str, dict[str, object]]]:
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise StatsFileError(f"{source}: header lacks column(s) {', '.join(missing)} (need {', '.join(COLUMNS)})")
    reader.fieldnames = header
    for row in reader:
        where = f"{source} line {reader.line_num}"
        if None in row:  # DictReader files the cells past the header under None
            raise StatsFileError(f"{where}: {len(header) + len(row[None])} cells for {len(header)} columns")
        yield where, dict(row)


def _jsonl_rows(text: str, source: str) -> Iterator[tuple[str, dict[str, object]]]:
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise StatsFileError(f"{where}: not JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # integers of thousands of digits, deep nesting
            raise StatsFileError(f"{where}: not a usable JSON object ({type(exc).__name__})") from None
        if not isinstance(obj, dict):
            raise StatsFileError(f"{where}: expected a JSON object with {', '.join(COLUMNS)}")
        missing = [c for c in _NUMERIC if c not in obj]
        if missing or "key" not in obj:
            raise StatsFileError(
                f"{where}: missing field(s) {', '.join(['key', *missing] if 'key' not in obj else missing)}"
            )
        _check_json_types(obj, where)
        yield where, obj


def _check_json_types(obj: dict[str, object], where: str) -> None:
    # JSON says what a value is: a quoted number or a numeric key is a mistake upstream, which CSV
    # (all text) could not show.
    key = obj["key"]
    if key is not None and not isinstance(key, str):
        raise StatsFileError(f"{where}: field 'key' must be a string (or null for unkeyed traffic), got {key!r}")
    for c in _NUMERIC:
        value = obj[c]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise StatsFileError(f"{where}: field {c!r} must be a JSON number, got {value!r}")


def parse_stats(text: str, source: str = "<stats>", fmt: str | None = None) -> KeyStats:
    """Parse a statistics file's text; `fmt` is `csv` or `jsonl` (guessed from the text if None)."""
    kind = fmt or ("jsonl" if text.lstrip().startswith("{") else "csv")
    if kind not in ("csv", "jsonl"):
        raise StatsFileError(f"{source}: format {kind!r} is not csv or jsonl")
    rows: Iterable[tuple[str, dict[str, object]]] = (
        _csv_rows(text, source) if kind == "csv" else _jsonl_rows(text, source)
    )
    names: list[str] = []
    cols: dict[str, list[float]] = {c: [] for c in _NUMERIC}
    unkeyed: UnkeyedTraffic | None = None
    seen: dict[str, str] = {}
    for where, row in rows:
        raw_key = row.get("key")
        key = "" if raw_key is None else str(raw_key).strip()
        values = {c: _number(row.get(c), c, where) for c in _NUMERIC}
        if not key:
            if unkeyed is not None:
                raise StatsFileError(f"{where}: a second row without key (only one row may describe unkeyed traffic)")
            unkeyed = UnkeyedTraffic(values["rate"], values["prompt_tokens"], values["output_tokens"])
            continue
        if key in seen:
            raise StatsFileError(f"{where}: key {key!r} already given at {seen[key]}")
        seen[key] = where
        if values["prefix_tokens"] > values["prompt_tokens"]:
            raise StatsFileError(
                f"{where}: prefix_tokens {values['prefix_tokens']:g} exceeds prompt_tokens {values['prompt_tokens']:g}"
            )
        names.append(key)
        for c in _NUMERIC:
            cols[c].append(values[c])
    try:
        return KeyStats(
            names=tuple(names),
            rate=np.asarray(cols["rate"], dtype=np.float64),
            prompt_tokens=np.asarray(cols["prompt_tokens"], dtype=np.float64),
            prefix_tokens=np.asarray(cols["prefix_tokens"], dtype=np.float64),
            output_tokens=np.asarray(cols["output_tokens"], dtype=np.float64),
            unkeyed=unkeyed or UnkeyedTraffic(),
        )
    except PlanInputError as exc:
        raise StatsFileError(f"{source}: {exc}") from exc


def read_stats(path: Path) -> KeyStats:
    """Read a statistics file (format from its extension, else from its first character)."""
    try:
        text = path.read_text("utf-8-sig")  # a leading byte-order mark is not part of the header
    except UnicodeDecodeError as exc:
        raise StatsFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise StatsFileError(f"{path}: {exc.strerror or exc}") from None
    suffix = path.suffix.lower()
    fmt = "csv" if suffix == ".csv" else "jsonl" if suffix in (".jsonl", ".ndjson", ".json") else None
    return parse_stats(text, str(path), fmt)


def format_stats_csv(stats: KeyStats) -> str:
    """The statistics as a CSV file `parse_stats` reads back (unkeyed traffic as a row with empty key)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(COLUMNS)
    u = stats.unkeyed
    if u.rate > 0:
        w.writerow(["", repr(u.rate), repr(u.prompt_tokens), "0", repr(u.output_tokens)])
    for i, name in enumerate(stats.names):
        w.writerow(
            [
                name,
                repr(float(stats.rate[i])),
                repr(float(stats.prompt_tokens[i])),
                repr(float(stats.prefix_tokens[i])),
                repr(float(stats.output_tokens[i])),
            ]
        )
    return out.getvalue()
