"""`cacheroute operator run`: bad input is one line and exit status 2; flags also come from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cacheroute.operator import runtime
from cacheroute.operator.cli.main import app
from tests.support.operator import decoy_kubeconfig

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["-n", "a", "-A"], {}, "not both"),
        ([], {}, "--all-namespaces"),
        (["-A", "--priority", "high"], {}, "priority 'high'"),
        (["-A"], {"CACHEROUTE_OPERATOR_PRIORITY": "high"}, "priority 'high'"),
        (["-A", "--health-address", "8080"], {}, "health-address"),
        (["-A", "--log-level", "loud"], {}, "log-level"),
        (["-A", "--resync-interval", "0"], {}, "resync-interval"),
        (["-A", "--peering-annotation", "no-equals-sign"], {}, "peering-annotation 'no-equals-sign'"),
        (["-A"], {"CACHEROUTE_OPERATOR_PEERING_LABEL": "a=b =c"}, "peering-label '=c'"),
        (["-A", "--log-format", "xml"], {}, "log-format 'xml' is not json or text"),
    ],
)
def test_bad_options_exit_2_with_one_line(args: list[str], env: dict[str, str], words: str) -> None:
    result = runner.invoke(app, ["operator", "run", *args], env=env)
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_a_bad_config_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    config = tmp_path / "operator.yaml"
    config.write_text("router:\n  envoy:\n    failureModeAllow: maybe\n")
    result = runner.invoke(app, ["operator", "run", "-A", "--config", str(config)])
    assert result.exit_code == 2
    assert str(config) in result.output and "failureModeAllow" in result.output


def test_env_selects_namespaces(tmp_path: Path) -> None:
    # Reaching the kubeconfig check means namespaces, priority and address came from the environment.
    env = {"CACHEROUTE_OPERATOR_NAMESPACE": "a b", "CACHEROUTE_OPERATOR_PRIORITY": "7",
           "CACHEROUTE_OPERATOR_KUBECONFIG": str(tmp_path / "missing")}
    result = runner.invoke(app, ["operator", "run"], env=env)
    assert result.exit_code == 2 and "kubeconfig" in result.output


def test_a_kubeconfig_without_a_context_is_bad_input_and_an_api_server_away_is_the_world(tmp_path: Path) -> None:
    no_context = tmp_path / "no-context.yaml"
    no_context.write_text("apiVersion: v1\nkind: Config\n")
    result = runner.invoke(app, ["operator", "run", "-A", "--kubeconfig", str(no_context)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: kubeconfig: ") and "current-context" in result.output
    away = decoy_kubeconfig(tmp_path)
    result = runner.invoke(app, ["operator", "run", "-A", "--kubeconfig", str(away), "--health-address", "127.0.0.1:0"])
    assert result.exit_code == 1, result.output
    assert "error: operator failed: cannot reach the API server" in result.output
    assert "internal error" not in result.output and "port=1" in result.output


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [\n", "is not a kubeconfig (while parsing a flow node"),
        ("- a\n- b\n", "is not a kubeconfig (list indices must be integers"),
        ("apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: c, cluster: {}}]\n"
         "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n",
         "its current context's cluster names no server"),
    ],
)
def test_a_file_that_is_no_kubeconfig_is_bad_input_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kubeconfig.yaml"
    path.write_text(text)
    result = runner.invoke(app, ["operator", "run", "-A", "--kubeconfig", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: kubeconfig: {path}") and message in result.output


def test_log_level_and_format_are_read_in_any_case(tmp_path: Path) -> None:
    no_context = tmp_path / "no-context.yaml"
    no_context.write_text("apiVersion: v1\nkind: Config\n")
    result = runner.invoke(app, ["operator", "run", "-A", "--log-level", "DEBUG", "--log-format", "TEXT",
                                 "--kubeconfig", str(no_context)])
    # Past the options: what is refused is the kubeconfig.
    assert result.exit_code == 2 and result.output.startswith("error: kubeconfig: "), result.output


def test_auto_priorities_differ_and_numbers_are_kept() -> None:
    assert len({runtime.parse_priority("auto") for _ in range(20)}) == 20
    assert runtime.parse_priority("150") == 150


def test_scope_is_a_namespace_list_or_everything() -> None:
    assert runtime.namespaces_or_all(["a", "b", "a"], False) == (("a", "b"), False)
    assert runtime.namespaces_or_all([], True) == ((), True)


def test_peering_metadata_pairs_come_from_options_or_a_space_separated_env_list() -> None:
    assert runtime.parse_pairs("peering-label", ["app.kubernetes.io/managed-by=Helm"]) == {
        "app.kubernetes.io/managed-by": "Helm"
    }
    pairs = runtime.parse_pairs("peering-annotation", ["meta.helm.sh/release-name=r meta.helm.sh/release-namespace=ns"])
    assert pairs == {"meta.helm.sh/release-name": "r", "meta.helm.sh/release-namespace": "ns"}
    assert runtime.parse_pairs("peering-label", ["empty="]) == {"empty": ""}
