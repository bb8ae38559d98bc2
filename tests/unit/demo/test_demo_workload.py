"""The demo's traffic and the replay's view of it, without servers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cacheroute.sandbox.demo.cluster import demo_manifests
from cacheroute.sandbox.demo.prediction import sent_trace
from cacheroute.sandbox.demo.settings import FULL, SHORT, DemoSettings
from cacheroute.sandbox.demo.workload import demo_workload

SMALL = replace(SHORT, lead_s=20.0, warmup_s=10.0, phase_s=15.0, workload=replace(SHORT.workload, keys=20))


def _blocks(schedule: object, i: int) -> list[int]:
    tr = schedule.trace  # type: ignore[attr-defined]
    return [int(b) for b in tr.blocks(i)]


def test_both_phases_send_the_same_requests_with_text_of_their_own() -> None:
    w = demo_workload(SMALL)
    first, second = w.rounds
    for a, b in ((first.warmup, second.warmup), (first.measured, second.measured)):
        assert [(r.at_s, r.key, r.input_tokens, r.output_tokens) for r in a.requests] == [
            (r.at_s, r.key, r.input_tokens, r.output_tokens) for r in b.requests]
    ids_a = {b for r in first.measured.requests for b in _blocks(first.measured, r.index)}
    ids_b = {b for r in second.measured.requests for b in _blocks(second.measured, r.index)}
    assert not ids_a & ids_b
    # The same sharing: two requests share a leading block in one sending iff they do in the other.
    rows = [r.index for r in first.measured.requests[:40]]
    same_a = {(i, j) for i in rows for j in rows if _blocks(first.measured, i)[0] == _blocks(first.measured, j)[0]}
    same_b = {(i, j) for i in rows for j in rows if _blocks(second.measured, i)[0] == _blocks(second.measured, j)[0]}
    assert same_a == same_b
    # Past the lead and within the phases' bounds.
    assert all(0 <= r.at_s < SMALL.warmup_s for r in first.warmup.requests)
    assert all(r.at_s >= 0 for r in first.measured.requests)


def test_the_replay_gets_every_request_sent_on_the_loops_clock() -> None:
    w = demo_workload(SMALL)
    first, second = w.rounds
    sends = [(first.warmup, 0.0), (first.measured, 12.0), (second.warmup, 40.0), (second.measured, 53.0)]
    trace, send = sent_trace(sends)
    assert len(trace.arrival_s) == sum(len(s.requests) for s, _ in sends)
    assert np.all(np.diff(trace.arrival_s) >= 0)
    for k, (schedule, offset) in enumerate(sends):
        rows = np.flatnonzero(send == k)
        assert sorted(trace.arrival_s[rows].tolist()) == sorted(r.at_s + offset for r in schedule.requests)
    # A request keeps its own blocks: the first measured request of the planned sending.
    r = second.measured.requests[0]
    at = r.at_s + 53.0
    [row] = [i for i in np.flatnonzero(send == 3)
             if trace.arrival_s[i] == at and trace.input_tokens[i] == r.input_tokens]
    assert [int(b) for b in trace.blocks(int(row))] == _blocks(second.measured, r.index)


def test_the_pool_applied_routes_with_or_without_prefix_following_as_the_settings_say() -> None:
    def following(settings: DemoSettings) -> bool:
        [pool] = [d for d in demo_manifests(settings) if d["kind"] == "InferencePool"]
        return bool(pool["spec"]["router"]["followPrefixes"])

    assert following(FULL) and not following(SHORT)


def test_the_short_variant_applies_its_plan_without_the_guard_and_make_demo_with_it() -> None:
    def guarded(settings: DemoSettings) -> bool:
        [plan] = [d for d in demo_manifests(settings) if d["kind"] == "AffinityPlan"]
        return bool(plan["spec"]["guard"]["enabled"])

    assert guarded(FULL) and not guarded(SHORT)
