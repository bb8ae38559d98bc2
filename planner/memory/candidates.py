"""What one candidate `max-num-batched-tokens` leaves for KV, and which candidate is best.

For a candidate mnbt, the GPU's memory less the overheads at that mnbt (`overheads.py`) and the
safety margin becomes KV cache, rounded down to whole blocks. On GDN hybrids `max-num-seqs` is
capped so that the recurrent state of every running sequence fits in a stated share of those
blocks (vLLM refuses outright above one block per sequence). The candidate with the most servable
KV tokens wins; ties, or anything within `kv_tolerance`, go to the larger mnbt for prefill
throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.gpus import GIB
from cacheroute.planner.memory.kvsize import KvLayout
from cacheroute.planner.memory.overheads import OverheadModel, Overheads
from cacheroute.planner.memory.request import PlanRequest


@dataclass(frozen=True)
class Limits:
    """What every candidate is held to, settled once from the request."""

    gpu_bytes: int
    margin_bytes: int
    max_num_seqs: int | None  # set by the user; None: the GPU's default, lowered on hybrids if need be
    default_num_seqs: int
    state_share: float  # of the KV blocks, for the recurrent state of hybrids
    native_len: int  # the model's max_position_embeddings
    wanted_len: int  # max_model_len asked for (the native length when not given)
    auto_len: bool  # fit max_model_len to what the KV cache holds instead

    @classmethod
    def of(cls, request: PlanRequest) -> Limits:
        return cls(
            gpu_bytes=request.gpu.total_bytes,
            margin_bytes=request.safety_margin_bytes,
            max_num_seqs=request.max_num_seqs,
            default_num_seqs=request.gpu.default_max_num_seqs,
            state_share=request.state_share,
            native_len=request.model.max_position_embeddings,
            wanted_len=request.target_model_len,
            auto_len=request.auto_max_model_len,
        )

    def kv_bytes(self, over: Overheads) -> int:
        """What the overheads and the margin leave of the GPU."""
        return self.gpu_bytes - over.total - self.margin_bytes


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


def candidate_mnbts(request: PlanRequest) -> tuple[int, ...]:
    """The mnbt values to try: the one asked for, or the candidates at or above the floor."""
    if request.mnbt is not None:
        return (request.mnbt,)
    floor = request.mnbt_floor
    if request.max_num_seqs is not None:
        floor = max(floor, request.max_num_seqs)
    chosen = sorted({m for m in request.mnbt_candidates if m >= floor})
    if not chosen:
        # vLLM schedules at least one token per running sequence in a step: mnbt >= max_num_seqs.
        why = (
            f"--max-num-seqs {request.max_num_seqs}" if floor == request.max_num_seqs else f"the floor {floor}"
        )
        raise MemoryPlanError(
            f"no max-num-batched-tokens candidate in {list(request.mnbt_candidates)} is at or above {why}; "
            f"give --max-num-batched-tokens at or above it, or a smaller --max-num-seqs"
        )
    return tuple(chosen)


def evaluate_candidate(
    mnbt: int, *, layout: KvLayout, limits: Limits, overheads: OverheadModel, kv_cap: int | None = None
) -> Candidate:
    """What one mnbt leaves for KV, with max_num_seqs and max_model_len settled.

    `kv_cap` limits the KV cache to given bytes (Manual mode); what it leaves unused shows as free.
    """

    def room(over: Overheads) -> int:
        kv = limits.kv_bytes(over)
        return kv if kv_cap is None else min(kv, kv_cap)

    wanted_seqs = limits.max_num_seqs or limits.default_num_seqs
    seqs = min(wanted_seqs, mnbt)
    over = overheads(mnbt, seqs)
    blocks = layout.num_blocks(room(over))
    if layout.hybrid:
        state_cap = int(blocks * limits.state_share) // layout.state_blocks_per_seq
        if limits.max_num_seqs is None and state_cap < seqs:
            seqs = max(1, state_cap)
            over = overheads(mnbt, seqs)
            blocks = layout.num_blocks(room(over))
    kv_bytes = blocks * layout.bytes_per_block
    single = layout.max_request_tokens(blocks)
    capacity = layout.tokens_with(blocks, seqs if layout.hybrid else 0)
    # Auto-fit stays within what the pool holds with every allowed sequence running (on hybrids that
    # is below the single-request maximum vLLM itself checks).
    model_len = min(limits.native_len, capacity or single) if limits.auto_len else limits.wanted_len
    reason, missing = "", 0
    if blocks < 1:
        need = layout.bytes_for_request(limits.wanted_len)
        # The missing bytes count this request's KV too: say so, or the parts below do not add up.
        reason = (
            f"no memory left for a single KV block, and one {limits.wanted_len:,}-token request needs "
            f"{need / GIB:.2f} GiB of KV"
        )
        missing = need - limits.kv_bytes(over)
    elif layout.hybrid and seqs > layout.max_state_seqs(blocks):
        reason = f"max_num_seqs {seqs} exceeds the {blocks} mamba state blocks (vLLM refuses to start)"
        missing = (seqs - blocks) * layout.bytes_per_block
    elif model_len < 1 or single < model_len:
        reason = f"one {model_len:,}-token request needs {layout.bytes_for_request(model_len) / GIB:.2f} GiB of KV"
        missing = layout.bytes_for_request(model_len) - limits.kv_bytes(over)
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


def pick(candidates: tuple[Candidate, ...], kv_tolerance: float) -> Candidate | None:
    """The fitting candidate with the most servable tokens; near-ties go to the larger mnbt."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return None
    best = max(c.kv_capacity_tokens for c in fitting)
    good = [c for c in fitting if c.kv_capacity_tokens >= best * (1 - kv_tolerance)]
    return max(good, key=lambda c: c.mnbt)
