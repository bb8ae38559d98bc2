"""What the demo prints and writes: the two phases side by side, the status tables, the
replay's prediction against the loop, and `loop.json` with every figure."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from cacheroute.operator.files import write_with
from cacheroute.sandbox.demo.cluster import condition
from cacheroute.sandbox.demo.phases import PhaseResult
from cacheroute.sandbox.demo.run import DemoRun

# docs/demo.md: the loop and the replay agree when their served KV hit is this close.
AGREEMENT_PP = 5.0


@dataclass(frozen=True)
class Verdict:
    kv_hit_gain_pp: float  # planned - p2c, percentage points
    p99_ttft_ratio: float  # planned / p2c
    loop_vs_replay_pp: float  # planned phase: loop - replay, percentage points

    @property
    def planned_wins(self) -> bool:
        return self.kv_hit_gain_pp > 0 and self.p99_ttft_ratio < 1

    @property
    def replay_agrees(self) -> bool:
        return abs(self.loop_vs_replay_pp) <= AGREEMENT_PP


def verdict(run: DemoRun) -> Verdict:
    p2c, planned = run.phases
    predicted = run.prediction[1].served_kv_hit if run.prediction else math.nan
    return Verdict(
        kv_hit_gain_pp=100 * (planned.counters.served_kv_hit - p2c.counters.served_kv_hit),
        p99_ttft_ratio=planned.summary.ttft_p99_s / p2c.summary.ttft_p99_s,
        loop_vs_replay_pp=100 * (planned.counters.served_kv_hit - predicted),
    )


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:,.0f} ms"


def _pct(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.1f} %"


def _decisions(phase: PhaseResult) -> str:
    d = phase.counters.decisions
    total = sum(d.values())
    if not total:
        return "-"
    return " / ".join(f"{100 * d.get(o, 0.0) / total:.0f}" for o in ("planned", "spilled", "p2c", "followed", "scored"))


def phase_table(run: DemoRun) -> Table:
    p2c, planned = run.phases
    table = Table("", "no plan (Shadow)", second_phase_title(run), title="the loop, client and Prometheus figures")
    rows: list[tuple[str, ...]] = [
        ("requests sent / ok", *(f"{p.summary.requests} / {p.summary.succeeded}" for p in (p2c, planned))),
        ("served KV hit (vLLM counters, Prometheus)", *(_pct(p.counters.served_kv_hit) for p in (p2c, planned))),
        ("served KV hit (client: cached / prompt tokens)", *(_pct(p.summary.served_kv_hit) for p in (p2c, planned))),
        ("TTFT p50 (client)", *(_ms(p.summary.ttft_p50_s) for p in (p2c, planned))),
        ("TTFT p99 (client)", *(_ms(p.summary.ttft_p99_s) for p in (p2c, planned))),
        ("end-to-end p99 (client)", *(_ms(p.summary.e2e_p99_s) for p in (p2c, planned))),
        ("throughput", *(f"{p.summary.throughput_rps:.2f} req/s" for p in (p2c, planned))),
        ("router decisions planned / spilled / p2c / followed / scored (%)", *(_decisions(p) for p in (p2c, planned))),
    ]
    if run.prediction is not None:
        rows += [
            ("replay: served KV hit", *(_pct(p.served_kv_hit) for p in run.prediction)),
            ("replay: TTFT p50 / p99", *(f"{_ms(p.ttft_p50_s)} / {_ms(p.ttft_p99_s)}" for p in run.prediction)),
        ]
    for row in rows:
        table.add_row(*row)
    return table


def second_phase_title(run: DemoRun) -> str:
    return "Auto, the guard kept no plan" if run.guard_rejected else "planned (Auto)"


def destinations_table(run: DemoRun) -> Table:
    second = "Auto, no plan" if run.guard_rejected else "planned"
    table = Table("destination", "p2c", second, "replay p2c", f"replay {second}",
                  title="requests per destination (vLLM's request counters)")
    pods = sorted(set(run.destination_ids) | {p for ph in run.phases for p in ph.counters.requests_by_pod},
                  key=lambda p: (len(p), p))
    for pod in pods:
        cells = [f"{ph.counters.requests_by_pod.get(pod, 0.0):.0f}" for ph in run.phases]
        cells += [str(p.requests_by_destination.get(pod, 0)) for p in run.prediction or ()]
        table.add_row(pod, *cells)
    return table


def kubectl_table(title: str, rows: list[list[str]]) -> Table:
    table = Table(*rows[0], title=title, title_justify="left", box=None, pad_edge=False) if rows else Table()
    for row in rows[1:]:
        table.add_row(*row)
    return table


def verdict_lines(run: DemoRun) -> list[str]:
    v = verdict(run)
    if run.guard_rejected:
        # Both phases ran without a plan: what they differ by is the traffic's text, not routing.
        lines = [
            f"no plan applied: the operator's guard rejected the candidate "
            f"({condition(run.plan_object, 'Applied').get('message')}); the second phase ran without a plan: "
            f"served KV hit {v.kv_hit_gain_pp:+.1f} pp, p99 TTFT x{v.p99_ttft_ratio:.2f} against the first",
        ]
    else:
        lines = [
            f"planned vs no plan: served KV hit {v.kv_hit_gain_pp:+.1f} pp, p99 TTFT x{v.p99_ttft_ratio:.2f} "
            f"({'planned wins on both' if v.planned_wins else 'planned does NOT win on both'})",
        ]
    if run.prediction is not None:
        phase = "second" if run.guard_rejected else "planned"
        lines.append(
            f"loop vs replay, {phase} phase: served KV hit {100 * run.phases[1].counters.served_kv_hit:.1f} % vs "
            f"{100 * run.prediction[1].served_kv_hit:.1f} % ({v.loop_vs_replay_pp:+.1f} pp; "
            f"{'within' if v.replay_agrees else 'OUTSIDE'} {AGREEMENT_PP:.0f} pp)"
        )
    return lines


def render(run: DemoRun) -> Group:
    parts: list[Any] = [phase_table(run), destinations_table(run)]
    parts += [kubectl_table(f"kubectl get {plural} -n {run.settings.namespace}", rows)
              for plural, rows in run.tables.items()]
    parts += ["", *verdict_lines(run)]
    return Group(*parts)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def document(run: DemoRun) -> dict[str, Any]:
    v = verdict(run)
    payload: dict[str, Any] = _clean({
        "settings": asdict(run.settings),
        "workload": run.workload.spec.to_dict(),
        "kv_capacity_tokens": run.kv_capacity_tokens,
        "phases": {
            p.name: {
                "client": p.summary.to_dict(),
                "served_kv_hit": p.counters.served_kv_hit,
                "prefix_cache_hit_tokens": p.counters.hit_tokens,
                "prefix_cache_query_tokens": p.counters.query_tokens,
                "requests_by_destination": p.counters.requests_by_pod,
                "router_decisions": p.counters.decisions,
            }
            for p in run.phases
        },
        "plan": {"version": run.plan_object.get("status", {}).get("planVersion"),
                 "status": run.plan_object.get("status"), "routes": len(run.plan) if run.plan else 0},
        "replay": {name: asdict(p) for name, p in zip(("p2c", "planned"), run.prediction or (), strict=False)},
        "warmups": {w.name: {"client": w.summary.to_dict(), "served_kv_hit": w.counters.served_kv_hit}
                    for w in run.warmups},
        "send_offsets_s": run.offsets_s,
        "verdict": {**asdict(v), "planned_wins": v.planned_wins and not run.guard_rejected,
                    "guard_rejected": run.guard_rejected, "replay_agrees": v.replay_agrees},
        "steps_s": run.steps_s,
        "kubectl": run.tables,
    })
    return payload


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=1, default=str) + "\n"
    write_with(path, lambda staged: staged.write_text(text, encoding="utf-8"))
