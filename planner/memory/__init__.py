"""The vLLM memory model: KV geometry, worst-case peak, flag chooser and startup-log parser.

Pure: numbers in, numbers out. The operator reads configs, logs and ConfigMaps and calls:

- `plan_memory(PlanRequest(...))` for Analytic mode, `plan_manual(request, kv_bytes)` for Manual;
- `parse_vllm_log(text)` then `plan_from_profile(request, profile, mnbt)` for Profiled mode
  (`modes.py`; each runs the chooser's steps, `chooser.py`);
- `MemoryPlan.vllm_args()` for the engine flags and `MemoryPlan.to_status()` for status.memoryPlan.
"""

from __future__ import annotations

from cacheroute.planner.memory.architecture import (
    QUANTIZATIONS,
    ModelArchitecture,
    Quantization,
    architecture_from_config,
    params_per_rank,
    preset,
    weights_bytes_per_gpu,
)
from cacheroute.planner.memory.candidates import Candidate
from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.gpus import GPUS, GpuModel, custom_gpu, gpu_by_name
from cacheroute.planner.memory.kvsize import (
    KV_CACHE_DTYPES,
    KvCacheDtype,
    KvLayout,
    attention_kv_bytes_per_token,
    gdn_state_bytes_per_seq,
    kv_layout,
)
from cacheroute.planner.memory.memory_plan import MemoryBreakdown, MemoryPlan
from cacheroute.planner.memory.modes import plan_from_profile, plan_manual, plan_memory
from cacheroute.planner.memory.peak import PeakBreakdown, PeakOptions, capture_sizes, estimate_peak
from cacheroute.planner.memory.presets import PRESET_CONFIGS
from cacheroute.planner.memory.request import DEFAULT_MNBT_CANDIDATES, DEFAULT_MNBT_FLOOR, PlanRequest
from cacheroute.planner.memory.vllm_log import Failure, MemoryProfile, parse_vllm_log

__all__ = [
    "DEFAULT_MNBT_CANDIDATES",
    "DEFAULT_MNBT_FLOOR",
    "GPUS",
    "KV_CACHE_DTYPES",
    "PRESET_CONFIGS",
    "QUANTIZATIONS",
    "Candidate",
    "Failure",
    "GpuModel",
    "KvCacheDtype",
    "KvLayout",
    "MemoryBreakdown",
    "MemoryPlan",
    "MemoryPlanError",
    "MemoryProfile",
    "ModelArchitecture",
    "PeakBreakdown",
    "PeakOptions",
    "PlanRequest",
    "Quantization",
    "architecture_from_config",
    "attention_kv_bytes_per_token",
    "capture_sizes",
    "custom_gpu",
    "estimate_peak",
    "gdn_state_bytes_per_seq",
    "gpu_by_name",
    "kv_layout",
    "params_per_rank",
    "parse_vllm_log",
    "plan_from_profile",
    "plan_manual",
    "plan_memory",
    "preset",
    "weights_bytes_per_gpu",
]
