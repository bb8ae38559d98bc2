"""The traffic: one slice of a generated workload, sent twice, once per routing mode.

A slice is a warm-up (sent, not measured: it fills the caches) followed by the measured phase.
The p2c phase sends the slice; the planned phase sends the same slice again, the same arrivals,
keys, prompt lengths and prefix structure, so that the two phases differ only in routing. The
second time, every prefix block gets other text (its block ids shifted out of the first range):
otherwise the planned phase would find in the caches the very prompts the p2c phase left there.
The keys stay the same, which is what the plan, learned from the first phase, is about.

The generator's ramp (at its start only first turns of conversations arrive) is not sent: the
slice starts `lead_s` into the generated workload, where the request rate has settled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cacheroute.planner.trace import RequestTrace
from cacheroute.planner.workloads import WorkloadSpec, generate, preset
from cacheroute.sandbox.demo.settings import DemoSettings
from cacheroute.sandbox.loadgen.schedule import Schedule, build_schedule

PRESET = "cacheroute-paper"
# Added to every block id of the second sending: far above the generator's ids, inside 63 bits.
SECOND_TEXT_OFFSET = 1 << 40


@dataclass(frozen=True)
class Round:
    """One sending of the slice: the warm-up, then the measured phase (each from 0 s)."""

    warmup: Schedule
    measured: Schedule


@dataclass(frozen=True)
class DemoWorkload:
    spec: WorkloadSpec
    rounds: tuple[Round, Round]  # p2c, planned
    # Where the warm-up and the measured phase start, in seconds after the slice's first request.
    warmup_s: float

    @property
    def requests(self) -> int:
        return sum(len(r.warmup.requests) + len(r.measured.requests) for r in self.rounds)


def workload_spec(settings: DemoSettings) -> WorkloadSpec:
    w = settings.workload
    return preset(
        PRESET,
        keys=w.keys,
        qps=w.qps,
        duration_s=settings.lead_s + settings.warmup_s + settings.phase_s,
        turn_gap_median_s=w.turn_gap_median_s,
        prefix_median_tokens=w.prefix_median_tokens,
        max_prompt_tokens=w.max_prompt_tokens,
        output_max_tokens=w.max_output_tokens,
        seed=w.seed,
    )


def other_text(trace: RequestTrace) -> RequestTrace:
    """The same requests with every block id shifted: the same sharing, none with `trace`."""
    return replace(trace, block_ids=trace.block_ids + np.int64(SECOND_TEXT_OFFSET), name=f"{trace.name}-second")


def demo_workload(settings: DemoSettings) -> DemoWorkload:
    """The slice, cut into warm-up and measured phase, for both sendings."""
    spec = workload_spec(settings)
    trace = generate(spec).trace
    whole = build_schedule(trace, source=f"workload {PRESET} ({spec.keys} keys)")
    lead, warm = settings.lead_s, settings.warmup_s
    warmup = tuple(replace(r, at_s=r.at_s - lead) for r in whole.requests if lead <= r.at_s < lead + warm)
    measured = tuple(replace(r, at_s=r.at_s - lead - warm) for r in whole.requests if r.at_s >= lead + warm)
    if not measured:
        raise ValueError("the workload leaves the measured phase without requests")
    first = Round(replace(whole, requests=warmup), replace(whole, requests=measured))
    shifted = other_text(trace)
    second = Round(replace(first.warmup, trace=shifted), replace(first.measured, trace=shifted))
    return DemoWorkload(spec=spec, rounds=(first, second), warmup_s=warm)
