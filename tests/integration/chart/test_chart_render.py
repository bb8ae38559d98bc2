"""The chart renders what the operator and the API server accept, with every documented switch.

`helm lint --strict` and `helm template` run the pinned helm; the output goes to the sandbox API
server as a server-side dry run with strict field validation (schemas, admission, nothing kept).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from cacheroute.operator.api.pool import InferencePool
from cacheroute.operator.chart.values import ChartValues
from cacheroute.operator.cli.main import app
from cacheroute.operator.config import OperatorConfig, load_config
from cacheroute.operator.fleet import names
from cacheroute.operator.fleet.router import build_deployment
from cacheroute.operator.kubevalues import QUANTITY_PATTERN
from cacheroute.operator.rbac import cluster_role
from cacheroute.sandbox.binaries import locate
from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.crds import apply_crds
from tests.support import sandbox as testing
from tests.support.chart import (
    CHART,
    REPO,
    Helm,
    HelmError,
    example_objects,
    prometheus_operator_crds,
    server_side_apply,
)
from tests.support.operator import install_crds

pytestmark = pytest.mark.integration

NS = "__NAMESPACE__"  # replaced by the test's namespace: dry runs need namespaces that exist
# Every switch docs/install.md documents, one at a time (the ci/ files combine them).
SWITCHES: dict[str, dict[str, Any]] = {
    "default": {},
    "crds.enabled=false": {"crds.enabled": False},
    "crds.keep=false": {"crds.keep": False},
    "namespaced": {"operator.watch.allNamespaces": False, "operator.watch.namespaces": [NS]},
    "one replica": {"operator.replicas": 1},
    "existing ServiceAccount": {"operator.serviceAccount.create": False, "operator.serviceAccount.name": "ops"},
    "no RBAC": {"operator.rbac.create": False},
    "no PodDisruptionBudget": {"operator.podDisruptionBudget.enabled": False},
    "prometheus.url": {"prometheus.url": "http://prometheus-operated.monitoring:9090"},
    "no scrape annotations": {"monitoring.scrapeAnnotations": False},
    "ServiceMonitor": {"monitoring.serviceMonitor.enabled": True, "monitoring.serviceMonitor.labels": {"release": "p"}},
    "PodMonitor": {"monitoring.podMonitor.enabled": True, "monitoring.podMonitor.interval": "15s"},
    "PodMonitor namespaced": {"monitoring.podMonitor.enabled": True, "operator.watch.allNamespaces": False,
                              "operator.watch.namespaces": [NS]},
    "image digest": {"operator.image.digest": "sha256:" + "a" * 64},
    "router defaults": {"router.image": "registry.example.com/cacheroute:0.1.0", "router.envoy.failureModeAllow": False,
                        "router.tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
    "engine defaults": {"engine.drainSeconds": 5, "engine.shmSizeLimit": "32Gi"},
    "scheduling": {"operator.nodeSelector": {"kubernetes.io/os": "linux"}, "operator.priorityClassName": "high",
                   "operator.tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
    "overrides": {"fullnameOverride": "cr", "commonLabels": {"team": "inference"},
                  "operator.extraArgs": ["--workers=8"], "operator.extraEnv": [{"name": "X", "value": "1"}]},
}
CI_FILES = sorted((CHART / "ci").glob("*.yaml"))


def with_namespace(values: dict[str, Any], namespace: str) -> dict[str, Any]:
    return {k: ([namespace if x == NS else x for x in v] if isinstance(v, list) else v) for k, v in values.items()}


@pytest.fixture(scope="module")
def helm() -> Helm:
    return Helm()


@pytest.fixture(scope="module")
def cluster_crds(sandbox: Sandbox) -> Iterator[None]:
    """Our CRDs and kopf's (as a user who applied crds/), and the Prometheus Operator's monitors."""
    install_crds(sandbox)
    monitors = prometheus_operator_crds()
    apply_crds(sandbox.api_client(), monitors)
    yield
    from kubernetes import client

    api = client.ApiextensionsV1Api(sandbox.api_client())
    for crd in monitors:
        with contextlib.suppress(client.ApiException):
            api.delete_custom_resource_definition(crd["metadata"]["name"])


@pytest.fixture(scope="module")
def dry_run_namespace(sandbox: Sandbox) -> Iterator[str]:
    with testing.fresh_namespace(sandbox, "chart-dry-run") as name:
        yield name


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_lint_passes_with_every_switch(helm: Helm, switch: str) -> None:
    helm.lint(with_namespace(SWITCHES[switch], "llm"))


def _default(path: str) -> Any:
    value: Any = ChartValues().model_dump(by_alias=True)
    for part in path.split("."):
        value = value[part]
    return value


def test_every_documented_switch_is_linted_and_dry_run_both_ways() -> None:
    """Each boolean of docs/install.md's values table is turned from its default by some case above."""
    documented = re.findall(r"^\| `([\w.]+)` \| boolean \|", (REPO / "docs" / "install.md").read_text(), re.MULTILINE)
    assert len(documented) >= 10
    untested = [path for path in documented
                if all(values.get(path, _default(path)) == _default(path) for values in SWITCHES.values())]
    assert untested == [], "add a case to SWITCHES"


