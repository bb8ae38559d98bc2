"""`cacheroute sandbox demo` refuses a workload it cannot generate before starting anything."""

from __future__ import annotations

from typer.testing import CliRunner

from cacheroute.operator.cli.main import app


def test_a_workload_that_cannot_be_generated_is_refused_in_one_line() -> None:
    result = CliRunner().invoke(app, ["sandbox", "demo", "--short", "--keys", "5000"])
    assert result.exit_code == 2
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: ") and "5000 keys" in line


def test_out_of_range_options_are_refused() -> None:
    result = CliRunner().invoke(app, ["sandbox", "demo", "--destinations", "1"])
    assert result.exit_code == 2
