"""`cacheroute sandbox up | down | status` (and `binaries`), the sandbox's command line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from cacheroute.sandbox import binaries
from cacheroute.sandbox.binaries import BinaryNotFoundError, BuildError
from cacheroute.sandbox.process import StartError

if TYPE_CHECKING:
    from cacheroute.sandbox.cluster import Sandbox

# The cluster module (TLS, HTTP and model libraries) is imported inside the commands: every
# `cacheroute` invocation loads this module, and most never start a sandbox.

app = typer.Typer(
    help="A simulated GPU cluster on this machine (control plane, fake H100 nodes, Prometheus).", no_args_is_help=True
)
app.add_typer(binaries.app, name="binaries")

_NAME = typer.Option("default", "--name", help="Sandbox name; the state lives in ~/.cache/cacheroute/sandbox/NAME.")
_STATE_DIR = typer.Option(None, "--state-dir", file_okay=False, help="State directory (overrides --name).")


def _state_dir(name: str, state_dir: Path | None) -> Path:
    from cacheroute.sandbox.cluster import default_state_dir

    return state_dir if state_dir is not None else default_state_dir(name)


def _fail(console: Console, exc: Exception) -> typer.Exit:
    console.print(f"[red]error:[/red] {exc}")
    return typer.Exit(1)


def _print_status(sandbox: Sandbox, console: Console) -> None:
    table = Table("component", "state", "pid")
    table.add_column("url", no_wrap=True)
    for row in sandbox.status():
        state = "[green]healthy[/green]" if row.healthy else ("running" if row.running else "[red]stopped[/red]")
        table.add_row(row.name, state, str(row.pid), row.url or "")
    console.print(table)
    console.print(f"nodes: {', '.join(sandbox.state.nodes)}", soft_wrap=True)
    console.print(f"logs: {sandbox.state_dir / 'logs'}", soft_wrap=True)


@app.command()
def up(
    *,
    name: str = _NAME,
    state_dir: Path | None = _STATE_DIR,
    nodes: int = typer.Option(4, "--nodes", min=1, max=250, help="Number of fake 8xH100 nodes."),
    prometheus: bool = typer.Option(True, "--prometheus/--no-prometheus", help="Start Prometheus."),
    build: bool = typer.Option(False, "--build", help="Build missing Go binaries first (needs Go)."),
    timeout: float = typer.Option(120.0, "--timeout", min=5.0, max=3600.0, help="Seconds to wait for everything."),
) -> None:
    """Start the sandbox; its servers keep running after this command returns."""
    from cacheroute.sandbox.cluster import Sandbox, SandboxError, SandboxOptions

    console = Console(stderr=True)
    options = SandboxOptions(
        name=name,
        state_dir=_state_dir(name, state_dir),
        nodes=nodes,
        prometheus=prometheus,
        detach=True,
        timeout=timeout,
    )
    try:
        if build:
            binaries.ensure(console=console)
        started = time.monotonic()
        with console.status("starting") as status:
            sandbox = Sandbox.up(
                options, report=lambda msg: status.update(f"{msg} ({time.monotonic() - started:.1f}s)")
            )
    except (SandboxError, StartError, BinaryNotFoundError, BuildError) as exc:
        raise _fail(console, exc) from None
    console.print(f"sandbox {name!r} up in {sandbox.state.startup_seconds:.1f}s ({sandbox.state_dir})", soft_wrap=True)
    _print_status(sandbox, console)
    # On stdout alone, so that `eval "$(cacheroute sandbox up)"` points kubectl and helm at it.
    typer.echo(f"export KUBECONFIG={sandbox.kubeconfig}")


@app.command()
def down(
    *,
    name: str = _NAME,
    state_dir: Path | None = _STATE_DIR,
    keep_files: bool = typer.Option(False, "--keep-files", help="Keep the state directory (logs, data)."),
) -> None:
    """Stop every component of the sandbox and remove its state directory."""
    from cacheroute.sandbox.cluster import SandboxError, shutdown

    console = Console(stderr=True)
    directory = _state_dir(name, state_dir)
    try:
        shutdown(directory, keep_files=keep_files)
    except SandboxError as exc:
        raise _fail(console, exc) from None
    console.print(f"sandbox in {directory} stopped", soft_wrap=True)


@app.command()
def status(
    *,
    name: str = _NAME,
    state_dir: Path | None = _STATE_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """Show each component, whether it is healthy, and its URL."""
    from cacheroute.sandbox.cluster import Sandbox, SandboxError

    console = Console(stderr=True)
    try:
        sandbox = Sandbox.attach(_state_dir(name, state_dir))
    except SandboxError as exc:
        raise _fail(console, exc) from None
    if as_json:
        rows = [row.__dict__ for row in sandbox.status()]
        typer.echo(
            json.dumps(
                {"kubeconfig": sandbox.state.kubeconfig, "nodes": sandbox.state.nodes, "components": rows}, indent=2
            )
        )
        return
    _print_status(sandbox, Console())
    typer.echo(f"export KUBECONFIG={sandbox.kubeconfig}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