@pytest.mark.parametrize("values_file", CI_FILES, ids=[p.name for p in CI_FILES])
def test_lint_passes_with_every_ci_values_file(helm: Helm, values_file: Path) -> None:
    helm.lint(files=[values_file])


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_the_api_server_accepts_the_rendered_chart(
    helm: Helm, sandbox: Sandbox, cluster_crds: None, dry_run_namespace: str, switch: str
) -> None:
    values = with_namespace(SWITCHES[switch], dry_run_namespace)
    objects = helm.template("dry", dry_run_namespace, values)
    assert {"Deployment", "ConfigMap"} <= {o["kind"] for o in objects}
    assert server_side_apply(sandbox.api_client(), objects, dry_run=True) == []


def test_the_schema_refuses_wrong_types_and_unknown_keys(helm: Helm) -> None:
    cases = {
        "operator.replicas": ("two", "at '/operator/replicas': got string, want integer"),
        "router.envoy.failureModeAllow": ("maybe", "at '/router/envoy/failureModeAllow': got string, want boolean"),
        "operator.replica": (2, "at '/operator': additional properties 'replica' not allowed"),
        "operator.logLevel": ("loud", "at '/operator/logLevel'"),
        "router.image": ("a b", "at '/router/image'"),
        "operator.clusterDomain": ("not a domain", "at '/operator/clusterDomain'"),
        "operator.image.repository": ("a b", "at '/operator/image/repository'"),
    }
    for path, (value, message) in cases.items():
        with pytest.raises(HelmError) as failed:
            helm.template("bad", "default", {path: value})
        assert "values don't meet the specifications of the schema" in str(failed.value)
        assert message in str(failed.value), path


