"""Choose vLLM's memory flags: the mnbt that leaves the most servable KV with the worst case inside the GPU.

For each candidate `max-num-batched-tokens` the plan subtracts, from the memory CUDA reports, the
weights, the worst-case peak of `peak.estimate_peak` (or measured figures in Profiled mode) and the
safety margin; what is left becomes `--kv-cache-memory-bytes`, rounded down to whole blocks. On GDN
hybrids `max-num-seqs` is capped so that the recurrent state of every running sequence fits in a
stated share of those blocks (vLLM refuses outright above one block per sequence). The candidate
with the most servable KV tokens wins; ties, or anything within `kv_tolerance`, go to the larger
mnbt for prefill throughput.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, overload

from cacheroute.planner.memory.architecture import ModelArchitecture, Quantization, weights_bytes_per_gpu
from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.gpus import GIB, GpuModel
from cacheroute.planner.memory.kvsize import KvCacheDtype, KvLayout, MambaCacheMode, kv_layout
from cacheroute.planner.memory.peak import PeakBreakdown, PeakOptions, estimate_peak

Source = Literal["Analytic", "Profiled", "Manual"]
MODEL_VERSION = "cacheroute-memory/v1"
DEFAULT_MNBT_CANDIDATES: tuple[int, ...] = (2048, 3072, 4096, 6144, 8192, 16384)
# Below this, chunked prefill splits long prompts so finely that prefill throughput suffers.
DEFAULT_MNBT_FLOOR = 2048
DEFAULT_SAFETY_MARGIN_BYTES = 1 * GIB
# At most this share of the KV blocks may hold recurrent state when every allowed sequence runs;
# the rest stays for attention KV. A policy of ours, not a vLLM rule (vLLM only requires one block
# per sequence).
DEFAULT_STATE_SHARE = 0.5
# vLLM logs utilisation with four decimals.
_UTIL_STEP = 10_000


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. `max_model_len=None` means the model's native length, as vLLM defaults."""

    model: ModelArchitecture
    gpu: GpuModel
    quantization: Quantization = "bf16"
    tp: int = 1
    kv_cache_dtype: KvCacheDtype = "auto"
    max_model_len: int | None = None
    auto_max_model_len: bool = False
    mnbt: int | None = None
    mnbt_candidates: tuple[int, ...] = DEFAULT_MNBT_CANDIDATES
    mnbt_floor: int = DEFAULT_MNBT_FLOOR
    max_num_seqs: int | None = None
    safety_margin_bytes: int = DEFAULT_SAFETY_MARGIN_BYTES
    prefix_caching: bool = True
    mamba_ssm_dtype: str | None = None
    mamba_cache_mode: MambaCacheMode | None = None
    weights_bytes: int | None = None
    param_count: int | None = None
    kv_tolerance: float = 0.0
    state_share: float = DEFAULT_STATE_SHARE
    peak_options: PeakOptions = field(default_factory=PeakOptions)

    @property
    def tp_limit(self) -> int:
        return self.gpu.count_per_node

    @property
    def cache_mode(self) -> MambaCacheMode:
        if self.mamba_cache_mode is not None:
            return self.mamba_cache_mode
        return "align" if self.prefix_caching else "none"

    @property
    def target_model_len(self) -> int:
        return self.max_model_len or self.model.max_position_embeddings


@dataclass(frozen=True)
class Overheads:
    """Everything on one GPU except the KV cache, by the breakdown's categories."""

    weights: int
    activation_profiled: int
    unprofiled_transient: int
    graph_pool: int
    non_torch: int
    # In use before vLLM's startup snapshot (CUDA context, NCCL): outside the utilisation budget.
    pre_snapshot: int
    peak: PeakBreakdown | None = None

    @property
    def total(self) -> int:
        return self.weights + self.activation_profiled + self.unprofiled_transient + self.graph_pool + self.non_torch


