"""`cacheroute replay`: shadow-replay a workload through routing policies and compare them."""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cacheroute.operator.cli.errors import fail
from cacheroute.operator.files import OutputPathError, check_output_dir, write_atomically
from cacheroute.planner.mooncake import TraceFormatError, infer_threads, parse_key_spec, read_mooncake
from cacheroute.planner.replay.capacity import DEFAULT_SLO_P99_TTFT_S, CapacityResult, Probe, base_qps, find_capacity
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE, PROFILES, get_profile
from cacheroute.planner.replay.metrics import ReplayMetrics, summarize
from cacheroute.planner.replay.planned import DEFAULT_CONTROL_PERIOD_S, DEFAULT_WINDOW_S, PlannerSettings
from cacheroute.planner.replay.registry import POLICIES, make_policy, policy_names
from cacheroute.planner.replay.run import ReplayConfig, check_fits, replay_trace
from cacheroute.planner.trace import RequestTrace
from cacheroute.planner.tracestats import TraceStats, trace_stats
from cacheroute.planner.workloads import PRESETS, SAMPLED, generate, workload_spec

REPLAY_HELP = f"""Shadow-replay a workload through routing policies on a modelled vLLM fleet.

Input is a generated workload (--workload: {", ".join(PRESETS)}, or {SAMPLED}: every parameter
drawn from --seed, a workload nobody chose) or a Mooncake trace (--trace,
keys derived by --key: first-blocks:K, thread or none). Each policy is replayed at the rates of
--qps (comma-separated; the trace's own rate when omitted), or its capacity is searched with
--capacity: the highest rate whose p99 TTFT stays within --slo-p99-ttft.

Policies: {", ".join(POLICIES)}.

With --out DIR the command writes replay.json (settings, workload statistics, per-policy figures)
and two plots: ttft_p99_vs_qps.png and kv_hit.png.
"""

# Limits of the numeric options: a fleet the size a pool may be, rates and times a replay can run.
MAX_DESTINATIONS = 1024
MAX_QPS = 1e6
MAX_SECONDS = 1e9


class ReplayInputError(ValueError):
    """Command-line input that cannot be used; printed without a traceback."""


def parse_qps_list(text: str) -> list[float]:
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ReplayInputError("--qps is empty")
    if not all(parts):
        # `1,,2` is a rate left out by mistake more often than a list written loosely.
        raise ReplayInputError(f"--qps {text!r} has an empty item (two commas in a row, or one at an end)")
    out: list[float] = []
    for part in parts:
        try:
            q = float(part)
        except ValueError:
            raise ReplayInputError(f"--qps must be numbers separated by commas, got {part!r}") from None
        if not math.isfinite(q):
            raise ReplayInputError(f"--qps: {part} is not a finite number")
        if not 0 < q <= MAX_QPS:
            raise ReplayInputError(f"--qps values must be positive and at most {MAX_QPS:g}, got {part!r}")
        out.append(q)
    return out