def test_a_watch_list_that_cannot_work_is_refused_with_the_reason(helm: Helm) -> None:
    with pytest.raises(HelmError, match=r"operator\.watch\.namespaces must name at least one namespace"):
        helm.template("bad", "default", {"operator.watch.allNamespaces": False})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"router.drainSeconds": 130}, "router.drainSeconds (130) must be shorter than router.terminationGracePeriod"),
        ({"engine.drainSeconds": 200}, "engine.drainSeconds (200) must be shorter than engine.terminationGracePeriod"),
        ({"router.resources": {"requests": {"cpu": "banana"}}}, 'router.resources.requests.cpu "banana" is not a'),
        ({"router.envoy.resources": {"limits": {"memory": "-1Gi"}}}, 'router.envoy.resources.limits.memory "-1Gi"'),
        ({"operator.podDisruptionBudget.minAvailable": 2},
         "operator.podDisruptionBudget.minAvailable (2) must be below operator.replicas (2): no node could ever"),
    ],
)
def test_defaults_the_operator_would_refuse_are_refused_at_render(
    helm: Helm, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(HelmError) as failed:
        helm.template("bad", "default", values)
    assert message in str(failed.value)


def test_whole_numbers_given_with_set_are_quantities_and_tags(helm: Helm, tmp_path: Path) -> None:
    # `helm --set engine.cpuRequest=8` passes the number 8, as --set-json does here.
    objects = helm.template("n", "default", {"engine.cpuRequest": 8, "engine.memoryRequest": 68719476736,
                                             "operator.image.tag": 2, "router.resources": {"requests": {"cpu": 0.5}}})
    config = _operator_config(objects, tmp_path)
    assert (config.engine.cpu_request, config.engine.memory_request) == ("8", "68719476736")
    assert config.router.resources["requests"]["cpu"] == 0.5
    assert config.router.image == "ghcr.io/cacheroute/cacheroute:2"


def test_the_charts_quantity_check_is_the_operators(helm: Helm) -> None:
    template = (CHART / "templates" / "_helpers.tpl").read_text()
    found = re.search(r'regexMatch "((?:[^"\\]|\\.)*)"', template)
    assert found is not None
    assert found.group(1).replace("\\\\", "\\") == QUANTITY_PATTERN


def _of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_the_chart_installs_the_repository_crds_and_keeps_them(helm: Helm) -> None:
    committed = {}
    for path in (REPO / "crds").glob("cacheroute.dev_*.yaml"):
        crd = yaml.safe_load(path.read_text())
        committed[crd["metadata"]["name"]] = crd
    for keep in (True, False):
        rendered = _of_kind(helm.template("r", "default", {"crds.keep": keep}), "CustomResourceDefinition")
        assert sorted(c["metadata"]["name"] for c in rendered) == sorted(committed)
        for crd in rendered:
            assert crd["spec"] == committed[crd["metadata"]["name"]]["spec"]
            assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
            annotations = crd["metadata"].get("annotations") or {}
            assert (annotations.get("helm.sh/resource-policy") == "keep") is keep
    assert not _of_kind(helm.template("r", "default", {"crds.enabled": False}), "CustomResourceDefinition")


def test_the_cluster_role_is_the_operators_permission_list(helm: Helm) -> None:
    [role] = _of_kind(helm.template("r", "default"), "ClusterRole")
    assert role["rules"] == cluster_role()["rules"]
    [binding] = _of_kind(helm.template("r", "default"), "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "r-cacheroute-operator", "namespace": "default"}]


def test_the_operator_runs_hardened_with_peering_and_its_config(helm: Helm) -> None:
    objects = helm.template("cacheroute", "ops", {"prometheus.url": "http://prom:9090"})
    [deployment] = _of_kind(objects, "Deployment")
    assert deployment["metadata"]["name"] == "cacheroute-operator"
    spec = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = spec["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["image"] == "ghcr.io/cacheroute/cacheroute:0.1.0"
    args = container["args"]
    assert args[:3] == ["operator", "run", "--all-namespaces"]
    assert {"--priority=auto", "--peering=cacheroute", "--health-address=$(POD_IP):8080",
            "--config=/etc/cacheroute/operator.yaml", "--prometheus-url=http://prom:9090"} <= set(args)
    env = {e["name"]: e.get("valueFrom") for e in container["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    [peering] = _of_kind(objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "cacheroute"


def test_the_pod_monitors_select_the_pools_pods_and_label_series_with_their_pool(helm: Helm) -> None:
    objects = helm.template("r", "default", {"monitoring.podMonitor.enabled": True})
    specs = [m["spec"] for m in _of_kind(objects, "PodMonitor")]
    monitors = {spec["selector"]["matchLabels"][names.COMPONENT]: spec for spec in specs}
    assert set(monitors) == {"engine", "router"}
    pool = names.PoolRef("llama", "llm", "uid")
    for component, spec in monitors.items():
        pod_labels = names.labels(pool, component)
        assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
        # Each pod label named here becomes a label of every series scraped from the pod.
        assert [pod_labels[label] for label in spec["podTargetLabels"]] == ["llama"]


def _operator_config(objects: list[dict[str, Any]], directory: Path) -> OperatorConfig:
    """The operator's configuration, read from the rendered ConfigMap as the operator reads its file."""
    [configmap] = _of_kind(objects, "ConfigMap")
    path = directory / "operator.yaml"
    path.write_text(configmap["data"]["operator.yaml"])
    return load_config(path)


def test_router_defaults_reach_the_operator_config(helm: Helm, tmp_path: Path) -> None:
    default = _operator_config(helm.template("r", "default"), tmp_path)
    assert default.router.image == "ghcr.io/cacheroute/cacheroute:0.1.0"  # the operator's own image
    assert default.router.envoy.failure_mode_allow is True
    changed = _operator_config(helm.template("r", "default", {
        "router.envoy.failureModeAllow": False, "router.envoy.routeTimeout": "120s",
        "operator.image.tag": "0.2.0", "engine.drainSeconds": 7,
    }), tmp_path)
    assert changed.router.image == "ghcr.io/cacheroute/cacheroute:0.2.0"
    assert changed.router.envoy.failure_mode_allow is False
    assert changed.router.envoy.route_timeout == "120s"
    assert changed.engine.drain_seconds == 7


@pytest.mark.parametrize("failure_mode_allow", [True, False])
def test_the_routers_envoy_bootstrap_passes_envoy_validate(
    helm: Helm, tmp_path: Path, failure_mode_allow: bool
) -> None:
    """The chart's Envoy settings, through the operator's router Deployment, to `envoy --mode validate`."""
    values = {"router.envoy.failureModeAllow": failure_mode_allow}
    config = _operator_config(helm.template("r", "default", values), tmp_path)
    pool = InferencePool.model_validate(yaml.safe_load((REPO / "examples" / "pool-llama-70b-fp8.yaml").read_text()))
    ref = names.PoolRef(pool.metadata.name, "llm", "uid")
    deployment = build_deployment(ref, pool.spec, config)
    [envoy] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "envoy"]
    # The kubelet expands $(POD_IP); any address serves for validation.
    args = [a.replace("$(POD_IP)", "10.4.1.7") for a in envoy["args"]]
    assert ("--failure-mode-allow" in args) is failure_mode_allow
    printed = CliRunner().invoke(app, [*args, "--print"])
    assert printed.exit_code == 0, printed.output
    bootstrap = tmp_path / "envoy.yaml"
    bootstrap.write_text(printed.stdout)
    validated = subprocess.run(
        [str(locate("envoy").path), "--mode", "validate", "-c", str(bootstrap), "--log-level", "error"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert validated.returncode == 0, validated.stdout + validated.stderr


def test_the_examples_pass_a_server_side_dry_run(sandbox: Sandbox, cluster_crds: None, dry_run_namespace: str) -> None:
    objects = example_objects(dry_run_namespace)
    assert {o["kind"] for o in objects} == {"InferencePool", "AffinityPlan"}
    assert server_side_apply(sandbox.api_client(), objects, dry_run=True) == []
