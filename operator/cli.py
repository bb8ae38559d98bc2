"""The `cacheroute` command line."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console

from cacheroute.operator.crdgen import MODELS, crd_file_name, render, write_crds
from cacheroute.operator.manifests import ManifestError, documents, parse_resource
from cacheroute.operator.version import package_version

app = typer.Typer(
    name="cacheroute",
    help="Planned prefix-cache affinity for vLLM fleets on Kubernetes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

# Commands contributed by other modules: (module, kind) where kind "register" means a
# `register(app)` function and anything else is the name of a sub-command group.
_EXTENSIONS: tuple[tuple[str, str], ...] = (
    ("cacheroute.operator.cli_plan", "register"),
    ("cacheroute.operator.cli_replay", "register"),
    ("cacheroute.operator.cli_memory", "register"),
    ("cacheroute.router.cli", "router"),
    ("cacheroute.sandbox.cli", "sandbox"),
)


@app.command()
def version() -> None:
    """Print the version of cacheroute."""
    console.print(f"cacheroute {package_version()}")


@app.command()
def crds(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the CRD YAML files into.")] = Path(
        "crds"
    ),
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; fail if the files in --out differ from the models.")
    ] = False,
) -> None:
    """Generate the CustomResourceDefinitions from the typed models."""
    if check:
        stale = [
            crd_file_name(m)
            for m in MODELS
            if not (out / crd_file_name(m)).is_file() or (out / crd_file_name(m)).read_text("utf-8") != render(m)
        ]
        if stale:
            err.print(f"[red]out of date in {out}:[/] {', '.join(stale)} — run `cacheroute crds --out {out}`")
            raise typer.Exit(1)
        console.print(f"CRDs in {out} match the models")
        return
    for path in write_crds(out):
        console.print(f"wrote {path}")


@app.command()
def validate(
    files: Annotated[list[Path], typer.Argument(help="YAML manifests (multi-document allowed); - reads stdin.")],
) -> None:
    """Check InferencePool and AffinityPlan manifests offline, with the API server's rules."""
    failed = 0
    for path in files:
        try:
            text = sys.stdin.read() if str(path) == "-" else path.read_text("utf-8")
            docs = list(documents(text, str(path)))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            failed += 1
            err.print(f"[red]unreadable[/] {path}: {exc}")
            continue
        for where, doc in docs:
            try:
                obj = parse_resource(doc, where)
            except ManifestError as exc:
                failed += 1
                err.print(f"[red]invalid[/] {exc}")
                continue
            console.print(f"[green]ok[/] {where}: {obj.kind} {obj.metadata.name or '(unnamed)'}")
    if failed:
        raise typer.Exit(1)


def _register_extensions() -> None:
    for module_name, kind in _EXTENSIONS:
        module = importlib.import_module(module_name)
        if kind == "register":
            module.register(app)
        else:
            app.add_typer(module.app, name=kind)


_register_extensions()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
