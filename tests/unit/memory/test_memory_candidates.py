"""The chooser's steps through their own modules: what one candidate mnbt leaves, which one wins."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cacheroute.planner.memory import MemoryPlanError, PlanRequest, gpu_by_name, plan_memory, preset
from cacheroute.planner.memory.candidates import Candidate, Limits, candidate_mnbts, evaluate_candidate, pick
from cacheroute.planner.memory.gpus import GIB
from cacheroute.planner.memory.overheads import Overheads, analytic_overheads
from cacheroute.planner.memory.request import layout_for

H100 = gpu_by_name("h100-80gb")


def flat_overheads(total_gib: float):
    """The same overheads at every mnbt: `total_gib` of weights."""

    def overheads(mnbt: int, seqs: int) -> Overheads:
        return Overheads(weights=int(total_gib * GIB), activation_profiled=0, unprofiled_transient=0, graph_pool=0,
                         non_torch=0, pre_snapshot=0)

    return overheads


def candidate(mnbt: int, tokens: int, fits: bool = True) -> Candidate:
    over = Overheads(0, 0, 0, 0, 0, 0)
    return Candidate(mnbt, fits, "fits" if fits else "no", 0, 0, tokens, 0, 1, 1, 0, over)


def test_the_best_candidate_serves_the_most_tokens_and_near_ties_go_to_the_larger_mnbt() -> None:
    cands = (candidate(2048, 1_000), candidate(4096, 990), candidate(8192, 2_000, fits=False))
    assert pick(cands, 0.0) == cands[0]
    assert pick(cands, 0.02) == cands[1]
    assert pick(cands[2:], 0.5) is None


def test_candidate_mnbts_start_at_the_floor_or_at_max_num_seqs() -> None:
    request = PlanRequest(model=preset("llama-3.1-8b"), gpu=H100)
    assert candidate_mnbts(request) == (2048, 3072, 4096, 6144, 8192, 16384)
    assert candidate_mnbts(replace(request, max_num_seqs=5000)) == (6144, 8192, 16384)
    assert candidate_mnbts(replace(request, mnbt=1024)) == (1024,)
    with pytest.raises(MemoryPlanError, match="at or above the floor"):
        candidate_mnbts(replace(request, mnbt_floor=20_000))
    with pytest.raises(MemoryPlanError, match="at or above --max-num-seqs 65536; give --max-num-batched-tokens"):
        candidate_mnbts(replace(request, max_num_seqs=65536))


def test_what_the_overheads_and_margin_leave_becomes_whole_kv_blocks() -> None:
    request = PlanRequest(model=preset("llama-3.1-8b"), gpu=H100)
    layout = layout_for(request)
    limits = Limits.of(request)
    c = evaluate_candidate(4096, layout=layout, limits=limits, overheads=flat_overheads(20.0))
    room = H100.total_bytes - 20 * GIB - request.safety_margin_bytes
    assert c.fits
    assert c.num_blocks == room // layout.bytes_per_block
    assert room - layout.bytes_per_block < c.kv_cache_bytes <= room
    capped = evaluate_candidate(4096, layout=layout, limits=limits, overheads=flat_overheads(20.0), kv_cap=GIB)
    assert capped.kv_cache_bytes <= GIB < capped.kv_cache_bytes + layout.bytes_per_block


def test_a_candidate_that_cannot_hold_one_full_request_says_how_much_is_missing() -> None:
    request = PlanRequest(model=preset("llama-3.1-8b"), gpu=H100)
    layout = layout_for(request)
    c = evaluate_candidate(4096, layout=layout, limits=Limits.of(request), overheads=flat_overheads(77.0))
    assert not c.fits
    assert c.reason.startswith("one 131,072-token request needs")
    assert c.missing_bytes > 0
    assert c.missing_bytes == layout.bytes_for_request(c.max_model_len) - (
        H100.total_bytes - 77 * GIB - request.safety_margin_bytes
    )


def test_on_hybrids_max_num_seqs_is_lowered_until_the_recurrent_state_fits_its_share() -> None:
    request = PlanRequest(model=preset("qwen3-next-80b-a3b"), gpu=H100, quantization="fp8", tp=2)
    layout = layout_for(request)
    assert layout.hybrid
    limits = Limits.of(request)
    c = evaluate_candidate(2048, layout=layout, limits=limits, overheads=analytic_overheads(request))
    assert c.max_num_seqs < H100.default_max_num_seqs
    assert c.max_num_seqs * layout.state_blocks_per_seq <= c.num_blocks * request.state_share
    # A user's max_num_seqs is kept as given.
    pinned = replace(limits, max_num_seqs=64)
    kept = evaluate_candidate(2048, layout=layout, limits=pinned, overheads=analytic_overheads(request))
    assert kept.max_num_seqs == 64


def test_the_plan_is_the_best_candidate_of_the_steps() -> None:
    request = PlanRequest(model=preset("llama-3.3-70b"), gpu=H100, quantization="fp8", tp=2)
    layout = layout_for(request)
    limits = Limits.of(request)
    cands = tuple(
        evaluate_candidate(m, layout=layout, limits=limits, overheads=analytic_overheads(request))
        for m in candidate_mnbts(request)
    )
    best = pick(cands, request.kv_tolerance)
    assert best is not None
    plan = plan_memory(request)
    assert (plan.max_num_batched_tokens, plan.kv_cache_memory_bytes) == (best.mnbt, best.kv_cache_bytes)
    assert plan.candidates == cands
