"""The three ways to a memory plan, as InferencePool `spec.memory.mode` names them.

- Analytic (`plan_memory`): overheads from the architecture model alone.
- Manual (`plan_manual`): the KV bytes are given; the other flags and the worst-case check come
  from the model.
- Profiled (`plan_from_profile`): overheads measured by one vLLM startup on the target node (its
  log, `vllm_log.parse_vllm_log`). What that boot cannot measure is exactly what vLLM's profiler
  skips (issue #52872), so the plan still subtracts the analytic worst-case prefill transient (GDN
  and attention kernels, MLA workspace, sampler sort) and the safety margin from the measured
  budget, then pins `--kv-cache-memory-bytes`.
"""

from __future__ import annotations

from dataclasses import replace

from cacheroute.planner.memory.candidates import Limits, evaluate_candidate
from cacheroute.planner.memory.chooser import choose
from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.gpus import GIB
from cacheroute.planner.memory.memory_plan import MemoryPlan, build_plan
from cacheroute.planner.memory.overheads import analytic_overheads, measured_overheads
from cacheroute.planner.memory.request import PlanRequest, layout_for, validate_request
from cacheroute.planner.memory.vllm_log import MemoryProfile

# Measured and predicted bytes per KV token further apart than this suggest the wrong architecture
# or dtype was planned for; the plan says so.
_TOKEN_SIZE_TOLERANCE = 0.05


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _bytes(gib: float) -> int:
    return round(gib * GIB)


def plan_memory(request: PlanRequest) -> MemoryPlan:
    """The Analytic plan: flags from the architecture model alone."""
    validate_request(request)
    return choose(request, analytic_overheads(request), "Analytic")


def plan_manual(request: PlanRequest, kv_cache_memory_bytes: int) -> MemoryPlan:
    """A Manual plan: the KV bytes are given; the other flags and the worst-case check come from the model."""
    validate_request(request)
    if kv_cache_memory_bytes <= 0:
        raise MemoryPlanError(f"kvCacheMemoryBytes must be positive, got {kv_cache_memory_bytes}")
    pinned = replace(request, mnbt=request.mnbt or request.mnbt_floor)
    mnbt = pinned.mnbt or pinned.mnbt_floor
    overheads = analytic_overheads(pinned)
    layout = layout_for(pinned)
    limits = Limits.of(pinned)
    room = evaluate_candidate(mnbt, layout=layout, limits=limits, overheads=overheads)
    if kv_cache_memory_bytes >= room.kv_cache_bytes + layout.bytes_per_block:
        raise MemoryPlanError(
            f"kvCacheMemoryBytes {kv_cache_memory_bytes:,} ({_gib(kv_cache_memory_bytes)}) is more than the "
            f"worst case at max-num-batched-tokens {mnbt} leaves ({_gib(room.kv_cache_bytes)}): "
            f"{_gib(kv_cache_memory_bytes - room.kv_cache_bytes)} over; lower it or use Analytic mode"
        )
    chosen = evaluate_candidate(mnbt, layout=layout, limits=limits, overheads=overheads, kv_cap=kv_cache_memory_bytes)
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


def plan_from_profile(request: PlanRequest, profile: MemoryProfile, mnbt: int | None = None) -> MemoryPlan:
    """Flags from a profiling boot run with `mnbt` (or the mnbt its log reports) and `request`'s settings."""
    validate_request(request)
    if profile.failed:
        first = profile.failures[0]
        raise MemoryPlanError(f"the profiling boot failed ({first.kind}): {first.text}")
    need = profile.budget_missing(cudagraphs=request.peak_options.cudagraphs)
    if need:
        raise MemoryPlanError(f"the profiling log lacks the lines a measured budget needs: {', '.join(need)}")
    profiled_mnbt = mnbt or request.mnbt or profile.max_num_batched_tokens
    if profiled_mnbt is None:
        raise MemoryPlanError("the mnbt of the profiling boot is unknown: its log does not say and none was given")
    if profile.max_num_batched_tokens is not None and profile.max_num_batched_tokens != profiled_mnbt:
        raise MemoryPlanError(
            f"the profiling log ran max_num_batched_tokens={profile.max_num_batched_tokens}, not {profiled_mnbt}"
        )
    total = _bytes(profile.total_gib) if profile.total_gib is not None else request.gpu.total_bytes
    measured = replace(request, gpu=replace(request.gpu, total_bytes=total), mnbt=profiled_mnbt)
    notes = _cross_checks(measured, profile)
    extra = {
        "profileWeightsGiB": f"{profile.weights_gib:.2f}",
        "profileActivationGiB": f"{profile.activation_gib:.2f}",
        "profileGraphGiB": f"{profile.graph_gib or 0.0:.2f}",
    }
    if profile.kv_suggestion_fit_bytes is not None:
        extra["profileKvSuggestionBytes"] = str(profile.kv_suggestion_fit_bytes)
    return choose(measured, measured_overheads(measured, profile, total), "Profiled", extra_inputs=extra, notes=notes)


def _cross_checks(request: PlanRequest, profile: MemoryProfile) -> tuple[str, ...]:
    notes = []
    layout = layout_for(request)
    if profile.missing:
        notes.append(f"profiling log lacked: {', '.join(profile.missing)}")
    if not layout.hybrid and profile.available_kv_gib and profile.kv_cache_tokens:
        measured = _bytes(profile.available_kv_gib) / profile.kv_cache_tokens
        predicted = layout.attention_bytes_per_token
        if abs(measured - predicted) > _TOKEN_SIZE_TOLERANCE * predicted:
            notes.append(
                f"vLLM's KV figures imply {measured:,.0f} B per token, the architecture model {predicted:,} B: "
                "check the model config, quantization and KV dtype"
            )
    if layout.hybrid and profile.attention_block_size and profile.attention_block_size != layout.block_size:
        notes.append(
            f"vLLM chose a {profile.attention_block_size}-token attention block, the model predicts {layout.block_size}"
        )
    return tuple(notes)
