"""Profiled mode: flags from one measured vLLM startup instead of the analytic peak.

A profiling boot on the target node measures what the analytic model can only estimate: weights as
loaded, non-torch memory, the profiled activation peak and the CUDA-graph pool. What that boot cannot
measure is exactly what vLLM's profiler skips (issue #52872), so the plan still subtracts the
analytic worst-case prefill transient (GDN and attention kernels, MLA workspace, sampler sort) and
the safety margin from the measured budget, then pins `--kv-cache-memory-bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from cacheroute.planner.memory.chooser import MemoryPlan, Overheads, PlanRequest, choose, layout_for, validate_request
from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.peak import CUDA_CONTEXT_BYTES, NCCL_BYTES, estimate_peak
from cacheroute.planner.memory.vllm_log import GIB, MemoryProfile

# Measured and predicted bytes per KV token further apart than this suggest the wrong architecture
# or dtype was planned for; the plan says so.
_TOKEN_SIZE_TOLERANCE = 0.05


def _bytes(gib: float) -> int:
    return round(gib * GIB)


def _measured_overheads(request: PlanRequest, profile: MemoryProfile, total: int) -> Callable[[int, int], Overheads]:
    assert profile.weights_gib is not None and profile.consumed_gib is not None and profile.activation_gib is not None
    weights = _bytes(profile.weights_gib)
    if profile.startup_free_gib is not None:
        context = total - _bytes(profile.startup_free_gib)
    else:
        # V0 logs do not print the startup snapshot; use the analytic context and NCCL figures.
        context = CUDA_CONTEXT_BYTES + (NCCL_BYTES if request.tp > 1 else 0)
    non_torch = context + max(0, _bytes(profile.consumed_gib) - weights)
    graph = _bytes(profile.graph_gib or 0.0) if request.peak_options.cudagraphs else 0
    activation = _bytes(profile.activation_gib)

    def overheads(mnbt: int, seqs: int) -> Overheads:
        # Measured at the profiled concurrency; a lower max_num_seqs only shrinks the measured parts,
        # so they are kept as measured (the safe side) and only the unprofiled part is recomputed.
        peak = estimate_peak(
            request.model, request.tp, mnbt, seqs, request.target_model_len, options=request.peak_options
        )
        return Overheads(
            weights=weights,
            activation_profiled=activation,
            unprofiled_transient=peak.unprofiled_transient,
            graph_pool=graph,
            non_torch=non_torch,
            pre_snapshot=context,
            peak=peak,
        )

    return overheads


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
    return choose(measured, _measured_overheads(measured, profile, total), "Profiled", extra_inputs=extra, notes=notes)


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
