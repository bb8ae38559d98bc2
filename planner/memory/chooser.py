"""Choose vLLM's memory flags: the mnbt that leaves the most servable KV with the worst case inside the GPU.

    plan = choose(request, overheads, "Analytic")

1. The KV layout of the model and the limits every candidate is held to (`request.py`).
2. What each candidate `max-num-batched-tokens` leaves for KV once the overheads at that mnbt
   (`overheads.py`: analytic, or measured in Profiled mode) and the safety margin are taken
   (`candidates.evaluate_candidate`).
3. The best candidate: the most servable KV tokens, near-ties to the larger mnbt (`candidates.pick`).
4. The plan: flags and the breakdown of one GPU, against vLLM's default mnbt (`memory_plan.py`).

When nothing fits, the error says what is missing and what would fit (a larger tensor parallel
size, a shorter `--max-model-len`). The three modes that call it are in `modes.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from cacheroute.planner.memory.candidates import Candidate, Limits, candidate_mnbts, evaluate_candidate, pick
from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.gpus import GIB
from cacheroute.planner.memory.kvsize import KvLayout
from cacheroute.planner.memory.memory_plan import MemoryPlan, Source, build_plan
from cacheroute.planner.memory.overheads import OverheadModel, analytic_overheads
from cacheroute.planner.memory.request import PlanRequest, layout_for, validate_request


def _candidates(request: PlanRequest, layout: KvLayout, overheads: OverheadModel) -> tuple[Candidate, ...]:
    limits = Limits.of(request)
    return tuple(
        evaluate_candidate(m, layout=layout, limits=limits, overheads=overheads) for m in candidate_mnbts(request)
    )


def choose(
    request: PlanRequest,
    overheads: OverheadModel,
    source: Source,
    *,
    extra_inputs: Mapping[str, str] | None = None,
    notes: tuple[str, ...] = (),
) -> MemoryPlan:
    """The plan of the best candidate mnbt under `overheads` (see the module docstring); raises
    MemoryPlanError saying what is missing and what would fit when no candidate fits."""
    layout = layout_for(request)
    candidates = _candidates(request, layout, overheads)
    chosen = pick(candidates, request.kv_tolerance)
    if chosen is None:
        raise MemoryPlanError(_no_fit_message(request, min(candidates, key=lambda c: c.missing_bytes)))
    default_mnbt = request.gpu.default_max_num_batched_tokens
    default = next((c for c in candidates if c.mnbt == default_mnbt), None)
    if default is None:
        limits = Limits.of(request)
        default = evaluate_candidate(default_mnbt, layout=layout, limits=limits, overheads=overheads)
    return build_plan(
        request, layout, candidates, chosen, default_candidate=default, source=source, extra_inputs=extra_inputs,
        notes=notes,
    )


def _analytic_fit(request: PlanRequest) -> Candidate | None:
    """The candidate the Analytic mode would choose for `request`, if any fits (for hints)."""
    try:
        validate_request(request)
        return pick(_candidates(request, layout_for(request), analytic_overheads(request)), request.kv_tolerance)
    except MemoryPlanError:
        return None


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
        other = _analytic_fit(replace(request, tp=tp))
        if other is not None:
            hints.append(f"TP={tp} fits ({other.kv_capacity_tokens:,} KV tokens per replica)")
            break
    else:
        hints.append(f"no tensor parallel size up to {request.tp_limit} fits")
    if worst.max_request_tokens > 0 and not request.auto_max_model_len:
        hints.append(f"or lower --max-model-len to at most {worst.max_request_tokens:,}")
    tail = "; ".join(hints)
    return f"{head}. {tail[0].upper()}{tail[1:]}."
