"""The load generator's schedule, prompts, target check and summary."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cacheroute.planner.trace import NO_KEY, RequestTrace
from cacheroute.sandbox.emulator.tokens import block_ids, words
from cacheroute.sandbox.loadgen.client import LoadSettings, RequestResult, TargetError, check_target
from cacheroute.sandbox.loadgen.prompts import prompt_text
from cacheroute.sandbox.loadgen.report import summarize, write_results
from cacheroute.sandbox.loadgen.schedule import ScheduleError, build_schedule, load_trace

TRACES = Path("/work/shared/traces")


def tiny_trace() -> RequestTrace:
    return RequestTrace(
        arrival_s=np.array([10.0, 11.0, 12.0, 14.0]),
        key=np.array([0, 1, -1, 0]),
        input_tokens=np.array([1000, 1100, 300, 2000]),
        output_tokens=np.array([10, 20, 30, 4000]),
        block_offsets=np.array([0, 2, 5, 6, 10]),
        block_ids=np.array([1, 2, 1, 2, 3, 9, 1, 2, 4, 5]),
        block_size=512,
        key_names=("alice", "bob"),
    )


def test_schedules_scale_the_clock_and_respect_the_bounds() -> None:
    schedule = build_schedule(tiny_trace(), source="t", time_scale=2.0)
    assert [r.at_s for r in schedule.requests] == [0.0, 0.5, 1.0, 2.0]
    assert [r.key for r in schedule.requests] == ["alice", "bob", None, "alice"]
    by_qps = build_schedule(tiny_trace(), source="t", qps=3.0)
    assert by_qps.duration_s == pytest.approx(1.0)
    cut = build_schedule(tiny_trace(), source="t", duration_s=2.5, max_output_tokens=15)
    assert [r.index for r in cut.requests] == [0, 1, 2]
    assert [r.output_tokens for r in cut.requests] == [10, 15, 15]
    assert len(build_schedule(tiny_trace(), source="t", max_requests=2).requests) == 2
    assert [r.index for r in build_schedule(tiny_trace(), source="t", max_input_tokens=1500).requests] == [0, 1, 2]
    with pytest.raises(ScheduleError, match="at most one"):
        build_schedule(tiny_trace(), source="t", qps=1, time_scale=1)
    with pytest.raises(ScheduleError, match="no request"):
        build_schedule(tiny_trace(), source="t", duration_s=1e-6, max_input_tokens=1)


def test_prompts_share_text_exactly_as_far_as_they_share_blocks() -> None:
    tr = tiny_trace()
    first = words(prompt_text(tr.blocks(0).tolist(), 1000, 512, salt=0))
    second = words(prompt_text(tr.blocks(1).tolist(), 1100, 512, salt=1))
    assert len(first) == 1000 and len(second) == 1100
    # Blocks 1 and 2 are shared; block 2 is complete in the second prompt only.
    assert first == second[:1000]
    emulator_first, emulator_second = block_ids(first, 16), block_ids(second, 16)
    # The first prompt's 62 full blocks of 16 are all in the second prompt; its partial tail is private.
    assert emulator_first[:62] == emulator_second[:62]
    assert emulator_first[62] != emulator_second[62]
    # Fewer blocks than the input length: unique filler, different for every request.
    padded = words(prompt_text([7], 600, 512, salt=3))
    assert len(padded) == 600 and padded[512] != words(prompt_text([7], 600, 512, salt=4))[512]


def test_only_loopback_targets_are_accepted() -> None:
    assert check_target("http://127.1.0.4:8080")
    assert check_target("http://localhost:8000/v1/chat/completions")
    assert LoadSettings("http://127.0.0.1:8000", api="chat").endpoint() == "http://127.0.0.1:8000/v1/chat/completions"
    for url in ("http://10.0.0.1:80", "http://example.com", "ftp://127.0.0.1/x"):
        with pytest.raises(TargetError):
            check_target(url)


def test_summary_counts_failures_and_served_hit(tmp_path: Path) -> None:
    ok = [
        RequestResult(index=i, key=None, scheduled_s=i, sent_s=i, ttft_s=0.1 * (i + 1), e2e_s=1.0, status=200,
                      prompt_tokens=100, cached_tokens=50 * (i % 2))
        for i in range(4)
    ]
    failed = RequestResult(index=9, key=None, scheduled_s=0, sent_s=0.5, status=503, error="no endpoint")
    summary = summarize([*ok, failed])
    assert (summary.succeeded, summary.failed) == (4, 1)
    assert summary.errors == {"HTTP 503": 1}
    assert summary.served_kv_hit == pytest.approx(100 / 400)
    assert summary.ttft_p50_s == pytest.approx(0.25)
    assert summary.duration_s == pytest.approx(4.0)
    assert summary.max_send_lag_s == pytest.approx(0.5)
    write_results(tmp_path / "r.csv", [*ok, failed], summary, {})
    assert (tmp_path / "r.csv").read_text().splitlines()[0].startswith("index,key,scheduled_s")
    write_results(tmp_path / "r.json", [*ok, failed], summary, {"url": "x"})
    assert '"served_kv_hit": 0.25' in (tmp_path / "r.json").read_text()
    assert math.isnan(summarize([failed]).ttft_p50_s)


@pytest.mark.skipif(not (TRACES / "mooncake_arxiv_trace_first1000.jsonl").is_file(), reason="no shared traces")
def test_a_mooncake_trace_and_a_generated_workload_load() -> None:
    tr, source = load_trace(trace=TRACES / "mooncake_arxiv_trace_first1000.jsonl", workload=None)
    assert len(tr) == 1000 and source.startswith("trace")
    generated, _ = load_trace(trace=None, workload="low-reuse", qps=5.0, duration_s=20.0, keys=20)
    assert 40 < len(generated) < 200
    with pytest.raises(ScheduleError, match="exactly one"):
        load_trace(trace=None, workload=None)


def test_a_short_run_of_a_preset_gets_the_keys_it_can_cover_and_says_so() -> None:
    # cacheroute-paper has 128,824 keys; a minute at 5 requests/s is about 120 threads.
    trace, source = load_trace(trace=None, workload="cacheroute-paper", qps=5.0, duration_s=60.0)
    keys = {int(k) for k in trace.key if k != NO_KEY}
    assert 20 <= len(keys) <= 120
    assert f"with {len(keys):,} keys" in source and "--keys" in source
    # One key more than it chose cannot be covered: it took the most the run allows.
    with pytest.raises(ScheduleError):
        load_trace(trace=None, workload="cacheroute-paper", qps=5.0, duration_s=60.0, keys=len(keys) + 1)


def test_an_explicit_key_count_is_refused_not_changed_naming_the_options() -> None:
    with pytest.raises(ScheduleError) as exc:
        load_trace(trace=None, workload="cacheroute-paper", qps=8.0, duration_s=60.0, keys=1500)
    message = str(exc.value)
    assert message.startswith("--workload cacheroute-paper: ") and message.count("cacheroute-paper") == 1
    assert "cannot cover 1500 keys" in message
    with pytest.raises(ScheduleError, match="unknown workload 'nope'; known: "):
        load_trace(trace=None, workload="nope", qps=5.0, duration_s=60.0)
