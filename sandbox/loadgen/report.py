"""Per-request results, their summary, and the files they are written to (JSON or CSV)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cacheroute.sandbox.loadgen.client import RequestResult


@dataclass(frozen=True)
class Summary:
    requests: int
    succeeded: int
    failed: int
    duration_s: float
    throughput_rps: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    prompt_tokens: int
    cached_tokens: int
    served_kv_hit: float
    max_send_lag_s: float
    errors: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in dataclasses.asdict(self).items()}


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(results: Sequence[RequestResult]) -> Summary:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if not math.isnan(r.ttft_s)]
    e2e = [r.e2e_s for r in ok]
    sent = [r for r in results if not math.isnan(r.sent_s)]
    if ok:
        start = min(r.sent_s for r in sent)
        end = max(r.sent_s + r.e2e_s for r in ok)
        duration = max(end - start, 1e-9)
    else:
        duration = 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = f"HTTP {r.status}" if r.status not in (0, 200) else (r.error or "no reply").split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    return Summary(
        requests=len(results),
        succeeded=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        throughput_rps=len(ok) / duration if duration > 0 else 0.0,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p90_s=_pct(ttft, 90),
        ttft_p99_s=_pct(ttft, 99),
        e2e_p50_s=_pct(e2e, 50),
        e2e_p99_s=_pct(e2e, 99),
        prompt_tokens=prompt,
        cached_tokens=cached,
        served_kv_hit=cached / prompt if prompt else 0.0,
        max_send_lag_s=max((r.sent_s - r.scheduled_s for r in sent), default=0.0),
        errors=errors,
    )


def _row(result: RequestResult) -> dict[str, Any]:
    row = dataclasses.asdict(result)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(staged, path)


def write_results(path: Path, results: Sequence[RequestResult], summary: Summary, settings: dict[str, Any]) -> None:
    """JSON (settings, summary, requests) or CSV (one row per request), by the file's suffix."""
    if path.suffix.lower() == ".csv":
        out = io.StringIO()
        names = [f.name for f in dataclasses.fields(RequestResult)]
        writer = csv.DictWriter(out, fieldnames=names)
        writer.writeheader()
        for result in results:
            writer.writerow(_row(result))
        _write_atomic(path, out.getvalue())
        return
    document = {"settings": settings, "summary": summary.to_dict(), "requests": [_row(r) for r in results]}
    _write_atomic(path, json.dumps(document, indent=1) + "\n")
