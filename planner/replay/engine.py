"""One destination as a continuous-batching engine (vLLM V1 scheduler semantics, simplified).

Every step has a token budget (`max_num_batched_tokens`): each running sequence in decode takes
one token, the rest goes to prompt chunks, first of sequences already being prefilled, then of
waiting requests admitted in arrival order (chunked prefill). A waiting request is admitted when
its prompt blocks and its output fit in the KV cache next to the pinned blocks of the running
sequences; otherwise it and everything behind it waits (FCFS head of line, as vLLM's FCFS policy).
The output is reserved at admission, so no running sequence is ever preempted (vLLM would
preempt and recompute instead; reserving is the conservative equivalent). Prompt blocks found in
the host-memory tier (`cache.py`) are copied back during the step that admits the request, which
lasts that much longer (`EngineProfile.host_copy_s_per_token`).

Decode-only stretches are simulated in one event: between two arrivals or completions the batch
is constant, so the duration of m steps is an arithmetic series (the KV read grows by one token
per sequence per step). An arrival during such a stretch cuts it at the next step boundary.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from heapq import heappop, heappush

from cacheroute.planner.replay.cache import PrefixCache
from cacheroute.planner.replay.hardware import EngineProfile

IDLE = 0
PREFILL = 1
DECODE = 2


class RequestTable:
    """Per-request columns shared by the replay loop, the engines and the metrics (plain lists:
    element access on lists is several times faster than on numpy arrays in the event loop)."""

    __slots__ = (
        "arrival", "blocks_of", "dest", "done", "finish", "first", "hit", "inp", "kvb", "loaded", "out", "rem",
        "start",
    )

    def __init__(self, arrival: list[float], inp: list[int], out: list[int]) -> None:
        n = len(arrival)
        self.arrival = arrival
        self.inp = inp
        self.out = out
        self.dest = [-1] * n
        self.start = [math.nan] * n  # first scheduled (admitted)
        self.first = [math.nan] * n  # first output token
        self.finish = [math.nan] * n
        self.hit = [0] * n  # prompt tokens served from the prefix cache (either tier)
        self.loaded = [0] * n  # of those, tokens copied back from the host tier
        self.rem = [0] * n  # prompt tokens still to prefill
        self.done = [0] * n  # prompt tokens whose KV exists (hits + prefilled)
        self.kvb = [0] * n  # decode KV-read offset: context at step s is kvb + s
        self.blocks_of: dict[int, list[int]] = {}


class Engine:
    __slots__ = (
        "block_size", "budget", "busy_s", "c_attn", "c_compute", "c_copy", "c_kv", "c_overhead", "c_weight", "cache",
        "chunks", "dec_heap", "get_blocks", "idx",
        "kv_base", "m_alpha", "m_beta", "m_start", "m_steps", "max_seqs", "mode", "n_dec",
        "n_running", "prefilling", "profile", "req", "step_no", "steps", "t_end", "tokens",
        "version", "waiting",
    )

    def __init__(self, idx: int, profile: EngineProfile, block_size: int, req: RequestTable,
                 get_blocks: Callable[[int], list[int]]) -> None:
        self.idx = idx
        self.profile = profile
        self.block_size = block_size
        self.budget = profile.max_num_batched_tokens
        self.max_seqs = profile.max_num_seqs
        # Step-time constants as plain attributes: read on every event.
        self.c_overhead = profile.step_overhead_s
        self.c_weight = profile.weight_read_s
        self.c_compute = profile.compute_s_per_token
        self.c_attn = profile.attention_s_per_pair
        self.c_kv = profile.kv_read_s_per_token
        self.c_copy = profile.host_copy_s_per_token
        self.cache = PrefixCache(profile.kv_capacity_tokens, block_size, profile.host_kv_capacity_tokens)
        self.req = req
        self.get_blocks = get_blocks  # callable: request index -> list of block ids
        self.waiting: deque[int] = deque()
        self.prefilling: list[int] = []
        self.chunks: list[tuple[int, int]] = []
        self.dec_heap: list[tuple[int, int]] = []  # (step at which it finishes, request)
        self.n_dec = 0
        self.n_running = 0
        self.kv_base = 0
        self.step_no = 0
        self.mode = IDLE
        self.t_end = 0.0
        self.version = 0
        self.m_start = 0.0
        self.m_alpha = 0.0
        self.m_beta = 0.0
        self.m_steps = 0
        self.busy_s = 0.0
        self.tokens = 0
        self.steps = 0

    # -- scraped metrics ---------------------------------------------------------------------

    def kv_usage(self) -> float:
        """`vllm:kv_cache_usage_perc` / 100: the share of KV blocks running sequences hold."""
        return self.cache.usage()

    # -- events -----------------------------------------------------------------------------

    def enqueue(self, r: int, now: float) -> bool:
        """Add an arrival; return True when the engine's next event time changed."""
        was_empty = not self.waiting
        self.waiting.append(r)
        if self.mode == IDLE:
            self.plan(now)
            return self.mode != IDLE
        if self.mode == DECODE and was_empty and self.m_steps > 1:
            # Only a request that may be admitted at the next boundary is worth cutting for.
            cache = self.cache
            if cache.pinned_tokens + self.req.out[r] <= cache.capacity_tokens:
                return self._cut(now)
        return False

    def _cut(self, t: float) -> bool:
        alpha = self.m_alpha
        beta = self.m_beta
        dt = t - self.m_start
        if beta > 0.0:
            a = alpha - 0.5 * beta
            j = math.ceil((-a + math.sqrt(a * a + 2.0 * beta * dt)) / beta)
        else:
            j = math.ceil(dt / alpha)
        j = max(j, 1)
        while j > 1 and alpha * (j - 1) + 0.5 * beta * (j - 1) * (j - 2) >= dt:
            j -= 1
        while alpha * j + 0.5 * beta * j * (j - 1) < dt:
            j += 1
        if j >= self.m_steps:
            return False
        self.m_steps = j
        self.t_end = self.m_start + alpha * j + 0.5 * beta * j * (j - 1)
        self.version += 1
        return True

    def step_done(self, finished: list[int]) -> None:
        """Complete the current (macro) step at `self.t_end`; append finished requests."""
        now = self.t_end
        req = self.req
        dec_heap = self.dec_heap
        if self.mode == PREFILL:
            step_no = self.step_no + 1
            self.step_no = step_no
            rem = req.rem
            done = req.done
            out = req.out
            n_dec = self.n_dec
            kv_base = self.kv_base
            completed = False
            for r, c in self.chunks:
                left = rem[r] - c
                rem[r] = left
                done[r] += c
                if not left:
                    completed = True
                    req.first[r] = now
                    o = out[r]
                    if o <= 1:
                        req.finish[r] = now
                        self.n_running -= 1
                        self.cache.release(req.blocks_of.pop(r), o)
                        finished.append(r)
                    else:
                        heappush(dec_heap, (step_no + o - 1, r))
                        n_dec += 1
                        kvb = req.inp[r] - step_no
                        req.kvb[r] = kvb
                        kv_base += kvb
            self.chunks.clear()
            self.n_dec = n_dec
            self.kv_base = kv_base
            if completed:
                self.prefilling = [r for r in self.prefilling if rem[r]]
        else:
            m = self.m_steps
            self.busy_s += now - self.m_start
            self.tokens += self.n_dec * m
            self.steps += m
            step_no = self.step_no + m
            self.step_no = step_no
        if dec_heap and dec_heap[0][0] <= step_no:
            release = self.cache.release
            blocks_of = req.blocks_of
            out = req.out
            fin = req.finish
            kvbs = req.kvb
            n_dec = self.n_dec
            kv_base = self.kv_base
            k = 0
            while dec_heap and dec_heap[0][0] <= step_no:
                r = heappop(dec_heap)[1]
                n_dec -= 1
                kv_base -= kvbs[r]
                fin[r] = now
                release(blocks_of.pop(r), out[r])
                finished.append(r)
                k += 1
            self.n_dec = n_dec
            self.kv_base = kv_base
            self.n_running -= k
        self.plan(now)

    def plan(self, now: float) -> None:
        """Schedule the next step (or decode stretch) starting at `now`."""
        req = self.req
        n_dec = self.n_dec
        budget = self.budget - n_dec
        chunks = self.chunks
        rem = req.rem
        done = req.done
        prefill = 0
        pairs = 0.0
        copied = 0
        for r in self.prefilling:
            if budget <= 0:
                break
            c = min(rem[r], budget)
            pairs += c * (done[r] + 0.5 * c)
            prefill += c
            budget -= c
            chunks.append((r, c))
        waiting = self.waiting
        if waiting and budget > 0:
            cache = self.cache
            bs = self.block_size
            inp = req.inp
            out = req.out
            get_blocks = self.get_blocks
            blocks_of = req.blocks_of
            prefilling = self.prefilling
            n_running = self.n_running
            max_seqs = self.max_seqs
            while waiting and budget > 0 and n_running < max_seqs:
                r = waiting[0]
                blocks = blocks_of.get(r)
                if blocks is None:
                    blocks = get_blocks(r)
                    blocks_of[r] = blocks
                hit = cache.admit(blocks, out[r])
                if hit < 0:
                    break
                waiting.popleft()
                n_running += 1
                h = hit * bs
                n_in = inp[r]
                if h >= n_in:
                    h = n_in - 1
                if cache.loaded:
                    # Host-tier blocks come back before this step computes anything.
                    c = min(cache.loaded * bs, h)
                    req.loaded[r] = c
                    copied += c
                req.hit[r] = h
                req.start[r] = now
                left = n_in - h
                rem[r] = left
                done[r] = h
                prefilling.append(r)
                c = left if left < budget else budget
                pairs += c * (h + 0.5 * c)
                prefill += c
                budget -= c
                chunks.append((r, c))
            self.n_running = n_running
        if not (prefill or n_dec):
            self.mode = IDLE
            self.version += 1
            return
        # The step-time model of hardware.py: overhead, the weight stream or the GEMMs, prefill
        # attention, decode KV read (`pairs` is 0 in a decode-only step).
        gemm = self.c_compute * (prefill + n_dec)
        step = (
            self.c_overhead
            + (gemm if gemm > self.c_weight else self.c_weight)
            + self.c_attn * pairs
            + self.c_kv * (self.kv_base + n_dec * (self.step_no + 1))
        )
        if copied:
            step += self.c_copy * copied
        if prefill:
            self.mode = PREFILL
            self.t_end = now + step
            self.busy_s += step
            self.tokens += prefill + n_dec
            self.steps += 1
        else:
            # A decode stretch of m steps: each reads one more token of KV per sequence.
            m = self.dec_heap[0][0] - self.step_no
            beta = self.c_kv * n_dec
            self.mode = DECODE
            self.m_start = now
            self.m_alpha = step
            self.m_beta = beta
            self.m_steps = m
            self.t_end = now + step * m + 0.5 * beta * m * (m - 1)
        self.version += 1
