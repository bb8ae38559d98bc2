"""Figures of the capacity bench, drawn from its JSON report (`bench_capacity.py` writes them next
to it after every section; this module redraws them from any report).

Run: `.venv/bin/python -m tests.bench.capacity_plots [bench-results/capacity.json] [--out-dir DIR]`

- `<report>.png` (`capacity.png` for the default report): capacity per policy on
  `cacheroute-paper` with the 1.3x target; where the gain comes from (each component alone and
  together); the whole product against vLLM's defaults with the 2.3x target and the ceiling of any
  router; CacheRoute over the best per-request router on every other workload, with and without
  its guard.
- `<report>_probes.png`: p99 TTFT at every rate the bisection tried on `cacheroute-paper`, per
  policy, against the SLO: where each policy's capacity sits on its latency curve.

Only the sections a report holds are drawn (`--only` runs hold some).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheroute.operator.files import OutputPathError, check_output_dir, write_with
from tests.bench.bench_capacity import PER_REQUEST, best_of
from tests.bench.bench_capacity import SLO as PAPER_SLO

REPORT = Path("bench-results") / "capacity.json"
OURS = "tab:blue"
BASELINE = "0.6"
HOST_TIER = "tab:cyan"


class ReportError(ValueError):
    """A report that cannot be drawn; the message says why."""


def load_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path}: no such report (run tests.bench.bench_capacity first)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: not a JSON report ({exc})") from None
    if not isinstance(report, dict) or report.get("bench") != "capacity":
        raise ReportError(f"{path}: not a capacity bench report (no \"bench\": \"capacity\")")
    return report


def is_ours(label: str) -> bool:
    return "cacheroute" in label.lower()


def best_per_request(policies: dict[str, Any]) -> tuple[str, float] | None:
    """The bench's best per-request router among those the section ran, and its capacity."""
    ran = [label for label in PER_REQUEST if label in policies]
    if not ran:
        return None
    best = best_of(policies, ran)
    return best, float(policies[best]["capacity_qps"])


