"""What a demo run does: the fleet, the workload, the phases; a full run and a short one."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "examples" / "demo"
CHART = REPO / "helm" / "cacheroute"
SANDBOX_VALUES = CHART / "ci" / "sandbox-values.yaml"


@dataclass(frozen=True)
class WorkloadSettings:
    """The `cacheroute-paper` preset scaled to a small fleet and a few minutes (docs/demo.md).

    `keys`, `qps` and the phase length replace the report's 128,824 keys, 176 QPS and hours;
    `turn_gap_median_s` compresses the minutes between turns of a conversation by the same order
    as the run is shorter; `prefix_median_tokens` is a business key's own context (documents,
    tool schemas) after the product's 1,536-token shared prompt.
    """

    keys: int = 360
    qps: float = 14.0
    turn_gap_median_s: float = 30.0
    prefix_median_tokens: float = 4000.0
    max_prompt_tokens: int = 28_000
    # Answers of at most 512 tokens (the preset allows 2,048): one long answer would hold a
    # phase open for half a minute of decode after its last request left.
    max_output_tokens: int = 512
    seed: int = 0


@dataclass(frozen=True)
class DemoSettings:
    destinations: int = 8
    # The slice of the workload both phases send (sandbox/demo/workload.py): it starts `lead_s`
    # into the generated workload (past its ramp), then `warmup_s` of unmeasured traffic fills
    # the caches, then `phase_s` are measured.
    lead_s: float = 180.0
    warmup_s: float = 60.0
    phase_s: float = 120.0
    workload: WorkloadSettings = WorkloadSettings()
    namespace: str = "demo"
    release: str = "cacheroute"
    pool: str = "demo"
    plan: str = "demo"
    nodes: int = 3
    # The router's prefix following (InferencePool `spec.router.followPrefixes`), in both phases.
    follow_prefixes: bool = True
    # The AffinityPlan's shadow-replay guard (`spec.guard.enabled`).
    guard: bool = True
    # Longest wait for one step of the set-up (helm, pods ready, a plan published).
    step_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.destinations < 2:
            raise ValueError(f"destinations must be at least 2, got {self.destinations}")
        if not self.phase_s >= 10:
            raise ValueError(f"phase_s must be at least 10 seconds, got {self.phase_s}")
        if not (self.warmup_s >= 0 and self.lead_s >= 0):
            raise ValueError("lead_s and warmup_s must not be negative")
        # Four TP-2 replicas per 8-GPU node; the operator and the router tolerate the GPU taint too.
        if self.nodes * 4 < self.destinations:
            raise ValueError(f"{self.nodes} nodes hold at most {self.nodes * 4} TP-2 replicas")


FULL = DemoSettings()
# The integration test's variant: 4 destinations, 30 s measured per phase (a minute in all).
# Without prefix following: in one minute of traffic the router's following alone already serves
# nearly every repeated prefix (no plan 87.8 %, planned 87.1 % in one CI run, the order changing
# between runs), so the check that the loop plans, applies and gains compares the plan with
# key-seeded p2c alone, which it beats by a margin a minute can show. `make demo` runs the default.
# Without the guard: on four destinations its replay puts the plan's p99 TTFT within a few percent
# of the fallback's (2.30 against 2.27 s, 1.98 against 2.24 s in two runs), so its verdict is a
# draw of the synthesised window (on 120 windows of six workload seeds it passed 82 % of them
# with one replay, 97 % with the lengthened window and the median of three). This variant checks
# that the loop carries a plan from the metrics to the router; the guard has integration tests of
# its own (tests/integration/control/test_control_guard.py) and runs in `make demo`.
SHORT = replace(
    FULL,
    destinations=4,
    lead_s=60.0,
    warmup_s=20.0,
    phase_s=30.0,
    nodes=1,
    follow_prefixes=False,
    guard=False,
    workload=replace(FULL.workload, keys=60, qps=6.0, turn_gap_median_s=8.0),
)
