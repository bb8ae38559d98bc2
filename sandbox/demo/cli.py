"""`cacheroute sandbox demo`: the whole loop on this machine, with progress, a table and plots."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

err = Console(stderr=True)


def demo(  # noqa: PLR0917 - one parameter per option
    out: Annotated[Path, typer.Option("--out", "-o", file_okay=False, help="Folder for loop.json and plots.")] = Path(
        "demo"
    ),
    short: Annotated[
        bool, typer.Option("--short", help="The short variant: 4 destinations, half a minute per phase.")
    ] = False,
    destinations: Annotated[int | None, typer.Option(help="vLLM replicas of the pool.", min=2, max=32)] = None,
    phase_seconds: Annotated[
        float | None, typer.Option("--phase-seconds", help="Traffic per phase.", min=10.0, max=3600.0)
    ] = None,
    qps: Annotated[float | None, typer.Option(help="Mean request rate.", min=0.1, max=200.0)] = None,
    keys: Annotated[int | None, typer.Option(help="Business keys of the workload.", min=1, max=100_000)] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the workload.", min=0, max=2**32 - 1)] = None,
    state_dir: Annotated[
        Path | None, typer.Option("--state-dir", file_okay=False, help="Sandbox state (default: a temporary folder).")
    ] = None,
) -> None:
    """Run the loop: sandbox, helm install, a pool and an AffinityPlan, a p2c phase then a planned phase.

    Must run inside `cacheroute sandbox isolate --` (the pod network); `make demo` does. The
    sandbox is stopped at the end, whatever happens.
    """
    from cacheroute.sandbox.binaries import BinaryNotFoundError
    from cacheroute.sandbox.cluster import PodRuntimeOptions, Sandbox, SandboxError, SandboxOptions, temporary_state_dir
    from cacheroute.sandbox.demo import plots, report
    from cacheroute.sandbox.demo.cluster import DemoError
    from cacheroute.sandbox.demo.run import run_demo
    from cacheroute.sandbox.demo.settings import FULL, SHORT
    from cacheroute.sandbox.demo.workload import demo_workload
    from cacheroute.sandbox.loadgen.report import write_results
    from cacheroute.sandbox.network import isolated
    from cacheroute.sandbox.process import StartError

    settings = SHORT if short else FULL
    try:
        w = settings.workload
        settings = replace(
            settings,
            destinations=destinations or settings.destinations,
            phase_s=phase_seconds or settings.phase_s,
            workload=replace(w, qps=qps or w.qps, keys=keys or w.keys, seed=w.seed if seed is None else seed),
        )
        if settings.nodes * 4 < settings.destinations:
            settings = replace(settings, nodes=-(-settings.destinations // 4))
        workload = demo_workload(settings)
    except ValueError as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    from cacheroute.sandbox.demo.settings import CHART, MANIFESTS

    if not (CHART.is_dir() and MANIFESTS.is_dir()):
        err.print(f"error: the demo installs the chart and applies the manifests of a checkout ({CHART}, "
                  f"{MANIFESTS}): run it from a clone of the repository", markup=False, soft_wrap=True)
        raise typer.Exit(2)
    if not isolated():
        err.print("error: the demo needs the sandbox's pod network: run it as "
                  "`cacheroute sandbox isolate -- cacheroute sandbox demo` (make demo does)",
                  markup=False, soft_wrap=True)
        raise typer.Exit(2)
    if out.exists() and not out.is_dir():
        err.print(f"error: --out {out}: not a folder", markup=False, soft_wrap=True)
        raise typer.Exit(2)

    started = time.monotonic()

    def say(message: str) -> None:
        err.print(f"[dim]{time.monotonic() - started:6.1f}s[/dim] {message}", soft_wrap=True)

    @contextlib.contextmanager
    def progress(name: str, total: int) -> Iterator[object]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn(f"  {name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task(name, total=total)
            yield lambda done, _n: bar.update(task, completed=done)

    options = SandboxOptions(name="demo", state_dir=state_dir or temporary_state_dir("cacheroute-demo-"),
                             nodes=settings.nodes, detach=False, timeout=180.0, pod_runtime=PodRuntimeOptions())
    say(f"sandbox up ({settings.nodes} fake 8xH100 nodes, Prometheus, pod runtime)")
    try:
        sandbox = Sandbox.up(options)
    except (SandboxError, StartError, BinaryNotFoundError) as exc:
        err.print(f"error: sandbox: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    # A failed run given its own --state-dir keeps it: the components' logs tell what happened.
    keep = False
    try:
        run = run_demo(sandbox, settings, workload, say, progress)  # type: ignore[arg-type]
    except (DemoError, SandboxError, StartError) as exc:
        keep = state_dir is not None
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        where = "kept" if keep else "removed with the sandbox; give --state-dir to keep them"
        err.print(f"logs: {sandbox.state_dir / 'logs'} ({where})", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    finally:
        say("sandbox down")
        sandbox.down(keep_files=keep)
    # Piped (make, a log file), rich would wrap at 80 columns: the table is wider.
    Console(width=None if sys.stdout.isatty() else 110).print(report.render(run))
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "loop.json", report.document(run))
    for phase in run.phases:
        write_results(out / f"loop_{phase.name}_requests.json", phase.results, phase.summary,
                      {"phase": phase.name, "requests": len(phase.results)})
    written = plots.write_plots(run, out)
    say(f"wrote {out / 'loop.json'}, {', '.join(str(p) for p in written)}")