def workload_ratios(report: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    """(workload, CacheRoute / best per-request router, the same with its guard) for every workload
    other than `cacheroute-paper`, in the report's order."""
    sections: list[tuple[str, dict[str, Any]]] = []
    for name, section in report.get("traces", {}).items():
        # mooncake_arxiv_trace_first1000.jsonl -> arxiv
        sections.append((name.removeprefix("mooncake_").split("_")[0].removesuffix(".jsonl"), section))
    if "low_reuse" in report:
        sections.append(("low-reuse", report["low_reuse"]))
    sections.extend(report.get("heldout", {}).items())
    out: list[tuple[str, float, float | None]] = []
    for name, section in sections:
        policies = section["policies"]
        best = best_per_request(policies)
        if best is None or best[1] <= 0 or "cacheroute" not in policies:
            continue
        guarded = policies.get("cacheroute-guard")
        out.append((name, float(policies["cacheroute"]["capacity_qps"]) / best[1],
                    float(guarded["capacity_qps"]) / best[1] if guarded else None))
    return out


def _bars(ax: Any, rows: dict[str, Any], colors: Sequence[str] | None = None,
          notes: Sequence[str] | None = None) -> None:
    """One bar per policy row, its capacity and KV hit written beside it (`notes` instead where
    given); CacheRoute's in blue, the others grey, unless `colors` says otherwise."""
    labels = list(rows)
    values = [rows[n]["capacity_qps"] for n in labels]
    colors = colors or [OURS if is_ours(n) else BASELINE for n in labels]
    notes = notes or [_hit(rows[n]) for n in labels]
    y = range(len(labels))
    ax.barh(list(y), values, color=list(colors))
    ax.set_yticks(list(y), list(labels))
    ax.invert_yaxis()
    top = max(values) if values else 1.0
    for i, (v, note) in enumerate(zip(values, notes, strict=True)):
        # On a white ground: a target or ceiling line through the figures leaves them readable.
        ax.text(v + top * 0.01, i, note, va="center", fontsize=7, zorder=3,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    ax.set_xlim(0, (top or 1.0) * 1.45)
    ax.set_xlabel("capacity (QPS at p99 TTFT within the SLO)")
    ax.grid(axis="x", alpha=0.3)


def _legend_below(ax: Any) -> None:
    # Below the axes, one entry a line: every bar's figures stay readable, no entry is cut off.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, fontsize=7, frameon=False)


def _times(ratio: object, digits: int = 3) -> str:
    """A ratio as `1.026x`; `n/a` where the report has none (a baseline of 0 QPS gives no ratio)."""
    return f"{ratio:.{digits}f}x" if isinstance(ratio, int | float) and math.isfinite(ratio) else "n/a"


def _hit(row: dict[str, Any]) -> str:
    hit = row.get("kv_hit")
    return f"{row['capacity_qps']:.1f}  KV {hit:.0%}" if isinstance(hit, float) else f"{row['capacity_qps']:.1f}"


def draw_paper(ax: Any, paper: dict[str, Any]) -> None:
    rows = paper["policies"]
    _bars(ax, rows)
    chk = paper.get("check", {})
    base = chk.get("baseline")
    if base in rows and "target" in chk:
        goal = chk["target"] * rows[base]["capacity_qps"]
        ax.axvline(goal, color="tab:red", ls="--", lw=1, label=f"target {chk['target']}x {base}")
        _legend_below(ax)
    ax.set_title(f"cacheroute-paper, one engine: CacheRoute {_times(chk.get('value'))} the best "
                 "per-request router", fontsize=9)


def draw_ablation(ax: Any, ablation: dict[str, Any]) -> None:
    rows = ablation["policies"]
    host = ablation.get("engines", {}).get("host")
    labels = list(rows)
    colors = []
    for n in labels:
        tiered = rows[n]["engine"] == host
        colors.append((HOST_TIER if tiered else OURS) if rows[n]["policy"].startswith("cacheroute") else BASELINE)
    ratios = ablation.get("ratio_vs_neither", {})
    _bars(ax, rows, colors, [f"{_hit(rows[n])}  {_times(ratios.get(n), 2)}" for n in labels])
    ax.set_title("where the gain comes from (cyan: with the host-memory KV tier)", fontsize=9)


def draw_product(ax: Any, product: dict[str, Any]) -> None:
    rows = product["policies"]
    default = next((n for n in rows if rows[n]["engine"] == "vllm-default"), None)
    _bars(ax, rows)
    chk = product.get("check", {})
    if default is not None and "target" in chk:
        ax.axvline(chk["target"] * rows[default]["capacity_qps"], color="tab:red", ls="--", lw=1,
                   label=f"target {chk['target']}x vLLM defaults + p2c")
    ceiling = product.get("ideal_cache_ceiling")
    if ceiling:
        ax.axvline(ceiling["capacity_qps"], color="black", ls=":", lw=1,
                   label=f"any router, one ideal cache: {_times(ceiling.get('ratio'))}")
    if ax.get_legend_handles_labels()[0]:
        _legend_below(ax)
    ax.set_title(f"the whole product against vLLM's defaults: {_times(chk.get('value'))}", fontsize=9)


def draw_ratios(ax: Any, ratios: list[tuple[str, float, float | None]]) -> None:
    x = list(range(len(ratios)))
    ax.axhline(1.0, color="tab:red", ls="--", lw=1, label="the best per-request router")
    ax.plot(x, [r for _n, r, _g in ratios], "o", color=OURS, mfc="none", label="CacheRoute")
    guarded = [(i, g) for i, (_n, _r, g) in enumerate(ratios) if g is not None]
    if guarded:
        ax.plot([i for i, _g in guarded], [g for _i, g in guarded], "s", color=OURS, ms=4, label="CacheRoute, guarded")
    ax.set_xticks(x, [n for n, _r, _g in ratios], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("capacity / best per-request router")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("every other workload (public traces, low-reuse, held-out draws)", fontsize=9)


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display here), imported when first drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def summary_figure(report: dict[str, Any]) -> Any | None:
    """The summary figure, one panel per section the report holds; None when it holds none."""
    plt = _pyplot()
    panels: list[tuple[Any, Any]] = []
    for key, draw in (("paper", draw_paper), ("ablation", draw_ablation), ("product", draw_product)):
        if key in report:
            panels.append((draw, report[key]))
    ratios = workload_ratios(report)
    if ratios:
        panels.append((draw_ratios, ratios))
    if not panels:
        return None
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (draw, data) in zip(flat, panels, strict=False):
        draw(ax, data)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    step = report.get("rel_tol")
    fig.suptitle(f"capacity bench{' (first 15 minutes)' if report.get('quick') else ''}"
                 + (f", bisection step {step * 100:g} %" if isinstance(step, float) else "")
                 + f", started {report.get('started', '?')}", fontsize=10)
    fig.tight_layout()
    return fig


def probes_figure(paper: dict[str, Any]) -> Any:
    """p99 TTFT at each rate the capacity search tried, per policy, on `cacheroute-paper`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    cmap = plt.get_cmap("tab10")
    overloaded: list[tuple[float, Any]] = []
    for i, (label, row) in enumerate(paper["policies"].items()):
        color = cmap(i % 10)
        points = sorted((q, p99) for q, p99, _ok in row["probes"] if p99 is not None and math.isfinite(p99))
        # A probe without a p99 was stopped early: requests piled up without bound.
        overloaded.extend((q, color) for q, p99, _ok in row["probes"] if p99 is None or not math.isfinite(p99))
        if not points:
            continue
        ax.plot([q for q, _p in points], [p for _q, p in points], "-o", ms=3, lw=1.2 if is_ours(label) else 0.8,
                color=color, label=f"{label}: {row['capacity_qps']:.1f} QPS")
        ax.axvline(row["capacity_qps"], color=color, lw=0.5, alpha=0.5)
    # Reports written before the section recorded its SLO ran under the bench's fixed one.
    slo = paper.get("slo_p99_ttft_s", PAPER_SLO)
    if isinstance(slo, int | float):
        ax.axhline(slo, color="tab:red", ls="--", lw=1, label=f"SLO p99 TTFT {slo:g} s")
    ax.set_yscale("log")
    # From the lowest rate tried to a little past the highest capacity: the probes that decided
    # each capacity, not the first coarse doublings far beyond it.
    rates = [q for row in paper["policies"].values() for q, _p, _ok in row["probes"]]
    if rates:
        top = max(row["capacity_qps"] for row in paper["policies"].values())
        ax.set_xlim(min(rates) * 0.98, max(top, min(rates)) * 1.08)
    if overloaded:
        lo, hi = ax.get_xlim()
        # Drawn along the top edge: their p99 is beyond any finite scale.
        shown = [(q, c) for q, c in overloaded if lo <= q <= hi]
        ax.scatter([q for q, _c in shown], [0.97] * len(shown), c=[c for _q, c in shown], marker="x", s=18,
                   transform=ax.get_xaxis_transform(), label="overloaded (replay stopped early)")
    ax.set_xlabel("offered rate (QPS)")
    ax.set_ylabel("p99 TTFT (s)")
    ax.set_title("cacheroute-paper: p99 TTFT at every rate the capacity search tried")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _save(fig: Any, path: Path) -> None:
    try:
        write_with(path, lambda staged: fig.savefig(staged, dpi=110, format="png"))
    finally:
        _pyplot().close(fig)


def write_figures(report: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Draw what the report holds into `out_dir` as `<stem>.png` and `<stem>_probes.png`; the
    paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, probes = out_dir / f"{stem}.png", out_dir / f"{stem}_probes.png"
    # A figure this report does not hold must not stay from an earlier report of the same name.
    for path in (summary, probes):
        path.unlink(missing_ok=True)
    written: list[Path] = []
    fig = summary_figure(report)
    if fig is not None:
        _save(fig, summary)
        written.append(summary)
    if "paper" in report:
        _save(probes_figure(report["paper"]), probes)
        written.append(probes)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", nargs="?", type=Path, default=REPORT, help=f"the bench's JSON report (default {REPORT})")
    ap.add_argument("--out-dir", type=Path, help="where the figures go (default: the report's folder)")
    args = ap.parse_args(argv)
    out_dir = args.out_dir or args.report.parent
    try:
        check_output_dir(out_dir, "--out-dir")
        report = load_report(args.report)
        written = write_figures(report, out_dir, args.report.stem)
    except (ReportError, OutputPathError, KeyError, TypeError) as exc:
        problem = f"{args.report}: a section lacks {exc}" if isinstance(exc, KeyError | TypeError) else exc
        print(f"capacity_plots: {problem}", file=sys.stderr)
        return 2
    if not written:
        print(f"capacity_plots: {args.report} holds no section to draw", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
