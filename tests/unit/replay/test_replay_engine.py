"""The replay on cases small enough to compute by hand, plus conservation and determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cacheroute.planner.replay.metrics import summarize
from cacheroute.planner.replay.policies import PowerOfTwo, RandomChoice, RoundRobin
from cacheroute.planner.replay.run import ReplayConfig, replay_trace
from cacheroute.planner.workloads import WorkloadSpec, generate


def _one_destination(profile) -> ReplayConfig:
    return ReplayConfig(destinations=1, profile=profile, warmup_fraction=0.0)


def test_ttft_and_kv_hit_by_hand(make_trace, make_profile) -> None:
    # Every step costs 10 ms; 8 tokens per step; blocks of 4 tokens.
    trace = make_trace([
        (0.0, "a", 8, 3, [1, 2]),  # prefill 8 in one step, then 2 decode steps
        (0.1, "a", 10, 1, [1, 2, 3]),  # blocks 1, 2 hit: 2 tokens left to prefill
        (1.0, "b", 20, 2, [10, 11, 12, 13, 14]),  # 20 tokens: chunks of 8, 8, 4
    ])
    r = replay_trace(trace, RoundRobin(), _one_destination(make_profile()))
    assert r.first_token_s.tolist() == pytest.approx([0.01, 0.11, 1.03])
    assert r.finish_s.tolist() == pytest.approx([0.03, 0.11, 1.04])
    assert r.hit_tokens.tolist() == [0, 8, 0]
    m = summarize(r)
    assert m.kv_hit == pytest.approx(8 / (8 + 10 + 20))
    assert m.ttft_p50_s == pytest.approx(0.01)


def test_a_fully_cached_prompt_still_computes_its_last_token(make_trace, make_profile) -> None:
    trace = make_trace([(0.0, "a", 8, 1, [1, 2]), (1.0, "a", 8, 1, [1, 2])])
    r = replay_trace(trace, RoundRobin(), _one_destination(make_profile()))
    assert r.hit_tokens.tolist() == [0, 7]


def test_decode_stretch_follows_the_kv_read_model(make_trace, make_profile) -> None:
    # A step costs 10 ms + 1 ms per 10 tokens of KV read by decoding sequences.
    prof = make_profile(kv_read_s_per_token=1e-4, batch_tokens=128)
    trace = make_trace([(0.0, "a", 100, 5, list(range(25)))])
    r = replay_trace(trace, RoundRobin(), _one_destination(prof))
    # Prefill step (no decoder): 10 ms. Then 4 decode steps reading 101, 102, 103, 104 tokens.
    expected = 0.01 + sum(0.01 + 1e-4 * k for k in (101, 102, 103, 104))
    assert r.first_token_s[0] == pytest.approx(0.01)
    assert r.finish_s[0] == pytest.approx(expected)


def test_an_arrival_joins_at_the_next_step_boundary(make_trace, make_profile) -> None:
    prof = make_profile(kv_read_s_per_token=1e-4, batch_tokens=128)
    trace = make_trace([
        (0.0, "a", 100, 50, list(range(25))),
        (0.105, "b", 4, 1, [900]),
    ])
    r = replay_trace(trace, RoundRobin(), _one_destination(prof))
    # Decode steps of request a end at 0.01 + sum_{j=1..k} (0.01 + 1e-4 * (100 + j)).
    ends = 0.01 + np.cumsum([0.01 + 1e-4 * (100 + j) for j in range(1, 50)])
    boundary = float(ends[np.searchsorted(ends, 0.105)])
    # b's step carries a's next decode token: 10 ms + KV read of a's context at that step.
    j = int(np.searchsorted(ends, 0.105)) + 2
    step = 0.01 + 1e-4 * (100 + j)
    assert r.first_token_s[1] == pytest.approx(boundary + step)
    assert r.finish_s[0] > r.finish_s[1]


def test_waiting_requests_queue_until_kv_frees(make_trace, make_profile) -> None:
    prof = make_profile(kv_capacity_tokens=20, batch_tokens=64)
    trace = make_trace([
        (0.0, "a", 12, 4, [1, 2, 3]),  # 12 + 4 = 16 tokens pinned
        (0.0, "b", 8, 2, [5, 6]),  # needs 10, only 4 left: waits for a
    ])
    r = replay_trace(trace, RoundRobin(), _one_destination(prof))
    assert r.start_s[1] == pytest.approx(r.finish_s[0])
    assert r.queue_s[1] == pytest.approx(0.04)


def test_oversized_requests_are_rejected_with_a_clear_error(make_trace, make_profile) -> None:
    trace = make_trace([(0.0, "a", 40, 1, list(range(10)))])
    with pytest.raises(ValueError, match=r"needs 41 \(prompt blocks"):
        replay_trace(trace, RoundRobin(), _one_destination(make_profile(kv_capacity_tokens=32)))


@pytest.fixture(scope="module")
def small_workload():
    spec = WorkloadSpec(name="small", keys=300, qps=20.0, duration_s=120.0, prefix_median_tokens=800,
                        message_median_tokens=100, output_median_tokens=60, block_size=64, seed=3)
    return generate(spec).trace


def test_every_request_finishes_exactly_once(small_workload) -> None:
    from cacheroute.planner.replay.hardware import DEFAULT_PROFILE

    r = replay_trace(small_workload, PowerOfTwo(), ReplayConfig(destinations=3, profile=DEFAULT_PROFILE))
    n = len(small_workload)
    assert not r.aborted
    assert np.isfinite(r.finish_s).all() and np.isfinite(r.first_token_s).all()
    assert ((r.dest >= 0) & (r.dest < 3)).all()
    assert (r.start_s >= r.arrival_s).all()
    assert (r.first_token_s > r.start_s).all()
    assert (r.finish_s >= r.first_token_s).all()
    assert (r.hit_tokens < r.input_tokens).all()
    # Tokens the engines processed: every prompt token not served from cache, plus one per output
    # token (the first comes out of the last prefill step).
    prefill = int((r.input_tokens - r.hit_tokens).sum())
    decode = int((r.output_tokens - 1).sum())
    assert int(r.processed_tokens.sum()) == prefill + decode
    assert len(r.finish_s) == n


def test_replays_are_deterministic_per_seed(small_workload) -> None:
    cfg = ReplayConfig(destinations=4, seed=7)
    a = replay_trace(small_workload, RandomChoice(), cfg)
    b = replay_trace(small_workload, RandomChoice(), cfg)
    c = replay_trace(small_workload, RandomChoice(), ReplayConfig(destinations=4, seed=8))
    assert np.array_equal(a.dest, b.dest)
    assert np.array_equal(a.finish_s, b.finish_s)
    assert not np.array_equal(a.dest, c.dest)


def test_abort_stops_a_replay_that_cannot_meet_the_slo(small_workload) -> None:
    fast = small_workload.time_scaled(50.0)
    r = replay_trace(fast, PowerOfTwo(), ReplayConfig(destinations=1, abort_above_p99_ttft_s=0.5))
    assert r.aborted
    m = summarize(r)
    assert m.ttft_p99_s > 0.5 or math.isinf(m.ttft_p99_s)


def test_a_prefix_held_in_host_memory_is_a_hit_that_pays_its_copy_back(make_trace, make_profile) -> None:
    """The same three requests with and without a host tier: the first prompt's blocks are evicted
    from a small GPU cache by the second; with a host tier the third request hits them and its
    first token comes later than a GPU hit by the copy (8 tokens x 1 ms), without one it misses."""
    from dataclasses import replace

    base = make_profile(kv_capacity_tokens=16, batch_tokens=16)
    requests = [
        (0.0, "a", 8, 1, [1, 2]),
        (1.0, "b", 12, 1, [3, 4, 5]),  # fills the GPU cache: blocks 1 and 2 are evicted
        (2.0, "a", 9, 1, [1, 2, 6]),
    ]
    gpu_only = replay_trace(make_trace(requests), RoundRobin(), _one_destination(base))
    host = replace(base, host_kv_capacity_tokens=64, kv_bytes_per_token_per_gpu=1000, host_link_bytes_per_s=1e6)
    assert host.host_copy_s_per_token == pytest.approx(1e-3)
    tiered = replay_trace(make_trace(requests), RoundRobin(), _one_destination(host))
    assert gpu_only.hit_tokens.tolist()[2] == 0
    assert tiered.hit_tokens.tolist()[2] == 8
    ttft = tiered.first_token_s[2] - tiered.arrival_s[2]
    assert ttft == pytest.approx(0.01 + 8 * 1e-3)
