"""Backfilling a Prometheus with a pool's router and vLLM series (`promtool tsdb
create-blocks-from openmetrics`), for benchmarks at a scale no live exporter can reach.

Every counter grows linearly at its rate from `start` (value 0) and is sampled every `step`
seconds up to `end`; `end` may lie in the future, so a window ending "now" stays full while a
benchmark runs.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class PoolSeriesSpec:
    """One pool's traffic: per key (16-hex labels) rate, prompt and prefix tokens per request."""

    namespace: str
    pool: str
    labels: Sequence[str]
    rate: F64
    prompt_tokens: F64
    prefix_tokens: F64
    other_rate: float
    unkeyed_rate: float
    aggregate_prompt_tokens: float
    engines: int
    output_tokens: float = 250.0
    kv_hit: float = 0.5

    @property
    def router_pod(self) -> str:
        return f"{self.pool}-router-5d8c7b9f4-a0000"


def _times(start: int, end: int, step: int) -> list[int]:
    return list(range(start, end + 1, step))


def _family(
    name: str, kind: str, rows: Iterator[tuple[str, float]], times: list[int], start: int, *, created: bool = False
) -> Iterator[str]:
    """`rows`: (label text, rate per second) of each series of the family. With `created`, each
    counter sample comes with its `_created` sample (the series began at `start`), as a router
    exports its per-key request counters."""
    yield f"# TYPE {name} {kind}\n"
    sample = f"{name}_total" if kind == "counter" else name
    offsets = [t - start for t in times]
    for labels, rate in rows:
        head = f"{sample}{{{labels}}} "
        if kind == "counter" and created:
            born = f"{name}_created{{{labels}}} {start} "
            yield "".join(f"{head}{rate * dt:.9g} {t}\n{born}{t}\n" for dt, t in zip(offsets, times, strict=True))
        elif kind == "counter":
            yield "".join(f"{head}{rate * dt:.9g} {t}\n" for dt, t in zip(offsets, times, strict=True))
        else:
            yield "".join(f"{head}{rate:.9g} {t}\n" for t in times)


def _router_rows(spec: PoolSeriesSpec, metric: str) -> Iterator[tuple[str, float]]:
    router = f'namespace="{spec.namespace}",pod="{spec.router_pod}"'
    per_request = {"requests": None, "prompt_tokens": spec.prompt_tokens, "prefix_tokens": spec.prefix_tokens}[metric]
    keyed = spec.rate if per_request is None else spec.rate * per_request
    for label, rate in zip(spec.labels, keyed.tolist(), strict=True):
        yield f'key="{label}",{router}', float(rate)
    aggregate = {"requests": 1.0, "prompt_tokens": spec.aggregate_prompt_tokens, "prefix_tokens": 0.0}[metric]
    for name, rate in (("__other__", spec.other_rate), ("__none__", spec.unkeyed_rate)):
        yield f'key="{name}",{router}', rate * aggregate


def _engine_rows(spec: PoolSeriesSpec, name: str) -> Iterator[tuple[str, float]]:
    total_rate = float(spec.rate.sum()) + spec.other_rate + spec.unkeyed_rate
    prompt_rate = float((spec.rate * spec.prompt_tokens).sum()) + (
        spec.other_rate + spec.unkeyed_rate
    ) * spec.aggregate_prompt_tokens
    each = 1.0 / spec.engines
    rate = {
        "vllm:prefix_cache_queries": prompt_rate * each,
        "vllm:prefix_cache_hits": prompt_rate * each * spec.kv_hit,
        "vllm:generation_tokens": total_rate * spec.output_tokens * each,
        "vllm:num_requests_waiting": 1.0,
        "vllm:num_requests_running": 8.0,
        "vllm:kv_cache_usage_perc": 0.6,
    }[name]
    for i in range(spec.engines):
        yield f'model_name="m",namespace="{spec.namespace}",pod="{spec.pool}-{i}"', rate


ROUTER_FAMILIES = ("requests", "prompt_tokens", "prefix_tokens")
ENGINE_FAMILIES = (
    ("vllm:prefix_cache_queries", "counter"),
    ("vllm:prefix_cache_hits", "counter"),
    ("vllm:generation_tokens", "counter"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:num_requests_running", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
)


def openmetrics_lines(specs: Sequence[PoolSeriesSpec], *, start: int, end: int, step: int) -> Iterator[str]:
    """Each metric family once (OpenMetrics forbids repeating one), holding every pool's series."""
    times = _times(start, end, step)
    for metric in ROUTER_FAMILIES:
        rows = (row for spec in specs for row in _router_rows(spec, metric))
        name = f"cacheroute_router_key_{metric}"
        yield from _family(name, "counter", rows, times, start, created=metric == "requests")
    for name, kind in ENGINE_FAMILIES:
        yield from _family(name, kind, (row for spec in specs for row in _engine_rows(spec, name)), times, start)


def write_openmetrics(path: Path, specs: Sequence[PoolSeriesSpec], *, start: int, end: int, step: int) -> int:
    """Write the pools' series to `path` (OpenMetrics text); returns the number of samples."""
    samples = 0
    with path.open("w", encoding="ascii") as out:
        for chunk in openmetrics_lines(specs, start=start, end=end, step=step):
            out.write(chunk)
            samples += chunk.count("\n") - chunk.startswith("#")
        out.write("# EOF\n")
    return samples


def create_blocks(openmetrics: Path, data_dir: Path, *, timeout: float = 1800) -> None:
    """`promtool tsdb create-blocks-from openmetrics` into a Prometheus data directory, with the
    promtool of the sandbox's Prometheus release (built on first use)."""
    from cacheroute.sandbox.binaries import ensure

    promtool = ensure(["promtool"])["promtool"].path
    data_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [str(promtool), "tsdb", "create-blocks-from", "openmetrics", "-q", str(openmetrics), str(data_dir)],
        check=True,
        capture_output=True,
        timeout=timeout,
    )
