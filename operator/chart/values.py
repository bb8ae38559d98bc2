"""The Helm chart's values, typed: the source of `values.schema.json` and of the values table in docs.

Values are grouped by component, as in cert-manager's and kube-prometheus-stack's charts: `crds`,
`operator`, `router`, `engine`, `prometheus`, `monitoring`. The `router` and `engine` groups are the
operator's own configuration models (`cacheroute.operator.config`), so a field added there is a
chart value at once: the chart writes both groups into the operator's `--config` file unchanged.
Every model refuses unknown keys, which Helm's schema check turns into an error naming the key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from cacheroute.operator.config import OPERATOR_IMAGE_REPOSITORY, EngineDefaults, ProfilingDefaults, RouterDefaults
from cacheroute.operator.kubevalues import DNS_SUBDOMAIN, IMAGE_PATTERN, number_as_text

# Kubernetes objects the chart passes through unchanged (resources, affinity, tolerations, ...).
KubeObject = dict[str, Any]


class _Values(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# Helm's `--set operator.image.tag=2` gives the number 2.
ImageTag = Annotated[str, BeforeValidator(number_as_text), WithJsonSchema({"type": ["string", "integer"]})]


class Crds(_Values):
    """The CustomResourceDefinitions InferencePool and AffinityPlan."""

    enabled: bool = Field(
        default=True, description="Install and upgrade the CRDs with the chart (off: apply `crds/` yourself)."
    )
    keep: bool = Field(
        default=True,
        description="Leave the CRDs in the cluster on `helm uninstall` (`helm.sh/resource-policy: keep`): "
        "deleting a CRD deletes every pool and plan.",
    )


class Image(_Values):
    repository: str = Field(default=OPERATOR_IMAGE_REPOSITORY, pattern=IMAGE_PATTERN, description="Image repository.")
    tag: ImageTag = Field(default="", description="Image tag; empty means the chart's appVersion.")
    digest: str = Field(default="", pattern=r"^(sha256:[0-9a-f]{64})?$", description="Pin by digest (wins over tag).")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="imagePullPolicy of the operator's container."
    )


class Watch(_Values):
    """Which namespaces the operator serves."""

    all_namespaces: bool = Field(default=True, description="Serve every namespace (`--all-namespaces`).")
    namespaces: list[str] = Field(
        default_factory=list,
        description="With allNamespaces false: the namespaces to serve (`-n`, each needs a KopfPeering there).",
    )


class Peering(_Values):
    name: str = Field(
        default="cacheroute",
        min_length=1,
        description="kopf peering object of the replicas (ClusterKopfPeering, or a KopfPeering per watched "
        "namespace); the chart creates it.",
    )


class ServiceAccount(_Values):
    create: bool = Field(default=True, description="Create the operator's ServiceAccount.")
    name: str = Field(default="", description="Its name; empty means `<fullname>-operator`.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of the ServiceAccount.")


class Rbac(_Values):
    create: bool = Field(
        default=True,
        description="Create the ClusterRole (rendered from operator/rbac.py) and its ClusterRoleBinding.",
    )


class Probe(_Values):
    initial_delay_seconds: int = Field(default=0, ge=0, description="initialDelaySeconds.")
    period_seconds: int = Field(default=10, ge=1, description="periodSeconds.")
    timeout_seconds: int = Field(default=3, ge=1, description="timeoutSeconds.")
    failure_threshold: int = Field(default=3, ge=1, description="failureThreshold.")


def _liveness() -> Probe:
    return Probe(initial_delay_seconds=10, period_seconds=10, failure_threshold=3)


def _readiness() -> Probe:
    return Probe(initial_delay_seconds=0, period_seconds=5, failure_threshold=3)


class PodDisruptionBudget(_Values):
    enabled: bool = Field(
        default=True,
        description="A PodDisruptionBudget for the operator's pods, rendered only with more than one replica "
        "(with one, any minAvailable would block every node drain).",
    )
    min_available: int = Field(
        default=1, ge=0, description="minAvailable of that budget; below operator.replicas, or drains block."
    )


def _pod_security_context() -> KubeObject:
    return {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context() -> KubeObject:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


class Operator(_Values):
    """The operator's Deployment (`cacheroute operator run`)."""

    replicas: int = Field(
        default=2, ge=1, le=16, description="Replicas; peering (distinct priorities, `--priority auto`) lets one act."
    )
    image: Image = Field(default_factory=Image, description="The cacheroute image.")
    image_pull_secrets: list[KubeObject] = Field(
        default_factory=list, description="imagePullSecrets of the operator's pods, e.g. `[{name: regcred}]`."
    )
    watch: Watch = Field(default_factory=Watch, description="Namespaces served.")
    peering: Peering = Field(default_factory=Peering, description="kopf peering.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="`--log-level`.")
    log_format: Literal["json", "text"] = Field(default="json", description="`--log-format`.")
    resync_interval_seconds: float = Field(
        default=60.0, gt=0, description="`--resync-interval`: seconds between full re-applies (drift repair)."
    )
    status_interval_seconds: float = Field(
        default=5.0, gt=0, description="`--status-interval`: longest time between status refreshes of a pool."
    )
    workers: int = Field(default=16, ge=1, le=256, description="`--workers`: threads for API work.")
    cluster_domain: str = Field(
        default="cluster.local", pattern=DNS_SUBDOMAIN,
        description="DNS domain of Services (the routers' fail-open address).",
    )
    profiling: ProfilingDefaults = Field(
        default_factory=ProfilingDefaults, description="Profiled memory mode's Job (operator configuration file)."
    )
    extra_args: list[str] = Field(default_factory=list, description="More arguments of `cacheroute operator run`.")
    extra_env: list[KubeObject] = Field(default_factory=list, description="More environment variables.")
    resources: KubeObject = Field(
        default_factory=lambda: {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        description="Resources of the operator's container.",
    )
    service_account: ServiceAccount = Field(default_factory=ServiceAccount, description="The operator's identity.")
    rbac: Rbac = Field(default_factory=Rbac, description="The operator's permissions.")
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of the operator's pods.")
    pod_labels: dict[str, str] = Field(default_factory=dict, description="Labels of the operator's pods.")
    pod_security_context: KubeObject = Field(
        default_factory=_pod_security_context, description="Pod securityContext (non-root, seccomp RuntimeDefault)."
    )
    security_context: KubeObject = Field(
        default_factory=_container_security_context,
        description="Container securityContext (read-only root, no privilege escalation, no capabilities).",
    )
    liveness_probe: Probe = Field(default_factory=_liveness, description="Liveness probe on `/healthz`.")
    readiness_probe: Probe = Field(default_factory=_readiness, description="Readiness probe on `/healthz`.")
    termination_grace_period_seconds: int = Field(
        default=30, ge=0, description="Time for a stopping replica to leave the peering."
    )
    pod_disruption_budget: PodDisruptionBudget = Field(
        default_factory=PodDisruptionBudget, description="Disruption budget."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector of the operator's pods.")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Tolerations of the operator's pods.")
    affinity: KubeObject = Field(
        default_factory=dict, description="Affinity; empty means: prefer replicas on different nodes."
    )
    topology_spread_constraints: list[KubeObject] = Field(
        default_factory=list, description="topologySpreadConstraints of the operator's pods."
    )
    priority_class_name: str = Field(default="", description="priorityClassName of the operator's pods.")


class Router(RouterDefaults):
    """Defaults of every pool's router Deployment (the operator's configuration file, `router:`)."""

    image: str = Field(
        default="", pattern=r"^([^\s]+)?$",
        description="Router image; empty means the operator's image (one image, two roles).",
    )


class Engine(EngineDefaults):
    """Defaults of every pool's vLLM pods (the operator's configuration file, `engine:`)."""


class Prometheus(_Values):
    url: str = Field(
        default="",
        description="`--prometheus-url`: the Prometheus of AffinityPlans that name none "
        "(e.g. `http://prometheus-operated.monitoring:9090`).",
    )


class ServiceMonitor(_Values):
    enabled: bool = Field(
        default=False, description="A ServiceMonitor (Prometheus Operator) for the operator's `/metrics`."
    )
    namespace: str = Field(default="", description="Where it is created; empty means the release namespace.")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Labels your Prometheus selects monitors by (e.g. `release: prom`)."
    )
    interval: str = Field(default="30s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Scrape interval.")
    scrape_timeout: str = Field(default="", pattern=r"^([0-9]+(ms|s|m))?$", description="Scrape timeout.")


class PodMonitor(_Values):
    enabled: bool = Field(
        default=False,
        description=(
            "PodMonitors (Prometheus Operator) for every pool's vLLM pods and routers, in the served "
            "namespaces (every namespace with operator.watch.allNamespaces)."
        ),
    )
    namespace: str = Field(default="", description="Where they are created; empty means the release namespace.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels your Prometheus selects monitors by.")
    interval: str = Field(
        default="5s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Scrape interval (plans read rates over windows)."
    )


class Monitoring(_Values):
    scrape_annotations: bool = Field(
        default=True,
        description="`prometheus.io/scrape|port|path` annotations on the operator's pods, for a Prometheus that "
        "discovers annotated pods (vLLM and router pods always carry them).",
    )
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor, description="Operator metrics.")
    pod_monitor: PodMonitor = Field(default_factory=PodMonitor, description="vLLM and router metrics.")


class ChartValues(_Values):
    """Every value of `helm/cacheroute`."""

    name_override: str = Field(default="", description="Replaces the chart name in object names.")
    fullname_override: str = Field(
        default="", alias="fullnameOverride", description="Replaces `<release>-<chart>` in object names."
    )
    common_labels: dict[str, str] = Field(default_factory=dict, description="Labels added to every object.")
    crds: Crds = Field(default_factory=Crds)
    operator: Operator = Field(default_factory=Operator)
    router: Router = Field(default_factory=Router)
    engine: Engine = Field(default_factory=Engine)
    prometheus: Prometheus = Field(default_factory=Prometheus)
    monitoring: Monitoring = Field(default_factory=Monitoring)
