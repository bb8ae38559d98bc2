"""The real-time engine is the replay's engine: same step times, same order, same cache hits."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cacheroute.planner.replay.hardware import EngineProfile
from cacheroute.planner.replay.policies import RoundRobin
from cacheroute.planner.replay.run import ReplayConfig, replay_trace
from cacheroute.planner.trace import NO_KEY, RequestTrace
from cacheroute.sandbox.emulator.engine import RealtimeEngine

PROFILE = EngineProfile(
    name="test",
    step_overhead_s=0.004,
    weight_read_s=0.002,
    compute_s_per_token=20e-6,
    attention_s_per_pair=1e-9,
    kv_read_s_per_token=2e-7,
    kv_capacity_tokens=4096,
    max_num_batched_tokens=256,
    max_num_seqs=8,
)
BLOCK = 16


def trace_of(requests: list[tuple[list[int], int, int]], arrivals: list[float]) -> RequestTrace:
    """Requests (block ids, input tokens, output tokens) arriving at `arrivals`."""
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum([len(b) for b, _, _ in requests], out=offsets[1:])
    return RequestTrace(
        arrival_s=np.array(arrivals, dtype=np.float64),
        key=np.full(len(requests), NO_KEY, dtype=np.int64),
        input_tokens=np.array([i for _, i, _ in requests], dtype=np.int64),
        output_tokens=np.array([o for _, _, o in requests], dtype=np.int64),
        block_offsets=offsets,
        block_ids=np.array([x for b, _, _ in requests for x in b], dtype=np.int64),
        block_size=BLOCK,
        key_names=(),
    )


async def run_engine(requests: list[tuple[list[int], int, int]]) -> tuple[list[tuple[float, float, int]], list[float]]:
    """Submit the requests one after the other; their outcomes and arrival times (from the first)."""
    engine = RealtimeEngine(PROFILE, BLOCK)
    flights = [engine.submit(list(blocks), n_in, n_out) for blocks, n_in, n_out in requests]
    for flight in flights:
        while not flight.finished:
            await flight.changed.wait()
            flight.changed.clear()
    outcomes = [(f.first_token_at - f.arrival, f.finished_at - f.arrival, f.cached_tokens) for f in flights]
    return outcomes, [f.arrival - flights[0].arrival for f in flights]


def replay(requests: list[tuple[list[int], int, int]], arrivals: list[float]) -> list[tuple[float, float, int]]:
    config = ReplayConfig(destinations=1, profile=PROFILE, warmup_fraction=0)
    result = replay_trace(trace_of(requests, arrivals), RoundRobin(), config)
    return list(zip(result.ttft_s.tolist(), result.e2e_s.tolist(), result.hit_tokens.tolist(), strict=True))


def blocks(prefix: int, n: int) -> list[int]:
    return [prefix * 1000 + j for j in range(n)]


@pytest.mark.parametrize(
    "requests",
    [
        [(blocks(1, 20), 320, 12)],
        # A batch: chunked prefill across steps, shared prefixes, decodes interleaved with prefill.
        [(blocks(1, 20), 320, 12), ([*blocks(1, 20), 77], 330, 5), (blocks(2, 8), 120, 30),
         (blocks(3, 30), 480, 1), (blocks(1, 10), 160, 9)],
    ],
    ids=["single", "batch"],
)
async def test_realtime_engine_reproduces_the_replay(requests: list[tuple[list[int], int, int]]) -> None:
    got, arrivals = await run_engine(requests)
    expected = replay(requests, arrivals)
    for (ttft, e2e, hit), (sim_ttft, sim_e2e, sim_hit) in zip(got, expected, strict=True):
        assert hit == sim_hit
        assert ttft == pytest.approx(sim_ttft, rel=1e-9, abs=1e-9)
        assert e2e == pytest.approx(sim_e2e, rel=1e-9, abs=1e-9)


async def test_streamed_token_counts_rise_one_per_step_to_the_output_length() -> None:
    engine = RealtimeEngine(PROFILE, BLOCK)
    flight = engine.submit(blocks(5, 4), 64, 40)
    loop = asyncio.get_running_loop()
    seen = []
    while not flight.finished:
        seen.append(engine.tokens_at(flight, loop.time()))
        await asyncio.sleep(0.003)
    seen.append(engine.tokens_at(flight, loop.time()))
    assert seen == sorted(seen)
    assert seen[-1] == 40
    # Decode steps here last ~6 ms, so a 3 ms poll sees most counts along the way.
    assert len(set(seen)) > 10


async def test_a_request_that_cannot_fit_is_refused_before_it_is_queued() -> None:
    engine = RealtimeEngine(PROFILE, BLOCK)
    assert engine.fits(250, 96)
    assert not engine.fits(256, 1)
