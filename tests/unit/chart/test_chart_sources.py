"""Every generated file of the chart and of the docs matches its one source in the code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from cacheroute.operator.api.reference import crd_reference
from cacheroute.operator.chart import files, reference
from cacheroute.operator.chart.values import ChartValues

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "cacheroute"


def test_generated_chart_files_match_their_sources() -> None:
    assert files.stale_files(CHART) == [], "run `make chart`"


def test_the_charts_crds_are_the_repository_crds_byte_for_byte() -> None:
    for copy in (CHART / "files" / "crds").glob("*.yaml"):
        assert copy.read_bytes() == (REPO / "crds" / copy.name).read_bytes(), copy.name
    peering = "kopf.dev_peerings.yaml"
    assert (CHART / "crds" / peering).read_bytes() == (REPO / "crds" / peering).read_bytes()
    assert sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml")) == sorted(
        p.name for p in (REPO / "crds").glob("cacheroute.dev_*.yaml")
    )


def test_values_yaml_holds_exactly_the_typed_defaults() -> None:
    written = yaml.safe_load((CHART / "values.yaml").read_text())
    assert ChartValues.model_validate(written) == ChartValues()
    # Every key is spelled out, so values.yaml doubles as the list of what can be set.
    assert set(written) == set(ChartValues().model_dump(by_alias=True))


def test_every_default_in_the_values_schema_is_the_one_values_yaml_holds() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text("utf-8"))
    checked = 0

    def walk(node: dict[str, object], value: object, path: str) -> None:
        nonlocal checked
        if "default" in node and not isinstance(node.get("properties"), dict):
            assert node["default"] == value, path
            checked += 1
        for name, child in dict(node.get("properties") or {}).items():  # type: ignore[call-overload]
            if isinstance(value, dict) and name in value:
                walk(child, value[name], f"{path}.{name}")

    walk(files.values_schema(), values, "values")
    # The probes' own defaults (liveness waits 10 s, readiness every 5 s) among them.
    assert checked > 50


def test_values_table_and_crd_reference_are_current() -> None:
    assert not reference.stale_values_table(REPO / "docs" / "install.md"), "run `make chart`"
    assert (REPO / "docs" / "crds.md").read_text() == crd_reference(), "run `make crds`"


def test_chart_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


def test_the_image_installs_every_package_folder_and_runs_unprivileged() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, flags=re.MULTILINE))
    assert copied == folders
    assert '".[router]"' in dockerfile  # Envoy for the router pod comes from the router extra
    [user] = re.findall(r"^USER (\S+)$", dockerfile, flags=re.MULTILINE)
    assert all(part.isdigit() and int(part) != 0 for part in user.split(":"))
    assert re.search(r'^ENTRYPOINT \["cacheroute"\]$', dockerfile, flags=re.MULTILINE)


def test_the_paths_the_docs_and_the_charts_notes_name_exist() -> None:
    """A user copies these commands: every `examples/...`, `helm/...` or `docs/...` path they name is there."""
    sources = [CHART / "templates" / "NOTES.txt", REPO / "README.md", REPO / "examples" / "README.md",
               *(REPO / "docs" / name for name in ("install.md", "operations.md", "crds.md"))]
    named = {(source.name, path.rstrip(".")) for source in sources
             for path in re.findall(r"(?<![\w/.])(?:examples|helm|docs)/[\w./-]*[\w/]", source.read_text())}
    missing = sorted(f"{source}: {path}" for source, path in named if not (REPO / path).exists())
    assert missing == []
