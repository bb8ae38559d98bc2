"""The `cacheroute` command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console

from cacheroute.operator.api.crdgen import rendered_files, write_crds
from cacheroute.operator.api.crossrefs import Located, check_pins
from cacheroute.operator.api.manifests import DuplicateKeyError, ManifestError, documents, parse_resource
from cacheroute.operator.api.reference import crd_reference
from cacheroute.operator.cli import chart as chart_commands
from cacheroute.operator.cli import memory as memory_commands
from cacheroute.operator.cli import operator as operator_commands
from cacheroute.operator.cli import plan as plan_commands
from cacheroute.operator.cli import replay as replay_commands
from cacheroute.operator.cli.errors import USAGE, CommandLine, describe_os_error, fail, report
from cacheroute.operator.files import OutputPathError, check_output_dir, check_output_file, write_atomically
from cacheroute.operator.version import package_version
from cacheroute.router.cli import app as router_app
from cacheroute.sandbox.cli import app as sandbox_app

app = typer.Typer(
    name="cacheroute",
    help="Planned prefix-cache affinity for vLLM fleets on Kubernetes.",
    cls=CommandLine,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
console = Console()


@app.command()
def version() -> None:
    """Print the version of cacheroute."""
    console.print(f"cacheroute {package_version()}")


def _print_version(given: bool) -> None:
    if given:
        version()
        raise typer.Exit()


@app.callback()
def root(
    show_version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
) -> None:
    """Planned prefix-cache affinity for vLLM fleets on Kubernetes."""


@app.command()
def crds(
    out: Annotated[
        Path, typer.Option("--out", "-o", file_okay=False, help="Directory to write the CRD YAML files into.")
    ] = Path("crds"),
    reference: Annotated[
        Path | None,
        typer.Option(dir_okay=False, help="Also write the field reference (Markdown) to this file, e.g. docs/crds.md."),
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; fail if the files in --out differ from the models.")
    ] = False,
) -> None:
    """Generate the CustomResourceDefinitions (and their field reference) from the typed models."""
    try:
        check_output_dir(out, "--out")
        if reference is not None:
            check_output_file(reference, "--reference")
    except OutputPathError as exc:
        raise fail(str(exc)) from None
    if check:
        stale = [
            name
            for name, text in rendered_files().items()
            if not (out / name).is_file() or (out / name).read_text("utf-8") != text
        ]
        if stale:
            raise fail(f"out of date in {out}: {', '.join(stale)} — run `cacheroute crds --out {out}`", 1)
        if reference is not None and (not reference.is_file() or reference.read_text("utf-8") != crd_reference()):
            raise fail(f"out of date: {reference} — run `make crds`", 1)
        console.print(f"CRDs in {out} match the models")
        return
    for path in write_crds(out):
        console.print(f"wrote {path}")
    if reference is not None:
        write_atomically(reference, crd_reference())
        console.print(f"wrote {reference}")


@app.command()
def validate(
    files: Annotated[list[Path], typer.Argument(help="YAML manifests (multi-document allowed); - reads stdin.")],
) -> None:
    """Check InferencePool and AffinityPlan manifests offline, with the API server's rules.

    Exit status 2 when any file is unreadable, holds no document, or holds an invalid one.
    """
    failed = 0
    parsed: list[Located] = []
    for path in files:
        try:
            text = sys.stdin.read() if str(path) == "-" else path.read_text("utf-8")
            docs = list(documents(text, str(path)))
        except OSError as exc:
            failed += 1
            report(describe_os_error(exc) if exc.filename is not None else f"{path}: {describe_os_error(exc)}")
            continue
        except UnicodeDecodeError as exc:
            failed += 1
            report(f"unreadable {path}: not UTF-8 text ({exc.reason} at byte {exc.start})")
            continue
        except DuplicateKeyError as exc:
            failed += 1
            report(f"invalid {path}: line {exc.line}: key {exc.key!r} given twice (kubectl would keep the last one)")
            continue
        except yaml.YAMLError as exc:
            failed += 1
            report(f"unreadable {path}: not YAML ({exc})")
            continue
        except RecursionError:
            failed += 1
            report(f"unreadable {path}: nested too deeply")
            continue
        if not docs:
            failed += 1
            report(f"{path}: no manifest in it (empty, or only comments)")
            continue
        for where, doc in docs:
            try:
                obj = parse_resource(doc, where)
            except ManifestError as exc:
                failed += 1
                report(f"invalid {exc}")
                continue
            parsed.append(Located(where, obj))
    # Pins are checked against the pools of every file given, so a plan and its pool may be apart.
    pins = check_pins(parsed)
    for item in parsed:
        what = f"{item.resource.kind} {item.resource.metadata.name or '(unnamed)'}"
        if item.where in pins.problems:
            failed += 1
            report(f"invalid {item.where}: {what}: {pins.problems[item.where]}")
        else:
            console.print(f"[green]ok[/] {item.where}: {what}", soft_wrap=True)
        if item.where in pins.notes:
            console.print(f"[yellow]note:[/] {item.where}: {pins.notes[item.where]}", soft_wrap=True)
    if failed:
        raise typer.Exit(USAGE)


# Sub-commands of the other components, imported explicitly so that every tool following imports
# sees the links (and the import contracts in pyproject.toml can check them).
for _commands in (plan_commands, replay_commands, memory_commands, operator_commands, chart_commands):
    _commands.register(app)
app.add_typer(router_app, name="router")
app.add_typer(sandbox_app, name="sandbox")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
