"""The operator's configuration file (`--config FILE`, mounted from the Helm chart's ConfigMap).

Defaults for what the InferencePool spec does not say: the router's image, resources and
scheduling, Envoy's settings, and the engine pod's shared-memory size, drain time and probes.
Every field has a default, so an empty file (or none) is a valid configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from cacheroute.operator.api.manifests import single_document
from cacheroute.operator.kubevalues import DnsSubdomain, Image, PositiveDuration, ProbePath, Quantity, Resources
from cacheroute.operator.version import package_version

OPERATOR_IMAGE_REPOSITORY = "ghcr.io/cacheroute/cacheroute"


def default_operator_image() -> str:
    """The cacheroute image of this release: the operator runs it, and so does the router."""
    version = package_version()
    tag = version if "+" not in version else "latest"
    return f"{OPERATOR_IMAGE_REPOSITORY}:{tag}"


def _check_drain(drain_seconds: int, grace_seconds: int) -> None:
    if drain_seconds >= grace_seconds:
        raise ValueError(
            f"drainSeconds ({drain_seconds}) must be shorter than terminationGracePeriodSeconds ({grace_seconds}): "
            "the kubelet kills the pod when its grace period ends, drained or not"
        )


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class EnvoySettings(_Model):
    """The Envoy beside the endpoint picker in each router pod."""

    failure_mode_allow: bool = Field(
        default=True,
        description="When the picker does not answer, send the request to any ready engine instead of failing it "
        "(found through the pool's headless Service, by cluster DNS).",
    )
    message_timeout: PositiveDuration = Field(
        default="5s",
        description="How long Envoy waits for each answer of the picker (more than 0).",
    )
    request_body_mode: Literal["NONE", "BUFFERED", "FULL_DUPLEX_STREAMED"] = Field(
        default="BUFFERED", description="How request bodies reach the picker (it reads the key from the body)."
    )
    route_timeout: str = Field(
        default="600s", pattern=r"^[0-9]+(ms|s)$", description="Longest request, streaming included."
    )
    max_request_bytes: int = Field(
        # The router's defaults and bounds (cacheroute.router.envoy), which the operator may not import.
        default=16 << 20,
        ge=1 << 20,
        le=64 << 20,
        description="Largest request body Envoy holds for the picker (BUFFERED); a larger one gets 413 from "
        "Envoy. The picker reads the key from the first MiB; past it p2c routes.",
    )
    concurrency: int = Field(default=2, ge=1, le=64, description="Envoy worker threads.")
    log_level: Literal["trace", "debug", "info", "warning", "error", "critical", "off"] = Field(
        default="warning", description="Envoy's log level."
    )
    resources: Resources = Field(
        default_factory=lambda: {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        description="Resources of the Envoy container.",
    )


class RouterDefaults(_Model):
    """The router Deployment of every pool."""

    image: Image = Field(default_factory=default_operator_image, description="Router image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="imagePullPolicy of both router containers."
    )
    resources: Resources = Field(
        default_factory=lambda: {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        description="Resources of the endpoint picker container.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector of router pods.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations of router pods.")
    scrape_interval_seconds: float = Field(
        default=0.5, ge=0, description="How often the picker scrapes each vLLM pod's queue depth (0: never)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Picker log level.")
    drain_seconds: int = Field(
        default=5, ge=0,
        description="A stopping router serves this long before it drains, while clients stop choosing it.",
    )
    termination_grace_period_seconds: int = Field(
        default=130, ge=1,
        description="Room for the drain plus the longest request in flight (streams pass through the router).",
    )
    envoy: EnvoySettings = Field(default_factory=EnvoySettings, description="The Envoy container.")

    @model_validator(mode="after")
    def _drain_within_grace(self) -> Self:
        _check_drain(self.drain_seconds, self.termination_grace_period_seconds)
        return self


class EngineDefaults(_Model):
    """Settings of the vLLM pods that the pool spec leaves to the cluster operator."""

    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="imagePullPolicy of the vLLM container."
    )
    shm_size_limit: Quantity = Field(default="16Gi", description="Size limit of the /dev/shm memory volume.")
    drain_seconds: int = Field(
        default=30, ge=0, description="preStop wait, so that routers stop sending before vLLM gets SIGTERM."
    )
    termination_grace_period_seconds: int = Field(
        default=130, ge=1, description="Room for the drain plus the longest request in flight."
    )
    readiness_path: ProbePath = Field(default="/v1/models", description="Answers only once the model is served.")
    liveness_path: ProbePath = Field(default="/health", description="Liveness (and startup) probe path.")
    probe_period_seconds: int = Field(
        default=10, ge=1, description="Period of the vLLM probes (readiness: this or 5 s, whichever is shorter)."
    )
    cpu_request: Quantity = Field(default="4", description="CPU request of a vLLM pod.")
    memory_request: Quantity = Field(default="32Gi", description="Memory request of a vLLM pod.")

    @model_validator(mode="after")
    def _drain_within_grace(self) -> Self:
        _check_drain(self.drain_seconds, self.termination_grace_period_seconds)
        return self


class ProfilingDefaults(_Model):
    """The profiling Job of Profiled memory mode."""

    log_wait_seconds: float = Field(
        default=120.0, ge=0, description="How long after the Job ends its log may still be unreadable."
    )


class OperatorConfig(_Model):
    cluster_domain: DnsSubdomain = "cluster.local"
    router: RouterDefaults = Field(default_factory=RouterDefaults)
    engine: EngineDefaults = Field(default_factory=EngineDefaults)
    profiling: ProfilingDefaults = Field(default_factory=ProfilingDefaults)


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and the field."""


def load_config(path: Path | None) -> OperatorConfig:
    if path is None:
        return OperatorConfig()
    try:
        with path.open(encoding="utf-8") as stream:
            document = single_document(stream)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config {path}: cannot read it ({' '.join(str(exc).split())})") from exc
    if document is None:
        return OperatorConfig()
    if not isinstance(document, dict):
        raise ConfigError(f"config {path}: expected a mapping, got {type(document).__name__}")
    try:
        return OperatorConfig.model_validate(document)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {_message(e['msg'])}" if e["loc"] else _message(e["msg"])
            for e in exc.errors()
        )
        raise ConfigError(f"config {path}: {problems}") from exc


def _message(text: str) -> str:
    # pydantic heads the message of a failed check with its kind; the check's own words suffice.
    return text.removeprefix("Value error, ")
