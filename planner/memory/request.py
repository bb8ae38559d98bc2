"""What a memory plan is for (`PlanRequest`), its checks, and the record of it a plan keeps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cacheroute.planner.memory.architecture import ModelArchitecture, Quantization
from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.gpus import GIB, GpuModel
from cacheroute.planner.memory.host import DEFAULT_HOST_RESERVE_BYTES_PER_GPU, HostKvSize
from cacheroute.planner.memory.kvsize import KvCacheDtype, KvLayout, MambaCacheMode, kv_layout
from cacheroute.planner.memory.peak import PeakOptions

MODEL_VERSION = "cacheroute-memory/v1"
DEFAULT_MNBT_CANDIDATES: tuple[int, ...] = (2048, 3072, 4096, 6144, 8192, 16384)
# Below this, chunked prefill splits long prompts so finely that prefill throughput suffers.
DEFAULT_MNBT_FLOOR = 2048
DEFAULT_SAFETY_MARGIN_BYTES = 1 * GIB
# At most this share of the KV blocks may hold recurrent state when every allowed sequence runs;
# the rest stays for attention KV. A policy of ours, not a vLLM rule (vLLM only requires one block
# per sequence).
DEFAULT_STATE_SHARE = 0.5


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. `max_model_len=None` means the model's native length, as vLLM defaults.

    `host_kv` is the host-memory KV tier of one replica (`host.py`): bytes over its TP ranks,
    `auto` (from `node_memory_bytes`, one node's allocatable memory), or None for none.
    """

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
    host_kv: HostKvSize = None
    node_memory_bytes: int | None = None
    host_reserve_bytes_per_gpu: int = DEFAULT_HOST_RESERVE_BYTES_PER_GPU

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
    host = request.host_kv
    if host is not None and host != "auto" and (isinstance(host, bool) or not isinstance(host, int) or host < 0):
        raise MemoryPlanError(f"host KV cache must be auto or a number of bytes >= 0, got {host!r}")
    if request.node_memory_bytes is not None and request.node_memory_bytes <= 0:
        raise MemoryPlanError(f"node memory must be positive, got {request.node_memory_bytes} bytes")
    if request.host_reserve_bytes_per_gpu < 0:
        raise MemoryPlanError(f"host memory reserve must not be negative, got {request.host_reserve_bytes_per_gpu}")


def layout_for(request: PlanRequest) -> KvLayout:
    """The KV cache geometry the request implies."""
    return kv_layout(request.model, request.tp, request.kv_cache_dtype, request.mamba_ssm_dtype, request.cache_mode)


def recorded_inputs(request: PlanRequest, extra: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What a plan was computed from, as it records it (`status.memoryPlan.inputs`)."""
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
    if request.host_kv is not None:
        base["hostKvCache"] = str(request.host_kv)
        base["hostReserveBytesPerGpu"] = str(request.host_reserve_bytes_per_gpu)
        if request.node_memory_bytes is not None:
            base["nodeMemoryBytes"] = str(request.node_memory_bytes)
    if arch.is_hybrid:
        base["mambaCacheMode"] = request.cache_mode
        base["stateShare"] = str(request.state_share)
    if request.weights_bytes is not None:
        base["weightsBytes"] = str(request.weights_bytes)
    if request.param_count is not None:
        base["paramCount"] = str(request.param_count)
    return tuple(sorted((base | dict(extra)).items()))
