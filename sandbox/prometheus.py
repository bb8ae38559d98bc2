"""The sandbox's Prometheus: its command line, and a handle to add scrape jobs and query it.

The configuration file in the state directory is the source of truth: adding a job rewrites it
(under a file lock, so several processes may share one sandbox) and asks Prometheus to reload,
which answers only once the new configuration is applied.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

SCRAPE_INTERVAL = "1s"
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass(frozen=True)
class ScrapeJob:
    """A static scrape job: Prometheus pulls `metrics_path` from every target (`host:port`)."""

    name: str
    targets: Sequence[str]
    metrics_path: str = "/metrics"
    interval: str = SCRAPE_INTERVAL
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _JOB_NAME.match(self.name):
            raise ValueError(f"scrape job name {self.name!r} must match {_JOB_NAME.pattern}")
        if not self.targets:
            raise ValueError(f"scrape job {self.name!r} needs at least one target")
        for target in self.targets:
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"scrape target {target!r} of job {self.name!r} is not host:port")

    def to_config(self) -> dict[str, Any]:
        static: dict[str, Any] = {"targets": list(self.targets)}
        if self.labels:
            static["labels"] = dict(self.labels)
        return {
            "job_name": self.name,
            "scrape_interval": self.interval,
            "scrape_timeout": self.interval,
            "metrics_path": self.metrics_path,
            "static_configs": [static],
        }


POD_JOB = "kubernetes-pods"


@dataclass(frozen=True)
class KubernetesAccess:
    """Where Prometheus finds the API server for pod discovery, and who it is there."""

    api_server: str
    ca_file: str
    cert_file: str
    key_file: str


def pod_discovery_job(access: KubernetesAccess) -> dict[str, Any]:
    """Scrape every pod annotated `prometheus.io/scrape: "true"` on its `prometheus.io/port` and path.

    Targets are the pod IP and the annotated port; series carry `namespace` and `pod` labels. Only
    Running pods are scraped. Discovery reads pods with the sandbox's credentials.
    """
    return {
        "job_name": POD_JOB,
        "scrape_interval": SCRAPE_INTERVAL,
        "scrape_timeout": SCRAPE_INTERVAL,
        "kubernetes_sd_configs": [
            {
                "role": "pod",
                "api_server": access.api_server,
                "tls_config": {
                    "ca_file": access.ca_file,
                    "cert_file": access.cert_file,
                    "key_file": access.key_file,
                },
            }
        ],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "action": "keep",
             "regex": "true"},
            {"source_labels": ["__meta_kubernetes_pod_phase"], "action": "keep", "regex": "Running"},
            {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"], "action": "replace",
             "regex": "(.+)", "target_label": "__metrics_path__"},
            {"source_labels": ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
             "action": "replace", "regex": "([^:]+)(?::\\d+)?;(\\d+)", "replacement": "$1:$2",
             "target_label": "__address__"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }


def base_config(self_address: str, kubernetes: KubernetesAccess | None = None) -> dict[str, Any]:
    jobs = [ScrapeJob("prometheus", [self_address]).to_config()]
    if kubernetes is not None:
        jobs.append(pod_discovery_job(kubernetes))
    return {
        "global": {
            "scrape_interval": SCRAPE_INTERVAL,
            "scrape_timeout": SCRAPE_INTERVAL,
            "evaluation_interval": SCRAPE_INTERVAL,
        },
        "scrape_configs": jobs,
    }


def command_line(binary: Path, *, config: Path, data: Path, port: int) -> list[str]:
    return [
        str(binary),
        f"--config.file={config}",
        f"--storage.tsdb.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
        "--web.enable-remote-write-receiver",
        "--storage.tsdb.retention.time=1d",
    ]


class PrometheusError(RuntimeError):
    """Prometheus refused a configuration or a query."""


class Prometheus:
    """A handle on a running sandbox Prometheus."""

    def __init__(self, url: str, config_path: Path) -> None:
        self.url = url.rstrip("/")
        self.config_path = config_path

    @property
    def remote_write_url(self) -> str:
        return f"{self.url}/api/v1/write"

    def ready(self) -> bool:
        return httpx.get(f"{self.url}/-/ready", timeout=2.0).status_code == 200

    @contextlib.contextmanager
    def _locked_config(self) -> Iterator[dict[str, Any]]:
        lock = self.config_path.with_suffix(".lock")
        with lock.open("w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            document: dict[str, Any] = yaml.safe_load(self.config_path.read_text())
            yield document
            staged = self.config_path.with_suffix(".tmp")
            staged.write_text(yaml.safe_dump(document, sort_keys=False))
            os.replace(staged, self.config_path)
            self.reload()

    def scrape_jobs(self) -> list[str]:
        document = yaml.safe_load(self.config_path.read_text())
        return [job["job_name"] for job in document.get("scrape_configs") or []]

    def add_scrape_job(self, job: ScrapeJob) -> None:
        """Add `job` (replacing a job of the same name) and apply it."""
        with self._locked_config() as document:
            jobs = [j for j in document.get("scrape_configs") or [] if j["job_name"] != job.name]
            jobs.append(job.to_config())
            document["scrape_configs"] = jobs

    def remove_scrape_job(self, name: str) -> None:
        with self._locked_config() as document:
            document["scrape_configs"] = [j for j in document.get("scrape_configs") or [] if j["job_name"] != name]

    def reload(self) -> None:
        response = httpx.post(f"{self.url}/-/reload", timeout=30.0)
        if response.status_code != 200:
            raise PrometheusError(f"Prometheus rejected {self.config_path}: {response.text.strip()}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query; the `result` list of Prometheus' answer."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10.0)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"query {promql!r} failed: {body.get('error', response.text)}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(
        self,
        promql: str,
        *,
        timeout: float = 30.0,
        accept: Callable[[list[dict[str, Any]]], bool] = bool,
    ) -> list[dict[str, Any]]:
        """Repeat `promql` until `accept(result)` (default: non-empty), or fail after `timeout`."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if accept(result):
                return result
            time.sleep(0.2)
        raise PrometheusError(f"query {promql!r} did not give an accepted result in {timeout:.0f}s: {result}")

    def targets_health(self, job: str) -> list[str]:
        """The health (`up`, `down`, `unknown`) of each active target of `job`."""
        body = httpx.get(f"{self.url}/api/v1/targets", params={"state": "active"}, timeout=10.0).json()
        return [t["health"] for t in body["data"]["activeTargets"] if t["labels"].get("job") == job]
