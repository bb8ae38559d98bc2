"""The memory plan: vLLM's flags for one replica and the breakdown of one GPU that justifies them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cacheroute.planner.memory.candidates import Candidate
from cacheroute.planner.memory.host import HostTier, host_tier
from cacheroute.planner.memory.kvsize import KvCacheDtype, KvLayout
from cacheroute.planner.memory.peak import PeakBreakdown
from cacheroute.planner.memory.request import PlanRequest, recorded_inputs

Source = Literal["Analytic", "Profiled", "Manual"]
# vLLM logs utilisation with four decimals.
_UTIL_STEP = 10_000


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
    host: HostTier = field(default=HostTier(0, 0, 0, "off"))

    @property
    def host_kv_cache_bytes(self) -> int:
        return self.host.bytes

    @property
    def host_kv_capacity_tokens(self) -> int:
        return self.host.capacity_tokens

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
        return args + self.host.vllm_args()

    def to_status(self) -> dict[str, Any]:
        """The fields of InferencePool `status.memoryPlan`, by their Python names."""
        return {
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_cache_dtype": self.kv_cache_dtype,
            "host_kv_cache_bytes": self.host.bytes,
            "host_kv_capacity_tokens": self.host.capacity_tokens,
            "pod_memory_bytes": self.host.pod_memory_bytes,
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
            "kvCacheDtype": self.kv_cache_dtype,
            "hostKvCacheBytes": self.host.bytes,
            "hostKvCapacityTokens": self.host.capacity_tokens,
            "hostKvSource": self.host.source,
            "podMemoryBytes": self.host.pod_memory_bytes,
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


def _utilization(gpu_bytes: int, chosen: Candidate) -> float:
    """vLLM's budget under the plan: everything after its startup snapshot, as a share of the GPU.

    vLLM refuses to start when free memory at the snapshot is below utilisation x total; since the
    plan keeps the margin free on top of this budget, that check passes whenever the estimates hold.
    """
    used = chosen.overheads.total + chosen.kv_cache_bytes - chosen.overheads.pre_snapshot
    return math.ceil(used / gpu_bytes * _UTIL_STEP) / _UTIL_STEP


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
    host = host_tier(
        request.model,
        layout,
        size=request.host_kv,
        gpus_per_node=request.gpu.count_per_node,
        node_memory_bytes=request.node_memory_bytes,
        reserve_bytes_per_gpu=request.host_reserve_bytes_per_gpu,
    )
    if host.note:
        plan_notes.append(host.note)
    if request.max_num_seqs is None and chosen.max_num_seqs < request.gpu.default_max_num_seqs:
        if chosen.max_num_seqs == chosen.mnbt:
            plan_notes.append(
                f"max-num-seqs lowered to {chosen.max_num_seqs}, the max-num-batched-tokens given: vLLM refuses "
                "more sequences than batched tokens"
            )
        elif layout.hybrid:
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
        gpu_memory_utilization=_utilization(request.gpu.total_bytes, chosen),
        kv_cache_dtype=request.kv_cache_dtype,
        mamba_ssm_dtype=layout.ssm_dtype if request.mamba_ssm_dtype else None,
        layout=layout,
        breakdown=breakdown,
        candidates=candidates,
        inputs=recorded_inputs(request, extra_inputs or {}),
        notes=tuple(plan_notes),
        host=host,
    )
