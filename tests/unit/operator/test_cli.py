"""The command line a newcomer types."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _manual_plan(destinations: list[str], namespace: str | None = None) -> dict[str, Any]:
    plan: dict[str, Any] = yaml.safe_load((EXAMPLES / "plan-llama-8b-manual.yaml").read_text())
    plan["spec"]["pinned"] = [
        {"key": "tenant-a", "destinations": [destinations[0]]},
        {"key": "tenant-b", "destinations": destinations},
    ]
    if namespace is not None:
        plan["metadata"]["namespace"] = namespace
    return plan


def test_validate_refuses_pins_to_destinations_the_pool_given_beside_does_not_have(tmp_path: Path) -> None:
    # The example pool has 4 replicas: llama-8b-0 to llama-8b-3.
    pool = EXAMPLES / "pool-llama-8b-gie.yaml"
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(_manual_plan(["llama-8b-3", "llama-8b-4", "llama-8b-7"])))
    result = runner.invoke(app, ["validate", str(pool), str(plan)])
    assert result.exit_code == 2
    assert f"ok {pool}#0: InferencePool llama-8b" in result.stdout
    assert (
        "pinned key 'tenant-b' names llama-8b-4, which InferencePool llama-8b does not have "
        "(4 replicas: llama-8b-0 to llama-8b-3) (1 more such destination(s) pinned)"
    ) in result.output
    assert "InvalidPinned" in result.output

    plan.write_text(yaml.safe_dump(_manual_plan(["llama-8b-0", "llama-8b-3"])))
    result = runner.invoke(app, ["validate", str(pool), str(plan)])
    assert result.exit_code == 0, result.output
    assert f"ok {plan}#0: AffinityPlan llama-8b" in result.stdout


def test_validate_checks_pins_against_the_form_of_destination_ids_without_the_pool(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    # Without the pool its size is unknown: any ordinal passes, another pool's or a pod's name does not.
    plan.write_text(yaml.safe_dump(_manual_plan(["llama-8b-9"])))
    alone = runner.invoke(app, ["validate", str(plan)], env={"COLUMNS": "300"})
    assert alone.exit_code == 0
    assert "InferencePool llama-8b is not among the files: pins checked by the form of its ids only" in alone.stdout
    for wrong in ("llama-70b-0", "llama-8b-router", "llama-8b-01", "10.0.0.7:8000"):
        plan.write_text(yaml.safe_dump(_manual_plan([wrong])))
        result = runner.invoke(app, ["validate", str(plan)])
        assert result.exit_code == 2, wrong
        assert f"names {wrong}, which is not a destination of InferencePool llama-8b" in result.output


def test_validate_matches_a_plan_to_a_pool_of_its_namespace_only(tmp_path: Path) -> None:
    pool = yaml.safe_load((EXAMPLES / "pool-llama-8b-gie.yaml").read_text())
    pool["metadata"]["namespace"] = "team-a"
    pool["spec"]["replicas"] = 1
    files = tmp_path / "all.yaml"
    files.write_text(yaml.safe_dump_all([pool, _manual_plan(["llama-8b-2"], namespace="team-b")]))
    assert runner.invoke(app, ["validate", str(files)]).exit_code == 0
    files.write_text(yaml.safe_dump_all([pool, _manual_plan(["llama-8b-2"], namespace="team-a")]))
    result = runner.invoke(app, ["validate", str(files)])
    assert result.exit_code == 2
    assert "(1 replica: llama-8b-0)" in result.output


def test_validate_says_when_it_could_not_check_pins_against_the_pool(tmp_path: Path) -> None:
    pool = yaml.safe_load((EXAMPLES / "pool-llama-8b-gie.yaml").read_text())
    small = {**pool, "spec": {**pool["spec"], "replicas": 3}}
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(_manual_plan(["llama-8b-3"])))
    # Two pools of that name (neither with a namespace): the result must not hang on file order.
    pools = tmp_path / "pools.yaml"
    pools.write_text(yaml.safe_dump_all([pool, small]))
    result = runner.invoke(app, ["validate", str(pools), str(plan)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert f"note: {plan}#0: InferencePool llama-8b is given 2 times ({pools}#0, {pools}#1;" in result.stdout
    # Another pool given, not this plan's.
    other = yaml.safe_load((EXAMPLES / "pool-llama-70b-fp8.yaml").read_text())
    pools.write_text(yaml.safe_dump(other))
    result = runner.invoke(app, ["validate", str(pools), str(plan)], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    assert "InferencePool llama-8b is not among the files: pins checked by the form of its ids only" in result.stdout
