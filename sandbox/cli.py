"""`cacheroute sandbox up | down | status` (and `binaries`), the sandbox's command line."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from cacheroute.operator.cli.errors import WORLD, fail
from cacheroute.sandbox import binaries
from cacheroute.sandbox.binaries import BinaryNotFoundError, BuildError
from cacheroute.sandbox.network import LOOPBACK_NETWORK
from cacheroute.sandbox.process import StartError

if TYPE_CHECKING:
    from cacheroute.sandbox.cluster import Sandbox

# The cluster module (TLS, HTTP and model libraries) is imported inside the commands: every
# `cacheroute` invocation loads this module, and most never start a sandbox.

app = typer.Typer(
    help="A simulated GPU cluster on this machine (control plane, fake H100 nodes, Prometheus).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(binaries.app, name="binaries")

_NAME = typer.Option(
    "default", "--name", envvar="CACHEROUTE_SANDBOX_NAME",
    help="Sandbox name; the state lives in ~/.cache/cacheroute/sandbox/NAME.",
)
_STATE_DIR = typer.Option(None, "--state-dir", file_okay=False, help="State directory (overrides --name).")


def _state_dir(name: str, state_dir: Path | None) -> Path:
    from cacheroute.sandbox.cluster import default_state_dir

    return state_dir if state_dir is not None else default_state_dir(name)


def _exports(sandbox: Sandbox, name: str, state_dir: Path | None) -> str:
    """Shell lines pointing kubectl at the sandbox and, when it has a name of its own (not a
    state directory), the sandbox commands too."""
    lines = [f"export KUBECONFIG={sandbox.kubeconfig}"]
    if state_dir is None and name != "default":
        lines.append(f"export CACHEROUTE_SANDBOX_NAME={shlex.quote(name)}")
    return "\n".join(lines)


def _print_status(sandbox: Sandbox, console: Console) -> None:
    table = Table("component", "state", "pid")
    table.add_column("url", no_wrap=True)
    for row in sandbox.status():
        state = ("[green]healthy[/green]" if row.healthy else "[yellow]paused[/yellow]" if row.paused
                 else "running" if row.running else "[red]stopped[/red]")
        table.add_row(row.name, state, str(row.pid), row.url or "")
    console.print(table)
    console.print(f"nodes: {', '.join(sandbox.state.nodes)}", soft_wrap=True)
    console.print(f"pod network: {sandbox.state.pod_network}", soft_wrap=True)
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
    pod_runtime: bool = typer.Option(
        True, "--pod-runtime/--no-pod-runtime", help="Run pods of the CacheRoute and vLLM images for real."
    ),
    runtime_namespace: Annotated[
        list[str] | None,
        typer.Option("--runtime-namespace", help="Run pods only in these namespaces (repeatable; default: all)."),
    ] = None,
    runtime_namespace_selector: str = typer.Option(
        "", "--runtime-namespace-selector", help="Run pods only in namespaces with these labels."
    ),
    runtime_selector: str = typer.Option("", "--runtime-selector", help="Run only pods with these labels."),
    runtime_image: Annotated[
        list[str] | None,
        typer.Option("--runtime-image", help="REPOSITORY=COMMAND: also run this image's containers, as COMMAND."),
    ] = None,
    emulator_load_seconds: float = typer.Option(
        0.0, "--emulator-load-seconds", min=0.0, max=3600.0, help="How long an emulated vLLM takes to load its model."
    ),
) -> None:
    """Start the sandbox; its servers keep running after this command returns."""
    from cacheroute.sandbox.cluster import PodRuntimeOptions, Sandbox, SandboxError, SandboxOptions
    from cacheroute.sandbox.runtime.images import parse_image_option

    console = Console(stderr=True)
    runtime_image = runtime_image or []
    for option in runtime_image:
        try:
            parse_image_option(option)
        except ValueError as exc:
            raise fail(str(exc)) from None
    runtime = PodRuntimeOptions(
        namespaces=tuple(runtime_namespace or ()),
        namespace_selector=runtime_namespace_selector,
        pod_selector=runtime_selector,
        images=tuple(runtime_image),
        emulator_load_seconds=emulator_load_seconds,
    )
    options = SandboxOptions(
        name=name,
        state_dir=_state_dir(name, state_dir),
        nodes=nodes,
        prometheus=prometheus,
        detach=True,
        timeout=timeout,
        pod_runtime=runtime if pod_runtime else None,
    )
    try:
        if build:
            binaries.ensure(console=console)
            binaries.ensure_native_copy(console)
        started = time.monotonic()
        with console.status("starting") as status:
            sandbox = Sandbox.up(
                options, report=lambda msg: status.update(f"{msg} ({time.monotonic() - started:.1f}s)")
            )
    except (SandboxError, StartError, BinaryNotFoundError, BuildError) as exc:
        raise fail(str(exc), WORLD) from None
    console.print(f"sandbox {name!r} up in {sandbox.state.startup_seconds:.1f}s ({sandbox.state_dir})", soft_wrap=True)
    if sandbox.state.pod_network == LOOPBACK_NETWORK:
        console.print(
            f"[yellow]warning:[/yellow] pod IPs are loopback addresses ({sandbox.state.pod_network}), which "
            "EndpointSlices refuse; run the sandbox inside `cacheroute sandbox isolate -- COMMAND` (needs root)",
            soft_wrap=True,
        )
    _print_status(sandbox, console)
    # On stdout alone, so that `eval "$(cacheroute sandbox up)"` points kubectl and helm at it,
    # and the shell's later `sandbox status` and `down` at this sandbox.
    typer.echo(_exports(sandbox, name, state_dir))


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
        raise fail(str(exc), WORLD) from None
    console.print(f"sandbox in {directory} stopped", soft_wrap=True)


_COMPONENT = typer.Argument(..., help="A component, as `cacheroute sandbox status` names it (prometheus, ...).")


@app.command()
def pause(component: str = _COMPONENT, *, name: str = _NAME, state_dir: Path | None = _STATE_DIR) -> None:
    """Make one component hang (SIGSTOP): it keeps its port and answers nothing, for failure drills."""
    _signal_component(component, name, state_dir, resume=False)


@app.command()
def resume(component: str = _COMPONENT, *, name: str = _NAME, state_dir: Path | None = _STATE_DIR) -> None:
    """Let a paused component run again (SIGCONT)."""
    _signal_component(component, name, state_dir, resume=True)


def _signal_component(component: str, name: str, state_dir: Path | None, *, resume: bool) -> None:
    from cacheroute.sandbox.cluster import Sandbox, SandboxError

    try:
        sandbox = Sandbox.attach(_state_dir(name, state_dir))
    except SandboxError as exc:
        raise fail(str(exc), WORLD) from None
    try:
        changed = (sandbox.resume if resume else sandbox.pause)(component)
    except SandboxError as exc:
        raise fail(str(exc)) from None
    said = {(True, True): "resumed", (True, False): "was not paused", (False, True): "paused",
            (False, False): "was paused already"}[(resume, changed)]
    Console(stderr=True).print(f"{component} {said}", soft_wrap=True)


@app.command()
def status(
    *,
    name: str = _NAME,
    state_dir: Path | None = _STATE_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """Show each component, whether it is healthy, and its URL."""
    from cacheroute.sandbox.cluster import Sandbox, SandboxError

    try:
        sandbox = Sandbox.attach(_state_dir(name, state_dir))
    except SandboxError as exc:
        raise fail(str(exc), WORLD) from None
    if as_json:
        rows = [row.__dict__ for row in sandbox.status()]
        typer.echo(
            json.dumps(
                {"kubeconfig": sandbox.state.kubeconfig, "nodes": sandbox.state.nodes, "components": rows}, indent=2
            )
        )
        return
    _print_status(sandbox, Console())
    typer.echo(_exports(sandbox, name, state_dir))


@app.command(
    "emulator",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    options_metavar="MODEL [VLLM-FLAGS]...",
)
def emulator(ctx: typer.Context) -> None:
    """Serve `vllm serve ARGS...` with the vLLM emulator (127.0.0.1 unless --host); Ctrl-C stops it.

    Emulator settings vLLM does not have come from CACHEROUTE_EMULATOR_* variables (see docs/emulator.md).
    """
    import os

    from cacheroute.sandbox.emulator.args import EmulatorArgsError, flags_read
    from cacheroute.sandbox.emulator.host import serve_standalone

    if any(arg in ("--help", "-h") for arg in ctx.args):
        # vLLM's own flags pass through unparsed, so help is answered here.
        typer.echo(ctx.get_help())
        typer.echo("\nvLLM flags it reads (others are accepted and ignored): " + ", ".join(flags_read()))
        return
    try:
        serve_standalone(list(ctx.args), os.environ)
    except EmulatorArgsError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:  # the address is taken, or not this machine's
        raise fail(f"cannot listen: {exc}", WORLD) from None


@app.command(
    "isolate",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def isolate(ctx: typer.Context) -> None:
    """Run COMMAND in a private network namespace where pods get addresses EndpointSlices accept.

    `cacheroute sandbox isolate -- bash` gives a shell in which `cacheroute sandbox up` starts a
    sandbox with pod IPs in 198.18.0.0/16; nothing started inside is reachable from outside the
    namespace (nor can it reach other machines). `make test` and `make demo` run this way. Needs root.
    """
    import os

    from cacheroute.sandbox.network import IsolationError, isolate_command

    args = ctx.args[1:] if ctx.args[:1] == ["--"] else list(ctx.args)
    try:
        command = isolate_command(args)
    except IsolationError as exc:
        raise fail(str(exc)) from None
    os.execv(command[0], command)


def _more_commands() -> None:
    from cacheroute.sandbox.demo.cli import demo
    from cacheroute.sandbox.loadgen.cli import load
    from cacheroute.sandbox.runtime.cli import run

    app.command("runtime", help="Run the pod runtime by hand (`up` starts one).")(run)
    app.command("load")(load)
    app.command("demo")(demo)


_more_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
