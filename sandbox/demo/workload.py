"""The traffic of both phases: one generated workload, cut in two at the phase length.

Both phases are one continuing workload (the same keys, skew and conversations; a conversation
may span both), so the planned phase runs on the traffic the plan was learned from, as it would
in production, and never replays requests whose prefixes the first phase already cached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cacheroute.planner.trace import RequestTrace
from cacheroute.planner.workloads import WorkloadSpec, generate, preset
from cacheroute.sandbox.demo.settings import DemoSettings
from cacheroute.sandbox.loadgen.schedule import Schedule, build_schedule

PRESET = "cacheroute-paper"


@dataclass(frozen=True)
class DemoWorkload:
    spec: WorkloadSpec
    trace: RequestTrace
    phases: tuple[Schedule, Schedule]
    cut_s: float  # where the second phase starts, in seconds after the trace's first request

    @property
    def requests(self) -> int:
        return sum(len(p.requests) for p in self.phases)


def workload_spec(settings: DemoSettings) -> WorkloadSpec:
    w = settings.workload
    return preset(
        PRESET,
        keys=w.keys,
        qps=w.qps,
        duration_s=2 * settings.phase_s,
        turn_gap_median_s=w.turn_gap_median_s,
        prefix_median_tokens=w.prefix_median_tokens,
        max_prompt_tokens=w.max_prompt_tokens,
        seed=w.seed,
    )


def demo_workload(settings: DemoSettings) -> DemoWorkload:
    """The generated trace and its two schedules, each starting at 0 s."""
    spec = workload_spec(settings)
    trace = generate(spec).trace
    whole = build_schedule(trace, source=f"workload {PRESET} ({spec.keys} keys)")
    cut = settings.phase_s
    first = tuple(r for r in whole.requests if r.at_s < cut)
    second = tuple(replace(r, at_s=r.at_s - cut) for r in whole.requests if r.at_s >= cut)
    if not first or not second:
        raise ValueError(f"the workload leaves a phase without requests ({len(first)} and {len(second)})")
    return DemoWorkload(
        spec=spec,
        trace=trace,
        phases=(replace(whole, requests=first), replace(whole, requests=second)),
        cut_s=cut,
    )
