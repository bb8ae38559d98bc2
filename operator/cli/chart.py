"""`cacheroute chart`: write (or check) the Helm chart's generated files and the docs made from code."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cacheroute.operator.chart import files, reference
from cacheroute.operator.cli.errors import fail

console = Console()


def chart(
    out: Annotated[
        Path, typer.Option("--out", "-o", exists=True, file_okay=False, help="The chart's folder.")
    ] = Path("helm/cacheroute"),
    install_doc: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="Markdown file whose values table (between the values markers) is rewritten.",
        ),
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; fail if a generated file differs from its source.")
    ] = False,
) -> None:
    """Generate the chart's CRD copies, RBAC rules and values schema (and the values table of the docs)."""
    if not (out / "Chart.yaml").is_file():
        raise fail(f"--out {out}: no Chart.yaml there; --out names the chart's folder")
    try:
        # Read first: a document without the markers is refused before anything is written.
        doc_stale = install_doc is not None and reference.stale_values_table(install_doc)
    except reference.MarkerError as exc:
        raise fail(str(exc)) from None
    if check:
        stale = [str(out / name) for name in files.stale_files(out)]
        if doc_stale:
            stale.append(str(install_doc))
        if stale:
            raise fail(f"out of date: {', '.join(stale)} — run `make chart`", 1)
        console.print(f"the generated files of {out} match their sources")
        return
    for path in files.write_files(out):
        console.print(f"wrote {path}")
    if install_doc is not None:
        reference.write_values_table(install_doc)
        console.print(f"wrote the values table of {install_doc}")


def register(app: typer.Typer) -> None:
    """Add `chart` to the `cacheroute` command line."""
    app.command("chart")(chart)
