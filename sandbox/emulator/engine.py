"""The shadow replay's engine, advanced in real time on an asyncio loop.

`planner.replay.engine.Engine` is a discrete-event model: it plans a step (or a stretch of decode
steps) and says when it ends (`t_end`); `step_done()` completes it and plans the next. The replay
calls it from its event heap; here a loop timer at `t_end` does, and requests arrive when HTTP
requests do. Engine time is the loop's clock (`loop.time()`), so every step lasts exactly what the
engine says; a timer that fires late (a busy machine) completes its step at the engine's own
`t_end` and the engine catches up, just as the replay's event loop would order the same events.

Within a decode stretch the engine does not stop per token; the tokens a request has produced
by time t follow from the stretch's step-time series (`tokens_at`), which is what streaming uses.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cacheroute.planner.replay.engine import DECODE, IDLE, PREFILL, Engine, RequestTable
from cacheroute.planner.replay.hardware import EngineProfile


class _Table(RequestTable):
    """A request table that grows on arrival and reuses the rows of finished requests."""

    def __init__(self) -> None:
        super().__init__([], [], [])
        self.free_rows: list[int] = []

    def add(self, arrival: float, n_in: int, n_out: int) -> int:
        if self.free_rows:
            r = self.free_rows.pop()
            self.arrival[r] = arrival
            self.inp[r] = n_in
            self.out[r] = n_out
            self.dest[r] = 0
            self.start[r] = self.first[r] = self.finish[r] = math.nan
            self.hit[r] = self.loaded[r] = self.rem[r] = self.done[r] = self.kvb[r] = 0
            return r
        r = len(self.arrival)
        self.arrival.append(arrival)
        self.inp.append(n_in)
        self.out.append(n_out)
        self.dest.append(0)
        self.start.append(math.nan)
        self.first.append(math.nan)
        self.finish.append(math.nan)
        self.hit.append(0)
        self.loaded.append(0)
        self.rem.append(0)
        self.done.append(0)
        self.kvb.append(0)
        return r


@dataclass(eq=False)
class EngineRequest:
    """One request inside the engine, as the HTTP layer follows it."""

    input_tokens: int
    output_tokens: int
    arrival: float
    scheduled_at: float = math.nan
    first_token_at: float = math.nan
    finished_at: float = math.nan
    cached_tokens: int = 0
    # What the reply will say ended it: "length" (max_tokens) or "stop".
    finish_reason: str = "length"
    # The engine step that produced the first token (its later tokens come one per step).
    first_step: int = -1
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def started(self) -> bool:
        return self.first_step >= 0

    @property
    def finished(self) -> bool:
        return not math.isnan(self.finished_at)


Listener = Callable[[EngineRequest], None]


class RealtimeEngine:
    """One vLLM engine core (one pod): the replay's `Engine` driven by loop timers."""

    def __init__(
        self,
        profile: EngineProfile,
        block_size: int,
        *,
        on_first: Listener = lambda _s: None,
        on_finish: Listener = lambda _s: None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.table = _Table()
        self._blocks: dict[int, list[int]] = {}
        self.engine = Engine(0, profile, block_size, self.table, self._blocks.pop)
        self._sequences: dict[int, EngineRequest] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.nan
        self._finished: list[int] = []
        self._on_first = on_first
        self._on_finish = on_finish
        self.closed = False

    # -- what the metrics read ------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self.engine.n_running

    @property
    def waiting(self) -> int:
        return len(self.engine.waiting)

    def kv_usage(self) -> float:
        return self.engine.kv_usage()

    def fits(self, blocks: int, output_tokens: int) -> bool:
        """Whether a request can ever be admitted (its prompt blocks and output fit the cache alone)."""
        return blocks * self.engine.block_size + output_tokens <= self.engine.cache.capacity_tokens

    # -- requests --------------------------------------------------------------------------------

    def submit(self, blocks: list[int], input_tokens: int, output_tokens: int) -> EngineRequest:
        """Queue a request now; its `changed` event is set at the first token and at the end."""
        if self.closed:
            raise RuntimeError("the engine is stopped")
        now = self.loop.time()
        self._advance(now)
        r = self.table.add(now, input_tokens, max(1, output_tokens))
        self._blocks[r] = blocks
        sequence = EngineRequest(input_tokens, max(1, output_tokens), now)
        self._sequences[r] = sequence
        self.engine.enqueue(r, now)
        self._schedule()
        return sequence

    def tokens_at(self, sequence: EngineRequest, now: float) -> int:
        """Output tokens `sequence` has produced by `now` (loop time)."""
        if sequence.finished:
            return sequence.output_tokens
        if not sequence.started:
            return 0
        self._advance(now)
        if sequence.finished:
            return sequence.output_tokens
        engine = self.engine
        step = engine.step_no
        if engine.mode == DECODE:
            step += _steps_done(engine.m_alpha, engine.m_beta, engine.m_steps, now - engine.m_start)
        return min(sequence.output_tokens, step - sequence.first_step + 1)

    def close(self) -> None:
        """Stop the timers; requests in flight never complete (their server is gone)."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the clock -------------------------------------------------------------------------------

    def _schedule(self) -> None:
        engine = self.engine
        if engine.mode == IDLE or self.closed:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is not None and self._timer_at == engine.t_end:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = engine.t_end
        self._timer = self.loop.call_at(engine.t_end, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._advance(self.loop.time())
        self._schedule()

    def _advance(self, now: float) -> None:
        """Complete every step that ends by `now`, in order, as the replay's event loop does."""
        engine = self.engine
        table = self.table
        finished = self._finished
        sequences = self._sequences
        while engine.mode != IDLE and engine.t_end <= now:
            firsts: Sequence[int] = ()
            if engine.mode == PREFILL:
                rem = table.rem
                firsts = [r for r, c in engine.chunks if rem[r] == c]
            engine.step_done(finished)
            for r in firsts:
                sequence = sequences[r]
                sequence.first_step = engine.step_no
                sequence.scheduled_at = table.start[r]
                sequence.first_token_at = table.first[r]
                sequence.cached_tokens = table.hit[r]
                self._on_first(sequence)
                sequence.changed.set()
            for r in finished:
                sequence = sequences.pop(r)
                sequence.finished_at = table.finish[r]
                self._on_finish(sequence)
                sequence.changed.set()
                table.free_rows.append(r)
            finished.clear()


def _steps_done(alpha: float, beta: float, steps: int, elapsed: float) -> int:
    """Whole steps of a decode stretch (step j lasts alpha + beta * (j - 1)) completed after `elapsed`."""
    if elapsed <= 0:
        return 0
    if beta > 0:
        a = alpha - 0.5 * beta
        j = int((-a + math.sqrt(a * a + 2.0 * beta * elapsed)) / beta)
    else:
        j = int(elapsed / alpha) if alpha > 0 else steps
    while j > 0 and alpha * j + 0.5 * beta * j * (j - 1) > elapsed:
        j -= 1
    while j < steps and alpha * (j + 1) + 0.5 * beta * (j + 1) * j <= elapsed:
        j += 1
    return min(j, steps)