@dataclass(frozen=True)
class Candidate:
    """One mnbt tried: whether it fits and what it leaves for KV."""

    mnbt: int
    fits: bool
    reason: str
    kv_cache_bytes: int
    num_blocks: int
    kv_capacity_tokens: int
    max_request_tokens: int
    max_num_seqs: int
    max_model_len: int
    missing_bytes: int
    overheads: Overheads


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where one GPU's memory goes under the plan; the fields sum to `total`."""

    total: int
    weights: int
    kv_cache: int
    activation_profiled: int
    unprofiled_transient: int
    graph_pool: int
    non_torch: int
    margin: int
    free: int
    # KV gained against vLLM's default mnbt for this GPU, evaluated the same way (None if that
    # default does not fit at all).
    vllm_default_mnbt: int
    kv_vs_vllm_default_bytes: int | None
    peak: PeakBreakdown | None = None

    def rows(self) -> tuple[tuple[str, int], ...]:
        return (
            ("weights", self.weights),
            ("kv cache", self.kv_cache),
            ("activation (profiled)", self.activation_profiled),
            ("unprofiled transient", self.unprofiled_transient),
            ("cuda-graph pool", self.graph_pool),
            ("non-torch", self.non_torch),
            ("safety margin", self.margin),
            ("free", self.free),
        )


