"""The manifests in examples/ are valid, and the Manual plan is what `cacheroute plan -o yaml` writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cacheroute.operator.api.manifests import load_manifests
from cacheroute.operator.api.plan import AffinityPlan
from cacheroute.operator.api.pool import InferencePool
from cacheroute.operator.cli.main import app

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_passes_validate(path: Path) -> None:
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok ")


def test_examples_cover_the_documented_cases() -> None:
    objects = [obj for path in EXAMPLES for obj in load_manifests(path.read_text(), str(path))]
    pools = {o.metadata.name: o for o in objects if isinstance(o, InferencePool)}
    plans = [o for o in objects if isinstance(o, AffinityPlan)]
    llama = pools["llama-70b"].spec
    assert (llama.model.name, llama.model.quantization, llama.tensor_parallel_size) == (
        "meta-llama/Llama-3.3-70B-Instruct", "fp8", 2
    )
    assert llama.gpu.product == "NVIDIA-H100-80GB-HBM3"
    assert any(p.spec.gie.enabled for p in pools.values())
    assert {p.spec.mode for p in plans} == {"Auto", "Manual"}
    # Each plan names a pool of the examples, and no pool has two publishing plans.
    assert sorted(p.spec.pool_ref.name for p in plans) == sorted(set(p.spec.pool_ref.name for p in plans))
    assert {p.spec.pool_ref.name for p in plans} <= set(pools)
    # Pinned destinations are destinations the pool has.
    for plan in plans:
        pool = pools[plan.spec.pool_ref.name]
        ids = {f"{pool.metadata.name}-{i}" for i in range(pool.spec.replicas)}
        assert {d for route in plan.spec.pinned for d in route.destinations} <= ids


def test_the_manual_plan_is_the_output_of_the_command_in_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the command's paths are relative to the repository
    path = REPO / "examples" / "plan-llama-8b-manual.yaml"
    text = path.read_text()
    # The command as written in the file's comment (continuation lines joined).
    comment = "\n".join(line[1:] for line in text.splitlines() if line.startswith("#"))
    command = re.search(r"^\s+cacheroute (plan [^\n]*)", comment.replace("\\\n", " "), flags=re.MULTILINE)
    assert command, "the header names the command"
    argv = shlex.split(command.group(1))
    out = tmp_path / "plan.yaml"
    argv[argv.index("--out") + 1] = str(out)
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(text) == yaml.safe_load(out.read_text())
    assert yaml.safe_load(text)["spec"]["mode"] == "Manual"
