"""Parse vLLM's own startup log into a `MemoryProfile` (pure: text in, figures out).

Every line vLLM prints about memory at startup is recognised in the wordings of old and new builds
(reference/vllm_memory.md §1), e.g. `Loading model weights took 14.9888 GB` (V0: the value is GiB
despite the label), `Model loading took 3.3414 GB and 0.74 seconds`, `Model loading took 4.53 GiB
memory and 8.85 seconds`; `GPU KV cache size: N tokens` alone or merged with `Maximum concurrency`;
the V0 `Memory profiling takes` summary and the V1 `Free memory on device ...` summary. Lines of
tensor-parallel workers carry a `(Worker_TP1 pid=...)` prefix; figures are aggregated the
conservative way (memory used: the largest rank; memory available: the smallest).

The parser never fills a figure it did not read: `missing` names the expected lines it did not find,
and failure strings (no cache memory, max-model-len too long, Mamba blocks, startup free memory, CUDA
OOM) are reported as `failures`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cacheroute.planner.memory.errors import MemoryPlanError

PROFILE_SCHEMA = 1

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NUM = r"(-?[\d.]+)"
_INT = r"([\d,]+)"
# "(Worker_TP1 pid=12)", "(VllmWorker rank=1 pid=12)", "(Worker_PP1_EP0 pid=3)", "[rank1]:".
_RANK = re.compile(
    r"^\s*(?:\((?:Vllm)?Worker(?:_(?P<name>[A-Za-z0-9_]+))?(?:\s+rank=(?P<rank>\d+))?\s+pid=\d+\)|\[rank(?P<r2>\d+)\]:)"
)


def _ws(pattern: str) -> re.Pattern[str]:
    """Compile with literal spaces matching any whitespace (` ?`: optional), so wrapped lines still match."""
    return re.compile(pattern.replace(" ?", r"\s*").replace(" ", r"\s+"))


# name -> pattern. Order is irrelevant; each pattern is searched over the whole log.
_LINES: dict[str, re.Pattern[str]] = {
    "model_loading": _ws(
        r"(?:Model loading took|Loading model weights took) " + _NUM + r" ?(?:GiB|GB)(?: memory)?"
        r"(?: and " + _NUM + r" ?(?:seconds|secs|sec|s)\b)?"
    ),
    "cudagraph_profiling": re.compile(r"Profiling CUDA graph memory:\s*(?P<body>[^\n]*)"),
    "cudagraph_estimate": _ws(r"Estimated CUDA graph memory: " + _NUM + r" ?GiB"),
    "available_kv_cache": _ws(r"Available KV cache memory: " + _NUM + r" ?GiB"),
    "cudagraph_advice": _ws(
        r"The current --gpu-memory-utilization=" + _NUM + r" is equivalent to --gpu-memory-utilization=" + _NUM
    ),
    "cudagraph_advice_v019": _ws(r"increase --gpu-memory-utilization from " + _NUM + r" to " + _NUM),
    "memory_summary": _ws(
        r"Free memory on device \("
        + _NUM
        + r"/"
        + _NUM
        + r" ?GiB\) on startup\. Desired GPU memory utilization is \("
        + _NUM
        + r", ?"
        + _NUM
        + r" ?GiB\)\. Actual usage is "
        + _NUM
        + r" ?GiB for consumed memory \(weights \+ "
        r"non-torch\), ?" + _NUM + r" ?GiB for peak activation, and " + _NUM + r" ?GiB for CUDAGraph memory"
    ),
    "kv_suggestion": _ws(
        r"--kv-cache-memory=(\d+)`? \("
        + _NUM
        + r" ?GiB\) to fit into requested memory(?:, or `?--kv-cache-memory=(\d+))?"
    ),
    "kv_in_use": _ws(r"Current kv cache memory in use is " + _NUM + r" ?GiB"),
    "kv_cache_size": _ws(r"GPU KV cache size: " + _INT + r" tokens"),
    "max_concurrency": re.compile(
        r"maximum\s+concurrency\s+for\s+" + _INT + r"\s+tokens\s+per\s+request:\s*" + _NUM + r"x", re.IGNORECASE
    ),
    "graph_capture": _ws(r"Graph capturing finished in " + _NUM + r" ?secs?(?:, took " + _NUM + r" ?GiB)?"),
    "cudagraph_pool": _ws(
        r"CUDA graph pool memory: "
        + _NUM
        + r" ?GiB \(actual\), "
        + _NUM
        + r" ?GiB \(estimated\)(?:, difference: "
        + _NUM
        + r" ?GiB \("
        + _NUM
        + r"%\))?"
    ),
    "v0_memory_budget": _ws(
        r"total_gpu_memory \(" + _NUM + r" ?GiB\) x gpu_memory_utilization \(" + _NUM + r"\) = " + _NUM + r" ?GiB"
    ),
    "v0_memory_profile": _ws(
        r"model weights take " + _NUM + r" ?GiB; non_torch_memory takes " + _NUM + r" ?GiB; PyTorch activation peak "
        r"memory takes " + _NUM + r" ?GiB; the rest of the memory reserved for KV Cache is " + _NUM + r" ?GiB"
    ),
    "gpu_blocks": re.compile(r"#\s*(?:GPU|cuda|CUDA)\s+blocks:\s*(\d+),\s*#\s*CPU\s+blocks:\s*(\d+)"),
    "attention_block_size": _ws(r"Setting attention block size to (\d+) tokens"),
    "mamba_padding": _ws(r"Padding mamba page size by " + _NUM + r"%"),
    "padding_layers": _ws(r"Add (\d+) padding layers, may waste at most " + _NUM + r"% KV cache memory"),
    "auto_fit_max_model_len": _ws(r"Auto-fit max_model_len: reduced from " + _INT + r" to " + _INT),
    "chunked_prefill": re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)"),
}

_FAILURES: dict[str, re.Pattern[str]] = {
    "no_cache_memory": re.compile(r"No available memory for the cache blocks"),
    "max_model_len_too_long": _ws(
        r"To serve at least one request with the models?'s max seq len \((\d+)\), \(" + _NUM + r" ?GiB KV cache is "
        r"needed, which is larger than the available KV cache memory \(" + _NUM + r" ?GiB\)"
    ),
    "mamba_blocks": _ws(r"max_num_seqs \((\d+)\) exceeds available Mamba cache blocks \((\d+)\)"),
    "startup_free_memory": _ws(
        r"Free memory on device \(" + _NUM + r"/" + _NUM + r" ?GiB\) on startup is less than desired GPU memory "
        r"utilization \(" + _NUM + r", ?" + _NUM + r" ?GiB\)"
    ),
    "cuda_oom": re.compile(
        r"(?:torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory)(?:[^\n]*?Tried to allocate ([\d.]+) (GiB|MiB))?"
    ),
}

# Lines every modern startup prints, each with the older lines that carry the same figure.
EXPECTED_LINES: Mapping[str, tuple[str, ...]] = {
    "model_loading": ("model_loading",),
    "available_kv_cache": ("available_kv_cache", "v0_memory_profile"),
    "kv_cache_size": ("kv_cache_size", "gpu_blocks"),
    "max_concurrency": ("max_concurrency",),
    "memory_summary": ("memory_summary", "v0_memory_profile"),
}
EXPECTED_WITH_GRAPHS: Mapping[str, tuple[str, ...]] = {"graph_capture": ("graph_capture", "cudagraph_pool")}
EXPECTED_ON_HYBRIDS: Mapping[str, tuple[str, ...]] = {"attention_block_size": ("attention_block_size",)}


@dataclass(frozen=True)
class Failure:
    """A startup failure vLLM reported, with the figures its message carries."""

    kind: str
    text: str
    values: tuple[float, ...] = ()


@dataclass(frozen=True)
class MemoryProfile:
    """What one vLLM startup said about memory. GiB figures are as logged (two or four decimals)."""

    weights_gib: float | None = None
    model_load_seconds: float | None = None
    available_kv_gib: float | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_concurrency_tokens: int | None = None
    gpu_blocks: int | None = None
    startup_free_gib: float | None = None
    total_gib: float | None = None
    requested_utilization: float | None = None
    requested_gib: float | None = None
    consumed_gib: float | None = None
    activation_gib: float | None = None
    cudagraph_gib: float | None = None
    non_torch_gib: float | None = None
    kv_suggestion_fit_bytes: int | None = None
    kv_suggestion_full_bytes: int | None = None
    kv_in_use_gib: float | None = None
    cudagraph_estimate_gib: float | None = None
    cudagraph_captures: tuple[tuple[str, int, int], ...] = ()
    graph_capture_gib: float | None = None
    graph_capture_seconds: float | None = None
    graph_pool_actual_gib: float | None = None
    graph_pool_estimated_gib: float | None = None
    utilization_in_force: float | None = None
    utilization_equivalent: float | None = None
    attention_block_size: int | None = None
    mamba_padding_pct: float | None = None
    padding_layers: int | None = None
    auto_fit_max_model_len: tuple[int, int] | None = None
    max_num_batched_tokens: int | None = None
    ranks: tuple[str, ...] = ()
    found: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    failures: tuple[Failure, ...] = field(default=())

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    @property
    def graph_gib(self) -> float | None:
        """CUDA-graph memory, best source first: measured pool, capture delta, summary, estimate."""
        for value in (
            self.graph_pool_actual_gib,
            self.graph_capture_gib,
            self.cudagraph_gib,
            self.cudagraph_estimate_gib,
        ):
            if value is not None:
                return value
        return None

    def budget_missing(self, cudagraphs: bool = True) -> tuple[str, ...]:
        """The lines a measured budget needs that this log lacks (empty when a plan can use it)."""
        need = []
        if self.weights_gib is None:
            need.append("model_loading")
        if self.consumed_gib is None or self.activation_gib is None:
            need.append("memory_summary")
        if cudagraphs and self.graph_gib is None:
            need.append("graph_capture")
        return tuple(need)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["schema"] = PROFILE_SCHEMA
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryProfile:
        if data.get("schema") != PROFILE_SCHEMA:
            raise MemoryPlanError(f"memory profile schema {data.get('schema')!r} is not {PROFILE_SCHEMA}")
        values = {k: v for k, v in data.items() if k != "schema"}
        values["cudagraph_captures"] = tuple(tuple(c) for c in values.get("cudagraph_captures", ()))
        fit = values.get("auto_fit_max_model_len")
        values["auto_fit_max_model_len"] = tuple(fit) if fit is not None else None
        for name in ("ranks", "found", "missing"):
            values[name] = tuple(values.get(name, ()))
        values["failures"] = tuple(
            Failure(f["kind"], f["text"], tuple(f.get("values", ()))) for f in values.get("failures", ())
        )
        return cls(**values)


@dataclass
class _Match:
    rank: str
    groups: tuple[str | None, ...]
    text: str


def _rank_at(text: str, start: int) -> str:
    line = text[text.rfind("\n", 0, start) + 1 : start]
    m = _RANK.match(line)
    if not m:
        return "0"
    return m.group("name") or m.group("rank") or m.group("r2") or "0"


def _matches(text: str, pattern: re.Pattern[str]) -> list[_Match]:
    return [_Match(_rank_at(text, m.start()), m.groups(), m.group(0)) for m in pattern.finditer(text)]


_NUMERIC = re.compile(r"-?[\d.,]*\d")


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _num(value: str | None) -> float | None:
    return None if value is None else float(value.replace(",", ""))


def _int(value: str | None) -> int | None:
    return None if value is None else int(value.replace(",", ""))


def _agg(matches: list[_Match], index: int, pick: Callable[[Iterable[float]], float]) -> float | None:
    values = [v for m in matches if (v := _num(m.groups[index])) is not None]
    return pick(values) if values else None


def _last_int(matches: list[_Match], index: int) -> int | None:
    values = [v for m in matches if (v := _int(m.groups[index])) is not None]
    return values[-1] if values else None


def parse_vllm_log(text: str, *, hybrid: bool = False, cudagraphs: bool = True) -> MemoryProfile:
    """Read a vLLM startup log (any version, any number of ranks) into a MemoryProfile."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    m = {name: _matches(text, pattern) for name, pattern in _LINES.items()}
    found = tuple(sorted(name for name, hits in m.items() if hits))
    expected = dict(EXPECTED_LINES)
    if cudagraphs:
        expected.update(EXPECTED_WITH_GRAPHS)
    if hybrid:
        expected.update(EXPECTED_ON_HYBRIDS)
    missing = tuple(name for name, alternatives in expected.items() if not any(m[a] for a in alternatives))

    v0 = m["v0_memory_profile"]
    summary = m["memory_summary"]
    weights = _agg(m["model_loading"], 0, max)
    if weights is None:
        weights = _agg(v0, 0, max)
    available = _agg(m["available_kv_cache"], 0, min)
    if available is None:
        available = _agg(v0, 3, min)
    consumed = _agg(summary, 4, max)
    non_torch = _agg(v0, 1, max)
    if consumed is None and weights is not None and non_torch is not None:
        consumed = weights + non_torch
    elif consumed is not None and weights is not None:
        non_torch = max(0.0, consumed - weights)
    total = _agg(summary, 1, min)
    if total is None:
        total = _agg(m["v0_memory_budget"], 0, min)

    captures: list[tuple[str, int, int]] = []
    for hit in m["cudagraph_profiling"][:1]:
        body = hit.groups[0] or ""
        captures = [
            (mode, int(n), int(big)) for mode, n, big in re.findall(r"([A-Z_]+)=(\d+)\s*\(largest=(\d+)\)", body)
        ]
    suggestion = m["kv_suggestion"]
    fit = m["auto_fit_max_model_len"]
    failures = tuple(
        Failure(
            kind, hit.text.strip(), tuple(float(g.replace(",", "")) for g in hit.groups if g and _NUMERIC.fullmatch(g))
        )
        for kind, pattern in _FAILURES.items()
        for hit in _matches(text, pattern)
    )
    ranks = sorted({hit.rank for hits in m.values() for hit in hits})
    return MemoryProfile(
        weights_gib=weights,
        model_load_seconds=_agg(m["model_loading"], 1, max),
        available_kv_gib=available,
        kv_cache_tokens=_last_int(m["kv_cache_size"], 0),
        max_concurrency=_agg(m["max_concurrency"], 1, min),
        max_concurrency_tokens=_last_int(m["max_concurrency"], 0),
        gpu_blocks=_last_int(m["gpu_blocks"], 0),
        startup_free_gib=_agg(summary, 0, min),
        total_gib=total,
        requested_utilization=_first(_agg(summary, 2, max), _agg(m["v0_memory_budget"], 1, max)),
        requested_gib=_first(_agg(summary, 3, max), _agg(m["v0_memory_budget"], 2, max)),
        consumed_gib=consumed,
        activation_gib=_first(_agg(summary, 5, max), _agg(v0, 2, max)),
        cudagraph_gib=_agg(summary, 6, max),
        non_torch_gib=non_torch,
        kv_suggestion_fit_bytes=int(min(float(s.groups[0] or 0) for s in suggestion)) if suggestion else None,
        kv_suggestion_full_bytes=_last_int(suggestion, 2),
        kv_in_use_gib=_agg(m["kv_in_use"], 0, min),
        cudagraph_estimate_gib=_agg(m["cudagraph_estimate"], 0, max),
        cudagraph_captures=tuple(captures),
        graph_capture_gib=_agg(m["graph_capture"], 1, max),
        graph_capture_seconds=_agg(m["graph_capture"], 0, max),
        graph_pool_actual_gib=_agg(m["cudagraph_pool"], 0, max),
        graph_pool_estimated_gib=_agg(m["cudagraph_pool"], 1, max),
        utilization_in_force=_first(_agg(m["cudagraph_advice"], 0, max), _agg(m["cudagraph_advice_v019"], 0, max)),
        utilization_equivalent=_agg(m["cudagraph_advice"], 1, max),
        attention_block_size=_last_int(m["attention_block_size"], 0),
        mamba_padding_pct=_agg(m["mamba_padding"], 0, max),
        padding_layers=_last_int(m["padding_layers"], 0),
        auto_fit_max_model_len=(_int(fit[-1].groups[0]) or 0, _int(fit[-1].groups[1]) or 0) if fit else None,
        max_num_batched_tokens=_last_int(m["chunked_prefill"], 0),
        ranks=tuple(ranks),
        found=found,
        missing=missing,
        failures=failures,
    )
