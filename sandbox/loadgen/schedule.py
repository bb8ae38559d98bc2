"""Which requests to send and when: a trace or a generated workload, time-scaled and bounded."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cacheroute.planner.mooncake import TraceFormatError, parse_key_spec, read_mooncake
from cacheroute.planner.trace import NO_KEY, RequestTrace
from cacheroute.planner.workloads import WorkloadSpec, generate, preset


class ScheduleError(ValueError):
    """The workload options do not describe a load to send."""


@dataclass(frozen=True)
class PlannedRequest:
    index: int  # row in the trace
    at_s: float  # seconds after the start of the run
    input_tokens: int
    output_tokens: int
    key: str | None


@dataclass(frozen=True)
class Schedule:
    trace: RequestTrace
    requests: tuple[PlannedRequest, ...]
    source: str
    time_scale: float

    @property
    def duration_s(self) -> float:
        return self.requests[-1].at_s if self.requests else 0.0


def load_trace(
    *, trace: Path | None, workload: str | None, key: str = "first-blocks:4", seed: int = 0,
    qps: float | None = None, duration_s: float | None = None, keys: int | None = None,
) -> tuple[RequestTrace, str]:
    """The trace of a Mooncake file or of a generated preset (generated at `qps` for `duration_s`, `keys` keys)."""
    if (trace is None) == (workload is None):
        raise ScheduleError("give exactly one of --trace and --workload")
    if workload is not None:
        overrides: dict[str, object] = {"seed": seed}
        if qps is not None:
            overrides["qps"] = qps
        if duration_s is not None:
            overrides["duration_s"] = duration_s
        if keys is not None:
            overrides["keys"] = keys
        try:
            spec = preset(workload, **overrides)
            if keys is None:
                return _fitted(spec)
            return generate(spec).trace, f"workload {workload}"
        except ValueError as exc:
            # preset() names the known presets when the name is wrong; other errors are about the options.
            raise ScheduleError(f"--workload {workload}: {str(exc).removeprefix(f'workload {workload}: ')}") from None
    assert trace is not None
    try:
        parse_key_spec(key)
        return read_mooncake(trace, key=key), f"trace {trace}"
    except OSError as exc:
        raise ScheduleError(f"cannot read --trace {trace}: {exc.strerror or exc}") from None
    except (TraceFormatError, ValueError) as exc:
        raise ScheduleError(f"--trace {trace}: {exc}") from None


def _fitted(spec: WorkloadSpec) -> tuple[RequestTrace, str]:
    """The preset at its own key count, or, when a short or slow run cannot spread its requests
    over that many keys, at the most keys it can (the shape of the preset otherwise kept)."""
    try:
        return generate(spec).trace, f"workload {spec.name}"
    except ValueError as too_many:
        lo, hi, best = 1, spec.keys - 1, None
        while lo <= hi:  # a run that covers k keys covers fewer
            mid = (lo + hi) // 2
            try:
                best = generate(replace(spec, keys=mid)).trace, mid
                lo = mid + 1
            except ValueError:
                hi = mid - 1
        if best is None:
            raise too_many from None
        trace, keys = best
        return trace, f"workload {spec.name} with {keys:,} keys (its {spec.keys:,} need a longer or faster run; --keys)"


def build_schedule(
    tr: RequestTrace,
    *,
    source: str,
    time_scale: float | None = None,
    qps: float | None = None,
    duration_s: float | None = None,
    max_requests: int | None = None,
    max_output_tokens: int | None = None,
    max_input_tokens: int | None = None,
) -> Schedule:
    """Scale the trace's clock (`time_scale` times faster, or to `qps` on average), then cut it."""
    if len(tr) == 0:
        raise ScheduleError(f"{source} has no requests")
    if time_scale is not None and qps is not None:
        raise ScheduleError("give at most one of --time-scale and --qps")
    scale = 1.0
    if time_scale is not None:
        if not time_scale > 0:
            raise ScheduleError(f"--time-scale must be positive, got {time_scale}")
        scale = time_scale
    elif qps is not None:
        if not qps > 0:
            raise ScheduleError(f"--qps must be positive, got {qps}")
        span = tr.duration_s
        if span > 0 and len(tr) > 1:
            scale = qps / ((len(tr) - 1) / span)
    start = float(tr.arrival_s[0])
    at = (tr.arrival_s - start) / scale
    keep = np.ones(len(tr), dtype=bool)
    if duration_s is not None:
        if not duration_s > 0:
            raise ScheduleError(f"--duration must be positive, got {duration_s}")
        keep &= at < duration_s
    if max_input_tokens is not None:
        keep &= tr.input_tokens <= max_input_tokens
    rows = np.flatnonzero(keep)
    if max_requests is not None:
        if max_requests < 1:
            raise ScheduleError(f"--max-requests must be at least 1, got {max_requests}")
        rows = rows[:max_requests]
    if len(rows) == 0:
        raise ScheduleError(f"no request of {source} is left within the bounds given")
    requests = []
    for i in rows.tolist():
        out = int(tr.output_tokens[i])
        if max_output_tokens is not None:
            out = min(out, max_output_tokens)
        key_id = int(tr.key[i])
        requests.append(
            PlannedRequest(
                index=i,
                at_s=float(at[i]),
                input_tokens=int(tr.input_tokens[i]),
                output_tokens=max(1, out),
                key=tr.key_names[key_id] if key_id != NO_KEY else None,
            )
        )
    return Schedule(trace=tr, requests=tuple(requests), source=source, time_scale=scale)
