"""The workload generator reaches the statistics it is asked for."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import numpy as np
import pytest

from cacheroute.planner.workloads import (
    PRESETS,
    SAMPLED_RANGES,
    WorkloadSpec,
    generate,
    preset,
    sampled_spec,
    workload_spec,
)


def _spec(**kw: object) -> WorkloadSpec:
    base: dict[str, object] = dict(name="t", keys=2000, qps=40.0, duration_s=600.0, block_size=128, seed=1)
    base.update(kw)
    return WorkloadSpec(**base)  # type: ignore[arg-type]


def test_generated_statistics_meet_their_targets() -> None:
    w = generate(_spec(top_key_request_share=0.47, multi_turn_share=0.8))
    st = w.stats()
    assert st.distinct_keys == 2000
    assert st.top_keys_request_share == pytest.approx(0.47, abs=0.02)
    assert st.multi_turn_request_share == pytest.approx(0.8, abs=0.02)
    assert st.qps == pytest.approx(40.0, rel=0.05)
    assert 60 < st.median_turn_gap_s < 240  # minute-scale gaps around the 2-minute median


def test_turns_extend_the_previous_prompt_and_answer() -> None:
    w = generate(_spec(keys=50, qps=2.0, multi_turn_share=0.9))
    tr, th = w.trace, w.thread
    checked = 0
    for t in np.unique(th)[:40]:
        rows = np.flatnonzero(th == t)
        for a, b in itertools.pairwise(rows):
            assert tr.arrival_s[b] > tr.arrival_s[a]
            assert tr.input_tokens[b] >= tr.input_tokens[a] + tr.output_tokens[a]
            full = int(tr.input_tokens[a]) // tr.block_size
            assert tr.blocks(int(b))[:full].tolist() == tr.blocks(int(a))[:full].tolist()
            checked += 1
    assert checked > 10


def test_keys_share_their_stable_prefix_and_prefix_sizes_differ() -> None:
    w = generate(_spec(keys=20, qps=2.0, prefix_median_tokens=1024, prefix_sigma=1.0))
    tr = w.trace
    firsts: dict[int, list[int]] = {}
    sizes: set[int] = set()
    for i in range(len(tr)):
        k = int(tr.key[i])
        b = tr.blocks(i)[:2].tolist()
        firsts.setdefault(k, b)
        if tr.input_tokens[i] >= 3 * tr.block_size:
            assert b == firsts[k] or len(firsts[k]) < 2
        sizes.add(int(tr.input_tokens[i]) // 256)
    assert len(sizes) > 5


def test_generation_is_deterministic_per_seed() -> None:
    a = generate(_spec(seed=4)).trace
    b = generate(_spec(seed=4)).trace
    c = generate(_spec(seed=5)).trace
    assert np.array_equal(a.block_ids, b.block_ids) and np.array_equal(a.arrival_s, b.arrival_s)
    assert not np.array_equal(a.arrival_s[:100], c.arrival_s[:100])


def test_infeasible_specs_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="cannot cover"):
        generate(_spec(keys=100_000, qps=1.0, duration_s=60.0))
    with pytest.raises(ValueError, match="top-key share"):
        generate(_spec(keys=100, qps=1.0, duration_s=1000.0, top_key_request_share=0.9))
    with pytest.raises(ValueError, match="multi_turn_share"):
        _spec(multi_turn_share=1.5)


def test_an_unreachable_top_key_share_names_a_key_count_that_reaches_it() -> None:
    spec = replace(preset("cacheroute-paper"), keys=40, qps=4.0, duration_s=45.0)
    with pytest.raises(ValueError, match=r"at most (\d+) keys reach it") as caught:
        generate(spec)
    most = int(re.search(r"at most (\d+) keys", str(caught.value)).group(1))  # type: ignore[union-attr]
    assert 0 < most < 40
    assert generate(replace(spec, keys=most)).trace.name  # the figure given is one that works
    with pytest.raises(ValueError, match="unknown workload"):
        preset("nope")


def test_sampled_workloads_are_drawn_within_their_ranges_and_reach_their_statistics() -> None:
    specs = [sampled_spec(seed) for seed in range(10)]
    for spec in specs:
        for name, (lo, hi, how) in SAMPLED_RANGES.items():
            value = getattr(spec, name)
            if name == "keys":
                assert lo <= value <= hi * spec.qps * spec.duration_s + 0.5
            else:
                assert lo <= value <= hi, (name, how)
        st = generate(spec).stats()
        assert st.distinct_keys == spec.keys
        assert st.top_keys_request_share == pytest.approx(spec.top_key_request_share, abs=0.03)
        assert st.multi_turn_request_share == pytest.approx(spec.multi_turn_share, abs=0.1)
    # The draws differ from seed to seed in every parameter, not only in the requests.
    for name in SAMPLED_RANGES:
        assert len({getattr(s, name) for s in specs}) == len(specs), name
    assert len({s.shared_prefix_tokens for s in specs}) > 1


def test_a_sampled_workload_depends_on_its_seed_only() -> None:
    assert sampled_spec(3) == sampled_spec(3) == workload_spec("sampled", 3)
    assert sampled_spec(3) != sampled_spec(4)
    assert workload_spec("low-reuse", 5) == preset("low-reuse", seed=5)
    with pytest.raises(ValueError, match=r"unknown workload 'nope'; known: .*sampled"):
        workload_spec("nope", 0)
    with pytest.raises(ValueError, match="too few"):
        sampled_spec(0, qps=1.0, duration_s=60.0)
    with pytest.raises(ValueError, match="must not be negative"):
        sampled_spec(-1)


@pytest.mark.slow
def test_cacheroute_paper_preset_matches_the_report() -> None:
    from cacheroute.planner.replay.metrics import summarize
    from cacheroute.planner.replay.policies import RoundRobin
    from cacheroute.planner.replay.run import ReplayConfig, replay_trace

    w = generate(PRESETS["cacheroute-paper"])
    st = w.stats()
    print(st)
    assert st.distinct_keys == 128_824
    assert st.top_keys_request_share == pytest.approx(0.47, abs=0.01)
    assert st.multi_turn_request_share == pytest.approx(0.808, abs=0.01)
    assert 60 <= st.median_turn_gap_s <= 300
    # The report's operating point: Flat-LB serves 64.1 % from cache, and 30 destinations carry
    # the report's rates (p99 TTFT within the 3.5 s SLO at 150 QPS).
    tr = w.trace.window(0.0, 300.0)
    at_150 = tr.time_scaled(150.0 / (len(tr) / tr.duration_s))
    flat = summarize(replay_trace(at_150, RoundRobin(), ReplayConfig(destinations=30)))
    print(flat.kv_hit, flat.ttft_p99_s)
    assert flat.kv_hit == pytest.approx(0.641, abs=0.07)
    assert flat.ttft_p99_s < 3.5


@pytest.mark.slow
def test_low_reuse_preset_lets_affinity_lift_kv_hit_only_to_about_twelve_percent() -> None:
    from cacheroute.planner.replay.metrics import summarize
    from cacheroute.planner.replay.policies import PowerOfTwo, StickyHash
    from cacheroute.planner.replay.run import ReplayConfig, replay_trace

    w = generate(PRESETS["low-reuse"])
    tr = w.trace.window(0.0, 300.0)
    at_40 = tr.time_scaled(40.0 / (len(tr) / tr.duration_s))
    p2c = summarize(replay_trace(at_40, PowerOfTwo(), ReplayConfig(destinations=30)))
    sticky = summarize(replay_trace(at_40, StickyHash(), ReplayConfig(destinations=30)))
    print(w.stats(), p2c.kv_hit, sticky.kv_hit)
    assert p2c.kv_hit < 0.03
    assert sticky.kv_hit == pytest.approx(0.12, abs=0.025)
