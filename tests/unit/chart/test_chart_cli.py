"""`cacheroute chart` writes the generated files, and `--check` names what drifted."""

from __future__ import annotations

import shutil
from pathlib import Path

from typer.testing import CliRunner

from cacheroute.operator.chart.reference import BEGIN, END
from cacheroute.operator.cli.main import app

REPO = Path(__file__).resolve().parents[3]
runner = CliRunner()


def copy_chart(tmp_path: Path) -> tuple[Path, Path]:
    chart = tmp_path / "chart"
    shutil.copytree(REPO / "helm" / "cacheroute", chart)
    doc = tmp_path / "install.md"
    doc.write_text(f"# Install\n\n{BEGIN}\nold table\n{END}\n\nmore prose\n")
    return chart, doc


def test_chart_writes_then_checks_clean(tmp_path: Path) -> None:
    chart, doc = copy_chart(tmp_path)
    (chart / "values.schema.json").unlink()
    written = runner.invoke(app, ["chart", "--out", str(chart), "--install-doc", str(doc)])
    assert written.exit_code == 0, written.output
    assert (chart / "values.schema.json").is_file()
    text = doc.read_text()
    assert "old table" not in text and "| `operator.replicas` |" in text and text.endswith("more prose\n")
    checked = runner.invoke(app, ["chart", "--out", str(chart), "--install-doc", str(doc), "--check"])
    assert checked.exit_code == 0, checked.output


def test_check_fails_on_an_edited_generated_file(tmp_path: Path) -> None:
    chart, _ = copy_chart(tmp_path)
    rules = chart / "files" / "operator-rules.yaml"
    rules.write_text(rules.read_text().replace('"delete"', '"deletecollection"'))
    result = runner.invoke(app, ["chart", "--out", str(chart), "--check"])
    assert result.exit_code == 1
    assert "operator-rules.yaml" in result.output.replace("\n", "")


def test_bad_paths_are_one_line_errors(tmp_path: Path) -> None:
    result = runner.invoke(app, ["chart", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "no Chart.yaml" in result.output
    chart, _ = copy_chart(tmp_path)
    no_markers = tmp_path / "plain.md"
    no_markers.write_text("# nothing to replace\n")
    result = runner.invoke(app, ["chart", "--out", str(chart), "--install-doc", str(no_markers)])
    assert result.exit_code == 2 and "values markers" in result.output.replace("\n", " ")


def test_crds_reference_is_written_and_checked(tmp_path: Path) -> None:
    reference = tmp_path / "crds.md"
    assert runner.invoke(app, ["crds", "--out", str(tmp_path / "crds"), "--reference", str(reference)]).exit_code == 0
    assert "## InferencePool" in reference.read_text() and "## AffinityPlan" in reference.read_text()
    check = ["crds", "--out", str(tmp_path / "crds"), "--reference", str(reference), "--check"]
    assert runner.invoke(app, check).exit_code == 0
    reference.write_text(reference.read_text() + "edited\n")
    assert runner.invoke(app, check).exit_code == 1
