"""The demo's figures (PNG, in the output folder): TTFT distributions, served KV hit of the loop
against the replay, and requests per destination, each phase side by side."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from cacheroute.operator.files import write_with
from cacheroute.sandbox.demo.run import DemoRun

COLORS = {"p2c": "tab:orange", "planned": "tab:blue"}


def _save(fig: Any, path: Path) -> None:
    write_with(path, lambda staged: fig.savefig(staged, dpi=110, format="png"))


def write_plots(run: DemoRun, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for phase in run.phases:
        ttft = np.sort([r.ttft_s for r in phase.results if r.ok and not math.isnan(r.ttft_s)])
        if len(ttft):
            ax.plot(ttft * 1000, np.arange(1, len(ttft) + 1) / len(ttft), color=COLORS[phase.name],
                    label=f"{phase.name}: p99 {phase.summary.ttft_p99_s * 1000:,.0f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token, client side (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT distribution per phase")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(out / "loop_ttft_cdf.png")
    _save(fig, written[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    names = [p.name for p in run.phases]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [100 * p.counters.served_kv_hit for p in run.phases], 0.4, label="loop (vLLM counters)",
           color=[COLORS[n] for n in names])
    if run.prediction is not None:
        ax.bar(x + 0.2, [100 * p.served_kv_hit for p in run.prediction], 0.4, label="shadow replay",
               color="lightgrey", edgecolor="black")
    ax.set_xticks(x, names)
    ax.set_ylabel("served KV hit (%)")
    ax.set_title("served token-weighted KV hit: loop and replay")
    ax.legend()
    fig.tight_layout()
    written.append(out / "loop_kv_hit.png")
    _save(fig, written[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    pods = list(run.destination_ids)
    x = np.arange(len(pods))
    for i, phase in enumerate(run.phases):
        ax.bar(x + (i - 0.5) * 0.4, [phase.counters.requests_by_pod.get(p, 0.0) for p in pods], 0.4,
               label=phase.name, color=COLORS[phase.name])
    ax.set_xticks(x, pods, rotation=30)
    ax.set_ylabel("requests")
    ax.set_title("requests per destination")
    ax.legend()
    fig.tight_layout()
    written.append(out / "loop_requests_per_destination.png")
    _save(fig, written[-1])
    plt.close(fig)
    return written
