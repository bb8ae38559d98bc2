"""The command line a newcomer types."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from cacheroute.operator.api.crdgen import MODELS, crd_file_name, render
from cacheroute.operator.cli.main import app

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0
    assert result.stdout.startswith("cacheroute ")
    flag = runner.invoke(app, ["--version"])
    assert (flag.exit_code, flag.stdout) == (0, result.stdout)


def test_help_names_every_option_whole_in_80_columns() -> None:
    result = runner.invoke(app, ["memory-plan", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0
    assert "--gpu-memory-gib" in result.stdout and "--max-num-batched-tokens" in result.stdout
    assert "…" not in result.stdout


def test_crds_writes_and_checks(tmp_path: Path) -> None:
    assert runner.invoke(app, ["crds", "--out", str(tmp_path)]).exit_code == 0
    for model in MODELS:
        assert (tmp_path / crd_file_name(model)).read_text() == render(model)
    assert runner.invoke(app, ["crds", "--check", "--out", str(tmp_path)]).exit_code == 0
    victim = tmp_path / crd_file_name(MODELS[0])
    victim.write_text(victim.read_text() + "# edited\n")
    result = runner.invoke(app, ["crds", "--check", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert crd_file_name(MODELS[0]) in result.output


def test_validate_reports_every_bad_document(tmp_path: Path) -> None:
    good = {
        "apiVersion": "cacheroute.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "ok"},
        "spec": {"model": {"name": "m"}},
    }
    bad = {**good, "metadata": {"name": "bad"}, "spec": {"model": {"name": "m"}, "replicas": -1}}
    f = tmp_path / "pools.yaml"
    f.write_text(yaml.safe_dump_all([good, bad]))
    result = runner.invoke(app, ["validate", str(f)])
    assert result.exit_code == 2
    assert "ok" in result.stdout
    assert "spec.replicas" in result.output


def test_validate_unreadable_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2
    assert result.output.count("missing.yaml") == 1 and "No such file" in result.output


def test_validate_refuses_a_field_given_twice_naming_its_line(tmp_path: Path) -> None:
    f = tmp_path / "pool.yaml"
    f.write_text(
        "apiVersion: cacheroute.dev/v1alpha1\nkind: InferencePool\nmetadata:\n  name: twice\n"
        "spec:\n  model:\n    name: m\n  replicas: 4\n  replicas: 5\n"
    )
    result = runner.invoke(app, ["validate", str(f)])
    assert result.exit_code == 2
    assert "line 9: key 'replicas' given twice" in result.output
    # The same key in two mappings (name, here) is not a duplicate.
    f.write_text(f.read_text().replace("  replicas: 5\n", ""))
    result = runner.invoke(app, ["validate", str(f)])
    assert result.exit_code == 0, result.output


def test_validate_names_text_that_is_not_a_manifest(tmp_path: Path) -> None:
    f = tmp_path / "stats.csv"
    f.write_text("key,rate,prompt_tokens\nalice,1.5,3000\n")
    result = runner.invoke(app, ["validate", str(f)])
    assert result.exit_code == 2
    assert "stats.csv#0: not a manifest (an object with apiVersion, kind and metadata): a line of text" in result.output
