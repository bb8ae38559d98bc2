"""`cacheroute sandbox load URL ...`: replay a workload against a loopback URL and report."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from cacheroute.operator.cli.errors import fail

if TYPE_CHECKING:
    from cacheroute.sandbox.loadgen.report import Summary

# Every `cacheroute` invocation registers this command: the HTTP client, numpy and the workload
# generators are imported when the command runs.
API_NAMES = ("completions", "chat")
err = Console(stderr=True)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.0f} ms"


def summary_table(summary: Summary) -> Table:
    table = Table("measure", "value", title="load")
    rows = [
        ("requests (ok / failed)", f"{summary.succeeded} / {summary.failed}"),
        ("throughput", f"{summary.throughput_rps:.2f} req/s over {summary.duration_s:.1f} s"),
        ("TTFT p50 / p90 / p99", f"{_ms(summary.ttft_p50_s)} / {_ms(summary.ttft_p90_s)} / {_ms(summary.ttft_p99_s)}"),
        ("end-to-end p50 / p99", f"{_ms(summary.e2e_p50_s)} / {_ms(summary.e2e_p99_s)}"),
        ("served KV hit (cached / prompt tokens)", f"{summary.served_kv_hit:.1%}"),
        ("largest send lag", _ms(summary.max_send_lag_s)),
    ]
    rows += [(f"errors: {kind}", str(count)) for kind, count in sorted(summary.errors.items())]
    for row in rows:
        table.add_row(*row)
    return table


def load(  # noqa: PLR0917 - one parameter per option
    url: Annotated[str, typer.Argument(help="Loopback URL of the pool (its Envoy), or of one server.")],
    trace: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="A Mooncake trace (JSON lines).")
    ] = None,
    workload: Annotated[str | None, typer.Option(help="A generated workload preset instead of a trace.")] = None,
    key: Annotated[str, typer.Option(help="How a trace's requests get affinity keys (as `cacheroute replay`).")] = (
        "first-blocks:4"
    ),
    qps: Annotated[
        float | None, typer.Option(help="Scale the clock to this mean request rate.", min=0.001, max=1e6)
    ] = None,
    time_scale: Annotated[
        float | None, typer.Option(help="Replay this many times faster than recorded.", min=1e-3, max=1e6)
    ] = None,
    duration: Annotated[
        float, typer.Option(help="Send only the requests of the first SECONDS.", min=0.1, max=1e7)
    ] = 60.0,
    max_requests: Annotated[int, typer.Option(help="Send at most this many requests.", min=1, max=10_000_000)] = 10_000,
    max_output_tokens: Annotated[
        int | None, typer.Option(help="Cap every request's output length.", min=1, max=10_000_000)
    ] = None,
    max_input_tokens: Annotated[
        int | None, typer.Option(help="Leave out requests with longer prompts.", min=1, max=10_000_000)
    ] = None,
    api: Annotated[str, typer.Option(help=f"Which API: {', '.join(API_NAMES)}.")] = "completions",
    model: Annotated[str | None, typer.Option(help="The `model` field of every request.")] = None,
    key_header: Annotated[str | None, typer.Option(help="Send the affinity key in this header.")] = None,
    key_field: Annotated[
        str, typer.Option(help="Send the affinity key in this body field ('' for none).")
    ] = "user",
    timeout: Annotated[float, typer.Option(help="Give up on a request after SECONDS.", min=1.0, max=86_400.0)] = 300.0,
    seed: Annotated[int, typer.Option(help="Seed of a generated workload.", min=0, max=2**32 - 1)] = 0,
    keys: Annotated[
        int | None,
        typer.Option(
            help="Business keys of a generated workload (its preset's count by default).", min=1, max=10_000_000
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", dir_okay=False, help="Write results: .json or .csv.")
    ] = None,
    show_progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Replay a workload as real streaming requests, open loop, and measure TTFT and latency."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cacheroute.sandbox.loadgen.client import LoadSettings, TargetError, check_target, run_load
    from cacheroute.sandbox.loadgen.report import summarize, write_results
    from cacheroute.sandbox.loadgen.schedule import ScheduleError, build_schedule, load_trace

    if api not in API_NAMES:
        raise fail(f"--api {api!r} is not one of {', '.join(API_NAMES)}")
    if out is not None and not out.parent.is_dir():
        # Before the run, not after it: results of a long load are not to be lost to a typo.
        raise fail(f"--out {out}: folder {out.parent} does not exist")
    try:
        check_target(url)
        tr, source = load_trace(
            trace=trace, workload=workload, key=key, seed=seed,
            qps=qps if workload is not None else None,
            duration_s=duration if workload is not None else None,
            keys=keys,
        )
        schedule = build_schedule(
            tr,
            source=source,
            time_scale=time_scale,
            qps=qps if trace is not None else None,
            duration_s=duration,
            max_requests=max_requests,
            max_output_tokens=max_output_tokens,
            max_input_tokens=max_input_tokens,
        )
    except (TargetError, ScheduleError) as exc:
        raise fail(str(exc)) from None
    settings = LoadSettings(
        url=url, api=api, model=model, key_header=key_header or None, key_field=key_field or None, timeout_s=timeout
    )
    err.print(
        f"sending {len(schedule.requests)} requests of {source} over {schedule.duration_s:.1f} s "
        f"({schedule.time_scale:.3g}x the recorded pace) to {settings.endpoint()}",
        soft_wrap=True,
    )
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, disable=not show_progress, transient=True,
    ) as bar:
        task = bar.add_task("requests", total=len(schedule.requests))
        results = asyncio.run(run_load(
            schedule, settings, progress=lambda done, _n: bar.update(task, completed=done), interruptible=True))
    interrupted = len(results) < len(schedule.requests)
    if interrupted:
        err.print(f"interrupted: {len(results)} of {len(schedule.requests)} requests had finished; the summary "
                  "covers those (requests in flight were cancelled)", soft_wrap=True)
    summary = summarize(results)
    Console().print(summary_table(summary))
    if out is not None:
        meta = {
            "url": url, "source": source, "api": api, "time_scale": schedule.time_scale, "duration_s": duration,
            "key_header": key_header, "key_field": key_field, "requests": len(schedule.requests),
            "interrupted": interrupted,
        }
        write_results(out, results, summary, meta)
        err.print(f"wrote {out}")
    if interrupted:
        raise typer.Exit(130)
    if summary.succeeded == 0:
        raise typer.Exit(1)