@dataclass(frozen=True)
class MemoryPlan:
    """The flags for one vLLM replica and the breakdown that justifies them."""

    source: Source
    model: str
    tp: int
    kv_cache_memory_bytes: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_seqs: int
    kv_capacity_tokens: int
    max_request_tokens: int
    gpu_memory_utilization: float
    kv_cache_dtype: KvCacheDtype
    mamba_ssm_dtype: str | None
    layout: KvLayout
    breakdown: MemoryBreakdown
    candidates: tuple[Candidate, ...]
    inputs: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks(self.kv_cache_memory_bytes)

    def vllm_args(self) -> list[str]:
        """The engine flags this plan sets."""
        args = [
            "--kv-cache-memory-bytes",
            str(self.kv_cache_memory_bytes),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--gpu-memory-utilization",
            f"{self.gpu_memory_utilization:.4f}",
        ]
        if self.kv_cache_dtype != "auto":
            args += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.mamba_ssm_dtype is not None and self.layout.hybrid:
            args += ["--mamba-ssm-cache-dtype", self.mamba_ssm_dtype]
        return args

    def to_status(self) -> dict[str, Any]:
        """The fields of InferencePool `status.memoryPlan`, by their Python names."""
        return {
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "source": self.source,
            "inputs": dict(self.inputs),
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready and in a stable order."""
        b = self.breakdown
        return {
            "source": self.source,
            "model": self.model,
            "tensorParallelSize": self.tp,
            "flags": self.vllm_args(),
            "kvCacheMemoryBytes": self.kv_cache_memory_bytes,
            "maxNumBatchedTokens": self.max_num_batched_tokens,
            "maxModelLen": self.max_model_len,
            "maxNumSeqs": self.max_num_seqs,
            "kvCapacityTokens": self.kv_capacity_tokens,
            "maxRequestTokens": self.max_request_tokens,
            "gpuMemoryUtilization": self.gpu_memory_utilization,
            "breakdownBytes": {name: value for name, value in b.rows()} | {"total": b.total},
            "breakdownDetailBytes": {
                row: {part: value for part, value in parts if value}
                for row, parts in (b.peak.details().items() if b.peak else ())
            },
            "vllmDefaultMnbt": b.vllm_default_mnbt,
            "kvVsVllmDefaultBytes": b.kv_vs_vllm_default_bytes,
            "layout": {
                "blockSize": self.layout.block_size,
                "numBlocks": self.num_blocks,
                "attentionBytesPerToken": self.layout.attention_bytes_per_token,
                "stateBytesPerSeq": self.layout.state_bytes_per_seq,
                "mambaPaddingPct": round(self.layout.mamba_padding_pct, 4),
                "groupSize": self.layout.group_size,
                "attentionGroups": self.layout.attention_groups,
                "mambaGroups": self.layout.mamba_groups,
            },
            "candidates": [
                {
                    "mnbt": c.mnbt,
                    "fits": c.fits,
                    "reason": c.reason,
                    "kvCacheBytes": c.kv_cache_bytes,
                    "kvCapacityTokens": c.kv_capacity_tokens,
                    "maxNumSeqs": c.max_num_seqs,
                }
                for c in self.candidates
            ],
            "inputs": dict(self.inputs),
            "notes": list(self.notes),
        }


# ------------------------------------------------------------------------------------ evaluation


def validate_request(request: PlanRequest) -> None:
    arch = request.model
    arch.check_tp(request.tp, limit=max(request.tp, request.tp_limit))
    if request.tp > request.gpu.count_per_node:
        raise MemoryPlanError(
            f"tensor parallel size {request.tp} exceeds the {request.gpu.count_per_node} GPUs "
            f"of one {request.gpu.name} node"
        )
    if request.max_model_len is not None:
        if request.max_model_len < 1:
            raise MemoryPlanError(f"max_model_len must be positive, got {request.max_model_len}")
        if request.max_model_len > arch.max_position_embeddings:
            raise MemoryPlanError(
                f"max_model_len {request.max_model_len:,} exceeds the native context of {arch.name} "
                f"(max_position_embeddings {arch.max_position_embeddings:,})"
            )
    if request.mnbt is not None and request.mnbt < 1:
        raise MemoryPlanError(f"max_num_batched_tokens must be positive, got {request.mnbt}")
    if request.max_num_seqs is not None and request.max_num_seqs < 1:
        raise MemoryPlanError(f"max_num_seqs must be positive, got {request.max_num_seqs}")
    if request.mnbt is not None and request.max_num_seqs is not None and request.mnbt < request.max_num_seqs:
        raise MemoryPlanError(
            f"max_num_batched_tokens {request.mnbt} is below max_num_seqs {request.max_num_seqs}; vLLM refuses that"
        )
    if request.safety_margin_bytes < 0:
        raise MemoryPlanError(f"safety margin must not be negative, got {request.safety_margin_bytes} bytes")
    if not 0 <= request.kv_tolerance < 1:
        raise MemoryPlanError(f"kv_tolerance must be in [0, 1), got {request.kv_tolerance}")
    if not 0 < request.state_share <= 1:
        raise MemoryPlanError(f"state_share must be in (0, 1], got {request.state_share}")
    if request.weights_bytes is not None and request.weights_bytes <= 0:
        raise MemoryPlanError(f"weights override must be positive, got {request.weights_bytes} bytes")


def _analytic_overheads(request: PlanRequest, weights: int) -> Callable[[int, int], Overheads]:
    def overheads(mnbt: int, seqs: int) -> Overheads:
        peak = estimate_peak(
            request.model, request.tp, mnbt, seqs, request.target_model_len, options=request.peak_options
        )
        return Overheads(
            weights=weights,
            activation_profiled=peak.activation_profiled,
            unprofiled_transient=peak.unprofiled_transient,
            graph_pool=peak.graph_pool,
            non_torch=peak.non_torch,
            pre_snapshot=peak.cuda_context + peak.nccl,
            peak=peak,
        )

    return overheads


def _kv_bytes(request: PlanRequest, over: Overheads) -> int:
    return request.gpu.total_bytes - over.total - request.safety_margin_bytes


def evaluate_candidate(
    request: PlanRequest,
    layout: KvLayout,
    mnbt: int,
    overheads: Callable[[int, int], Overheads],
    kv_cap: int | None = None,
) -> Candidate:
    """What one mnbt leaves for KV, with max_num_seqs and max_model_len settled.

    `kv_cap` limits the KV cache to given bytes (Manual mode); what it leaves unused shows as free.
    """

    def room(over: Overheads) -> int:
        kv = _kv_bytes(request, over)
        return kv if kv_cap is None else min(kv, kv_cap)

    wanted_seqs = request.max_num_seqs or request.gpu.default_max_num_seqs
    seqs = min(wanted_seqs, mnbt)
    over = overheads(mnbt, seqs)
    blocks = layout.num_blocks(room(over))
    if layout.hybrid:
        state_cap = int(blocks * request.state_share) // layout.state_blocks_per_seq
        if request.max_num_seqs is None and state_cap < seqs:
            seqs = max(1, state_cap)
            over = overheads(mnbt, seqs)
            blocks = layout.num_blocks(room(over))
    kv_bytes = blocks * layout.bytes_per_block
    single = layout.max_request_tokens(blocks)
    native = request.model.max_position_embeddings
    capacity = layout.tokens_with(blocks, seqs if layout.hybrid else 0)
    # Auto-fit stays within what the pool holds with every allowed sequence running (on hybrids that
    # is below the single-request maximum vLLM itself checks).
    model_len = min(native, capacity or single) if request.auto_max_model_len else request.target_model_len
    reason, missing = "", 0
    if blocks < 1:
        reason = "no memory left for a single KV block"
        missing = layout.bytes_for_request(request.target_model_len) - _kv_bytes(request, over)
    elif layout.hybrid and seqs > layout.max_state_seqs(blocks):
        reason = f"max_num_seqs {seqs} exceeds the {blocks} mamba state blocks (vLLM refuses to start)"
        missing = (seqs - blocks) * layout.bytes_per_block
    elif model_len < 1 or single < model_len:
        reason = f"one {model_len:,}-token request needs {layout.bytes_for_request(model_len) / GIB:.2f} GiB of KV"
        missing = layout.bytes_for_request(model_len) - _kv_bytes(request, over)
    return Candidate(
        mnbt=mnbt,
        fits=not reason,
        reason=reason or "fits",
        kv_cache_bytes=kv_bytes,
        num_blocks=blocks,
        kv_capacity_tokens=capacity,
        max_request_tokens=single,
        max_num_seqs=seqs,
        max_model_len=model_len,
        missing_bytes=max(0, missing),
        overheads=over,
    )


def _candidate_mnbts(request: PlanRequest) -> tuple[int, ...]:
    if request.mnbt is not None:
        return (request.mnbt,)
    floor = request.mnbt_floor
    if request.max_num_seqs is not None:
        floor = max(floor, request.max_num_seqs)
    chosen = sorted({m for m in request.mnbt_candidates if m >= floor})
    if not chosen:
        raise MemoryPlanError(f"no mnbt candidate in {list(request.mnbt_candidates)} is at or above the floor {floor}")
    return tuple(chosen)


def pick(candidates: tuple[Candidate, ...], kv_tolerance: float) -> Candidate | None:
    """The fitting candidate with the most servable tokens; near-ties go to the larger mnbt."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return None
    best = max(c.kv_capacity_tokens for c in fitting)
    good = [c for c in fitting if c.kv_capacity_tokens >= best * (1 - kv_tolerance)]
    return max(good, key=lambda c: c.mnbt)


def _utilization(request: PlanRequest, chosen: Candidate) -> float:
    """vLLM's budget under the plan: everything after its startup snapshot, as a share of the GPU.

    vLLM refuses to start when free memory at the snapshot is below utilisation x total; since the
    plan keeps the margin free on top of this budget, that check passes whenever the estimates hold.
    """
    used = chosen.overheads.total + chosen.kv_cache_bytes - chosen.overheads.pre_snapshot
    return math.ceil(used / request.gpu.total_bytes * _UTIL_STEP) / _UTIL_STEP


def _inputs(request: PlanRequest, extra: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    arch = request.model
    base = {
        "model": arch.name,
        "modelSource": "preset" if arch.preset else "config",
        "quantization": request.quantization,
        "gpu": request.gpu.name,
        "gpuMemoryBytes": str(request.gpu.total_bytes),
        "tensorParallelSize": str(request.tp),
        "kvCacheDtype": request.kv_cache_dtype,
        "maxModelLen": "auto" if request.auto_max_model_len else str(request.max_model_len or "native"),
        "maxNumBatchedTokens": str(request.mnbt or "auto"),
        "mnbtCandidates": ",".join(str(m) for m in request.mnbt_candidates),
        "mnbtFloor": str(request.mnbt_floor),
        "maxNumSeqs": str(request.max_num_seqs or "auto"),
        "safetyMarginBytes": str(request.safety_margin_bytes),
        "prefixCaching": str(request.prefix_caching).lower(),
        "memoryModel": MODEL_VERSION,
    }
    if arch.is_hybrid:
        base["mambaCacheMode"] = request.cache_mode
        base["stateShare"] = str(request.state_share)
    if request.weights_bytes is not None:
        base["weightsBytes"] = str(request.weights_bytes)
    if request.param_count is not None:
        base["paramCount"] = str(request.param_count)
    return tuple(sorted((base | dict(extra)).items()))


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _no_fit_message(request: PlanRequest, worst: Candidate) -> str:
    arch, gpu, over = request.model, request.gpu, worst.overheads
    head = (
        f"{arch.name} ({request.quantization}) at TP={request.tp} does not fit on {gpu.name} "
        f"({_gib(gpu.total_bytes)} per GPU): {_gib(worst.missing_bytes)} missing per GPU "
        f"at max-num-batched-tokens {worst.mnbt} — {worst.reason}; weights {_gib(over.weights)}, "
        f"activation and transients {_gib(over.activation_profiled + over.unprofiled_transient)}, "
        f"cuda graphs {_gib(over.graph_pool)}, non-torch {_gib(over.non_torch)}, "
        f"margin {_gib(request.safety_margin_bytes)}"
    )
    hints = []
    for tp in arch.valid_tps(request.tp_limit):
        if tp <= request.tp:
            continue
        other = _fitting_plan(replace(request, tp=tp))
        if other is not None:
            hints.append(f"TP={tp} fits ({other.kv_capacity_tokens:,} KV tokens per GPU)")
            break
    else:
        hints.append(f"no tensor parallel size up to {request.tp_limit} fits")
    if worst.max_request_tokens > 0 and not request.auto_max_model_len:
        hints.append(f"or lower --max-model-len to at most {worst.max_request_tokens:,}")
    tail = "; ".join(hints)
    return f"{head}. {tail[0].upper()}{tail[1:]}."


def build_plan(
    request: PlanRequest,
    layout: KvLayout,
    candidates: tuple[Candidate, ...],
    chosen: Candidate,
    *,
    default_candidate: Candidate | None,
    source: Source,
    extra_inputs: Mapping[str, str] | None = None,
    notes: tuple[str, ...] = (),
) -> MemoryPlan:
    """Assemble the plan from the chosen candidate."""
    over = chosen.overheads
    used = over.total + chosen.kv_cache_bytes + request.safety_margin_bytes
    gain = None
    if default_candidate is not None and default_candidate.fits:
        gain = chosen.kv_cache_bytes - default_candidate.kv_cache_bytes
    breakdown = MemoryBreakdown(
        total=request.gpu.total_bytes,
        weights=over.weights,
        kv_cache=chosen.kv_cache_bytes,
        activation_profiled=over.activation_profiled,
        unprofiled_transient=over.unprofiled_transient,
        graph_pool=over.graph_pool,
        non_torch=over.non_torch,
        margin=request.safety_margin_bytes,
        free=request.gpu.total_bytes - used,
        vllm_default_mnbt=request.gpu.default_max_num_batched_tokens,
        kv_vs_vllm_default_bytes=gain,
        peak=over.peak,
    )
    plan_notes = list(notes)
    if layout.hybrid and request.max_num_seqs is None and chosen.max_num_seqs < request.gpu.default_max_num_seqs:
        plan_notes.append(
            f"max-num-seqs lowered to {chosen.max_num_seqs} so the recurrent state of every running sequence "
            f"fits in {request.state_share:.0%} of the {chosen.num_blocks} KV blocks"
        )
    return MemoryPlan(
        source=source,
        model=request.model.name,
        tp=request.tp,
        kv_cache_memory_bytes=chosen.kv_cache_bytes,
        max_num_batched_tokens=chosen.mnbt,
        max_model_len=chosen.max_model_len,
        max_num_seqs=chosen.max_num_seqs,
        kv_capacity_tokens=chosen.kv_capacity_tokens,
        max_request_tokens=chosen.max_request_tokens,
        gpu_memory_utilization=_utilization(request, chosen),
        kv_cache_dtype=request.kv_cache_dtype,
        mamba_ssm_dtype=layout.ssm_dtype if request.mamba_ssm_dtype else None,
        layout=layout,
        breakdown=breakdown,
        candidates=candidates,
        inputs=_inputs(request, extra_inputs or {}),
        notes=tuple(plan_notes),
    )


def layout_for(request: PlanRequest) -> KvLayout:
    return kv_layout(request.model, request.tp, request.kv_cache_dtype, request.mamba_ssm_dtype, request.cache_mode)


@overload
def choose(
    request: PlanRequest,
    overheads: Callable[[int, int], Overheads],
    source: Source,
    *,
    explain: Literal[True] = True,
    **extra: Any,
) -> MemoryPlan: ...


@overload
def choose(
    request: PlanRequest,
    overheads: Callable[[int, int], Overheads],
    source: Source,
    *,
    explain: Literal[False],
    **extra: Any,
) -> MemoryPlan | None: ...


def choose(
    request: PlanRequest,
    overheads: Callable[[int, int], Overheads],
    source: Source,
    *,
    explain: bool = True,
    **extra: Any,
) -> MemoryPlan | None:
    """Evaluate every candidate mnbt with the given overhead model and build the plan of the best.

    When nothing fits: raise MemoryPlanError saying what is missing and what would fit, or with
    `explain=False` return None.
    """
    layout = layout_for(request)
    candidates = tuple(evaluate_candidate(request, layout, m, overheads) for m in _candidate_mnbts(request))
    chosen = pick(candidates, request.kv_tolerance)
    if chosen is None:
        if not explain:
            return None
        raise MemoryPlanError(_no_fit_message(request, min(candidates, key=lambda c: c.missing_bytes)))
    default_mnbt = request.gpu.default_max_num_batched_tokens
    default = next((c for c in candidates if c.mnbt == default_mnbt), None)
    if default is None:
        default = evaluate_candidate(request, layout, default_mnbt, overheads)
    return build_plan(request, layout, candidates, chosen, default_candidate=default, source=source, **extra)


def _analytic(request: PlanRequest) -> Callable[[int, int], Overheads]:
    weights = request.weights_bytes or weights_bytes_per_gpu(
        request.model, request.quantization, request.tp, request.param_count
    )
    return _analytic_overheads(request, weights)


def _fitting_plan(request: PlanRequest) -> MemoryPlan | None:
    """The Analytic plan if one fits, without composing an explanation when none does."""
    try:
        validate_request(request)
        return choose(request, _analytic(request), "Analytic", explain=False)
    except MemoryPlanError:
        return None


def plan_memory(request: PlanRequest) -> MemoryPlan:
    """The Analytic plan: flags from the architecture model alone."""
    validate_request(request)
    return choose(request, _analytic(request), "Analytic")


def plan_manual(request: PlanRequest, kv_cache_memory_bytes: int) -> MemoryPlan:
    """A Manual plan: the KV bytes are given; the other flags and the worst-case check come from the model."""
    validate_request(request)
    if kv_cache_memory_bytes <= 0:
        raise MemoryPlanError(f"kvCacheMemoryBytes must be positive, got {kv_cache_memory_bytes}")
    weights = request.weights_bytes or weights_bytes_per_gpu(
        request.model, request.quantization, request.tp, request.param_count
    )
    pinned = replace(request, mnbt=request.mnbt or request.mnbt_floor)
    mnbt = pinned.mnbt or pinned.mnbt_floor
    overheads = _analytic_overheads(pinned, weights)
    layout = layout_for(pinned)
    room = evaluate_candidate(pinned, layout, mnbt, overheads)
    if kv_cache_memory_bytes >= room.kv_cache_bytes + layout.bytes_per_block:
        raise MemoryPlanError(
            f"kvCacheMemoryBytes {kv_cache_memory_bytes:,} ({_gib(kv_cache_memory_bytes)}) is more than the "
            f"worst case at max-num-batched-tokens {mnbt} leaves ({_gib(room.kv_cache_bytes)}): "
            f"{_gib(kv_cache_memory_bytes - room.kv_cache_bytes)} over; lower it or use Analytic mode"
        )
    chosen = evaluate_candidate(pinned, layout, mnbt, overheads, kv_cap=kv_cache_memory_bytes)
    if not chosen.fits:
        raise MemoryPlanError(f"kvCacheMemoryBytes {kv_cache_memory_bytes:,} does not serve the model: {chosen.reason}")
    return build_plan(
        pinned,
        layout,
        (chosen,),
        chosen,
        default_candidate=None,
        source="Manual",
        extra_inputs={"kvCacheMemoryBytes": str(kv_cache_memory_bytes)},
    )