def load_workload(workload: str | None, trace: Path | None, key: str, seed: int,
                  duration: float | None) -> tuple[RequestTrace, TraceStats, dict[str, Any]]:
    """The trace to replay, its statistics and a description (the CLI's only file input)."""
    if (workload is None) == (trace is None):
        raise ReplayInputError("give exactly one of --workload and --trace")
    if duration is not None and not duration > 0:
        raise ReplayInputError(f"--duration must be positive, got {duration}")
    parse_key_spec(key)
    if workload is not None:
        try:
            spec = workload_spec(workload, seed)
        except ValueError as exc:
            raise ReplayInputError(str(exc)) from None
        w = generate(spec)
        tr, thread = w.trace, w.thread
        info: dict[str, Any] = {"workload": spec.to_dict()}
    else:
        assert trace is not None
        try:
            tr = read_mooncake(trace, key=key)
        except OSError as exc:
            raise ReplayInputError(f"cannot read --trace {trace}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ReplayInputError(f"--trace {trace}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        thread = infer_threads(tr)
        info = {"trace": str(trace), "key": key}
    if duration is not None:
        start = float(tr.arrival_s[0])
        n_before = len(tr)
        keep = int(np.searchsorted(tr.arrival_s, start + duration, side="left"))
        tr = tr.window(start, start + duration)
        thread = thread[:keep]
        info["window_s"] = duration
        info["requests_before_window"] = n_before
    if len(tr) < 2 or not tr.duration_s > 0:
        where = f"--duration {duration:g}" if duration is not None else f"--trace {trace}" if trace else tr.name
        raise ReplayInputError(
            f"{where}: {len(tr):,} request(s) over {tr.duration_s:g} s; a replay needs at least two requests "
            "over a positive time" + (" (raise --duration)" if duration is not None else "")
        )
    return tr, trace_stats(tr, thread), info


def _fmt(x: float, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.1%}" if pct else f"{x:.2f}"


def _unmet_note(policy: str, cap: CapacityResult, slo: float) -> str:
    """Why a capacity reads 0: the slowest rate tried already missed the objective."""
    lowest = min(cap.probes, key=lambda p: p.qps)
    missed = ("p99 TTFT over it (the replay stopped early)" if lowest.metrics.aborted
              else f"p99 TTFT {lowest.ttft_p99_s:.3g} s")
    return (
        f"{policy}: capacity 0, no rate meets p99 TTFT <= {slo:g} s; at {lowest.qps:.3g} QPS, the lowest "
        f"tried, {missed}. Raise --slo-p99-ttft, or check --profile against the prompts' lengths."
    )


def _unbounded_note(policy: str, cap: CapacityResult, requests: int, slo: float, info: dict[str, Any]) -> str:
    # A generated workload, or a trace cut by --duration, has more to give; a whole trace has not.
    more = "workload" in info or info.get("requests_before_window", requests) > requests
    longer = "Replay a longer window (--duration)" if more else "The whole trace was replayed: give a longer one"
    return (
        f"{policy}: capacity at least {cap.qps:.3g} QPS, not bounded by this trace: its {requests:,} requests "
        f"arriving within {slo:g} s still meet p99 TTFT <= {slo:g} s. {longer}, or fewer --destinations."
    )


def _table(rows: list[dict[str, Any]], capacity: bool, slo: float) -> Table:
    t = Table(title="replay" + (f" — capacity at p99 TTFT <= {slo:g}s" if capacity else ""))
    t.add_column("policy", no_wrap=True)
    t.add_column("capacity QPS" if capacity else "QPS", justify="right")
    for col in ("KV hit", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "CV busy", "CV tokens"):
        t.add_column(col, justify="right")
    for r in rows:
        m: ReplayMetrics | None = r["metrics"]
        q = _fmt(r["qps"]) if r.get("bounded", True) else f">= {_fmt(r['qps'])}"
        if m is None:
            t.add_row(r["policy"], q, *["-"] * 7)
            continue
        late = m.aborted or m.ttft_p99_s > slo
        p99 = _fmt(m.ttft_p99_s)
        t.add_row(
            r["policy"], q, _fmt(m.kv_hit, pct=True), _fmt(m.ttft_p50_s),
            f"[red]{p99}[/]" if late else p99, _fmt(m.e2e_p50_s), _fmt(m.e2e_p99_s),
            _fmt(m.load_cv_busy), _fmt(m.load_cv_tokens),
        )
    return t


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png", bbox_inches="tight")
    return buf.getvalue()


def write_outputs(out: Path, report: dict[str, Any], curves: dict[str, list[tuple[float, float]]],
                  hits: dict[str, list[tuple[float, float]]], slo: float) -> list[Path]:
    """Render every file first, then put them in place one right after the other: an interrupt
    while rendering leaves the previous run's set whole."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict[str, bytes] = {"replay.json": (json.dumps(_clean(report), indent=2) + "\n").encode("utf-8")}
    # Room for the legend beside the axes, and for long policy names under the bars.
    wide = max(7.0, 4.0 + 0.45 * len(curves))
    fig, ax = plt.subplots(figsize=(wide, 4.5))
    cmap = plt.get_cmap("tab20")
    markers = "os^Dv<>pPX*h"
    for i, (name, raw) in enumerate(curves.items()):
        pts = sorted(raw)
        xs = [q for q, _ in pts]
        ys = [p if math.isfinite(p) else float("nan") for _, p in pts]
        color = cmap(i % 20 if len(curves) > 10 else 2 * i % 20)
        ax.plot(xs, ys, marker=markers[i % len(markers)], color=color, label=name)
    ax.axhline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g}s")
    ax.set_xlabel("QPS")
    ax.set_ylabel("p99 TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("p99 TTFT vs QPS (aborted probes omitted)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    files["ttft_p99_vs_qps.png"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(wide, 4.5))
    names = list(hits)
    # Fixed rates: one bar per policy and rate. Capacity: one bar per policy, each at its own rate.
    capacity = report.get("mode") == "capacity"
    fixed: list[float | None] = [*sorted({q for pts in hits.values() for q, _ in pts})]
    rates = [None] if capacity else fixed
    width = 0.8 / max(len(rates), 1)
    for j, q in enumerate(rates):
        ys = [next((h * 100 for r, h in hits[n] if q is None or r == q), float("nan")) for n in names]
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
        color = plt.get_cmap("viridis")(j / max(len(rates) - 1, 1))
        ax.bar(xs, ys, width=width, color=color, label="" if q is None else f"{q:g} QPS")
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    ax.set_ylabel("served KV hit (%)")
    ax.set_title("served token-weighted KV hit per policy" + (", at its capacity" if capacity else ""))
    if not capacity:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    files["kv_hit.png"] = _png(fig)
    plt.close(fig)

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in files.items():
        write_atomically(out / name, data)
        written.append(out / name)
    return written


def register(app: typer.Typer) -> None:
    @app.command("replay", help=REPLAY_HELP)
    def replay(
        *,
        workload: Annotated[
            str | None, typer.Option(help=f"generated workload: {', '.join([*PRESETS, SAMPLED])}")
        ] = None,
        trace: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="Mooncake JSONL trace")] = None,
        key: Annotated[
            str, typer.Option(help="affinity key of a trace: first-blocks:K, thread, none")
        ] = "first-blocks:4",
        destinations: Annotated[
            int, typer.Option(min=1, max=MAX_DESTINATIONS, help="number of destinations (vLLM replicas)")
        ] = 30,
        policies: Annotated[
            str, typer.Option(help="comma-separated policies, or all")
        ] = "p2c,prefix-tree,preble,cacheroute",
        qps: Annotated[str | None, typer.Option(help="replay rates, comma-separated (requests/s)")] = None,
        capacity: Annotated[bool, typer.Option("--capacity", help="search each policy's capacity")] = False,
        slo_p99_ttft: Annotated[
            float, typer.Option("--slo-p99-ttft", min=0.001, max=3600.0, help="p99 TTFT SLO in seconds")
        ] = DEFAULT_SLO_P99_TTFT_S,
        seed: Annotated[int, typer.Option(min=0, max=2**32 - 1, help="seed of the workload and of the policies")] = 0,
        duration: Annotated[
            float | None, typer.Option(min=0.001, max=MAX_SECONDS, help="replay only the first DURATION seconds")
        ] = None,
        profile: Annotated[str, typer.Option(help=f"engine profile: {', '.join(PROFILES)}")] = DEFAULT_PROFILE.name,
        kv_capacity_tokens: Annotated[
            int | None, typer.Option(min=1, max=1 << 40, help="KV tokens per destination (default: the profile's)")
        ] = None,
        host_kv_capacity_tokens: Annotated[
            int,
            typer.Option(
                min=0, max=1 << 40,
                help="KV tokens of each destination's host-memory tier (vLLM --kv-offloading-size; 0: none)",
            ),
        ] = 0,
        warmup: Annotated[
            float, typer.Option(min=0.0, max=0.99, help="share of requests left out of the figures")
        ] = 0.1,
        plan_period: Annotated[
            float, typer.Option(min=0.001, max=MAX_SECONDS, help="CacheRoute control period, seconds")
        ] = DEFAULT_CONTROL_PERIOD_S,
        plan_window: Annotated[
            float, typer.Option(min=0.001, max=MAX_SECONDS, help="CacheRoute statistics window, seconds")
        ] = DEFAULT_WINDOW_S,
        out: Annotated[
            Path | None, typer.Option(file_okay=False, help="directory for replay.json and the plots")
        ] = None,
    ) -> None:
        console = Console(width=140) if not Console().is_terminal else Console()
        try:
            if out is not None:
                check_output_dir(out, "--out")
            names = policy_names(policies)
            if destinations < 1:
                raise ReplayInputError(f"--destinations must be at least 1, got {destinations}")
            if qps is not None and capacity:
                raise ReplayInputError("give --qps or --capacity, not both")
            if not slo_p99_ttft > 0:
                raise ReplayInputError(f"--slo-p99-ttft must be positive, got {slo_p99_ttft}")
            prof = get_profile(profile)
            if kv_capacity_tokens is not None:
                if kv_capacity_tokens <= 0:
                    raise ReplayInputError(f"--kv-capacity-tokens must be positive, got {kv_capacity_tokens}")
                prof = prof.with_kv_capacity(kv_capacity_tokens)
            if host_kv_capacity_tokens:
                prof = prof.with_host_tier(host_kv_capacity_tokens)
            planner = PlannerSettings(control_period_s=plan_period, window_s=plan_window)
            rates = parse_qps_list(qps) if qps is not None else None
            cfg = ReplayConfig(destinations=destinations, profile=prof, warmup_fraction=warmup, seed=seed)
            with console.status("preparing the workload"):
                tr, stats, info = load_workload(workload, trace, key, seed, duration)
            check_fits(tr, prof.kv_capacity_tokens)
        except (ReplayInputError, TraceFormatError, OutputPathError, ValueError) as exc:
            raise fail(str(exc)) from None

        own = base_qps(tr)
        console.print(
            f"[bold]{tr.name}[/]: {len(tr):,} requests over {tr.duration_s:,.0f}s ({own:.1f} QPS), "
            f"{stats.distinct_keys:,} keys, top {stats.top_keys_fraction:.0%} of keys carry "
            f"{stats.top_keys_request_share:.1%} of requests, {stats.multi_turn_request_share:.1%} in multi-turn "
            f"threads, ideal KV reuse {stats.ideal_token_reuse:.1%}; {destinations} x {prof.name} "
            f"({prof.kv_capacity_tokens:,} KV tokens each"
            + (f", {prof.host_kv_capacity_tokens:,} in host memory)" if prof.host_kv_capacity_tokens else ")")
        )

        def factory(name: str) -> Callable[[], Any]:
            return lambda: make_policy(name, planner=planner, slo_p99_ttft_s=slo_p99_ttft)

        rows: list[dict[str, Any]] = []
        curves: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        hits: dict[str, list[tuple[float, float]]] = {}
        results: list[dict[str, Any]] = []
        notes: list[str] = []
        progress_console = Console(stderr=True)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=progress_console, transient=True) as bar:
            runs = bar.add_task("policies", total=len(names) * (len(rates) if rates else 1))
            req_task = bar.add_task("requests", total=len(tr))
            started = time.monotonic()

            def finished(what: str) -> None:
                bar.advance(runs)
                # Without a terminal the bar is not drawn: a line per run says how far it got.
                if not progress_console.is_terminal:
                    task = bar.tasks[runs]
                    progress_console.print(f"[{task.completed:g}/{task.total:g}] {what} "
                                           f"({time.monotonic() - started:,.0f} s)", soft_wrap=True, highlight=False)

            def tick(done: int, total: int) -> None:
                bar.update(req_task, completed=done, total=total)

            for name in names:
                if capacity:
                    bar.update(runs, description=f"capacity of {name}")

                    def record(p: Probe, name: str = name) -> None:
                        if not p.metrics.aborted:
                            curves[name].append((p.qps, p.ttft_p99_s))
                        bar.update(req_task, completed=0)

                    cap: CapacityResult = find_capacity(
                        tr, factory(name), cfg, slo_p99_ttft_s=slo_p99_ttft, start_qps=own, on_probe=record, name=name,
                    )
                    rows.append({"policy": name, "qps": cap.qps, "metrics": cap.best, "bounded": cap.bounded})
                    if not cap.bounded:
                        notes.append(_unbounded_note(name, cap, len(tr), slo_p99_ttft, info))
                    if cap.best is not None:
                        hits[name] = [(cap.qps, cap.best.kv_hit)]
                    elif cap.probes:
                        notes.append(_unmet_note(name, cap, slo_p99_ttft))
                    results.append(cap.to_dict())
                    finished(f"capacity of {name}: {'' if cap.bounded else '>= '}{cap.qps:.3g} QPS")
                    continue
                for q in rates or [own]:
                    bar.update(runs, description=f"{name} at {q:g} QPS")
                    pol = make_policy(name, planner=planner, slo_p99_ttft_s=slo_p99_ttft)
                    res = replay_trace(tr.time_scaled(q / own), pol, cfg, progress=tick)
                    m = replace(summarize(res), policy=name)  # a variant's metrics under the name asked for
                    rows.append({"policy": name, "qps": q, "metrics": m})
                    curves[name].append((q, m.ttft_p99_s))
                    hits.setdefault(name, []).append((q, m.kv_hit))
                    results.append({"policy": name, "qps": q, "settings": pol.describe(), "metrics": m.to_dict()})
                    finished(f"{name} at {q:g} QPS")

        console.print(_table(rows, capacity, slo_p99_ttft))
        for note in notes:
            console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
        if out is not None:
            report = {
                "command": "replay",
                "mode": "capacity" if capacity else "fixed-qps",
                "destinations": destinations,
                "profile": {**prof.__dict__},
                "slo_p99_ttft_s": slo_p99_ttft,
                "seed": seed,
                "warmup_fraction": warmup,
                "planner": {"control_period_s": plan_period, "window_s": plan_window},
                "input": info,
                "workload_stats": stats.to_dict(),
                "results": results,
            }
            try:
                for path in write_outputs(out, report, curves, hits, slo_p99_ttft):
                    console.print(f"wrote {path}")
            except OSError as exc:
                raise fail(f"cannot write to {out}: {exc.strerror or exc}", 1) from None

