"""The runtime and kwok agree on which pods the runtime runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cacheroute.router import native
from cacheroute.sandbox.binaries import BIN_CACHE_ENV
from cacheroute.sandbox.runtime.images import (
    CACHEROUTE_REPOSITORY,
    ImageDriver,
    default_registry,
    parse_image_option,
    repository,
)
from cacheroute.sandbox.runtime.kwok_stages import logs_crd, pod_stages
from cacheroute.sandbox.runtime.selectors import parse_selector


@pytest.mark.parametrize(
    ("image", "repo"),
    [
        ("vllm/vllm-openai:v0.11.0", "vllm/vllm-openai"),
        ("docker.io/vllm/vllm-openai@sha256:abc", "vllm/vllm-openai"),
        ("ghcr.io/cacheroute/cacheroute:0.1.0", "ghcr.io/cacheroute/cacheroute"),
        ("busybox", "library/busybox"),
        ("localhost:5000/team/img:1", "localhost:5000/team/img"),
    ],
)
def test_image_references_normalise_to_their_repository(image: str, repo: str) -> None:
    assert repository(image) == repo


def pod(*images: str, job: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if job:
        meta["labels"] = {"batch.kubernetes.io/job-name": job}
    return {"metadata": meta, "spec": {"containers": [{"name": f"c{i}", "image": im} for i, im in enumerate(images)]}}


def test_served_pods_are_those_with_a_registered_image_and_no_job() -> None:
    registry = default_registry()
    assert registry.served(pod("vllm/vllm-openai:v0.11.0"))
    assert registry.served(pod("busybox", "ghcr.io/cacheroute/cacheroute:dev"))
    assert not registry.served(pod("busybox"))
    assert not registry.served(pod("vllm/vllm-openai:v0.11.0", job="profile"))
    registry.register(parse_image_option("example.com/tools=/bin/true --flag"))
    assert registry.served(pod("example.com/tools:1"))
    assert registry.driver("example.com/tools:1").entrypoint == ("/bin/true", "--flag")  # type: ignore[union-attr]


def test_kwok_leaves_served_pods_to_the_runtime_and_keeps_its_defaults_for_the_others() -> None:
    predicate = default_registry().kwok_predicate()
    assert "c.image.startsWith('vllm/vllm-openai:')" in predicate
    assert "c.image.startsWith('docker.io/vllm/vllm-openai:')" in predicate
    assert "c.image.startsWith('ghcr.io/cacheroute/cacheroute@')" in predicate
    assert "!('batch.kubernetes.io/job-name' in self.metadata.labels)" in predicate
    stages = {s["metadata"]["name"]: s for s in pod_stages(predicate)}
    assert set(stages) == {"pod-ready", "pod-complete", "pod-delete", "pod-runtime-assign"}

    def cel(stage: str) -> list[str]:
        return [e["cel"]["expression"] for e in stages[stage]["spec"]["selector"]["matchExpressions"] if "cel" in e]

    assert cel("pod-ready") == [f"!({predicate})"]
    assert cel("pod-delete") == [f"!({predicate})"]
    assert cel("pod-runtime-assign") == [predicate]
    assigned = stages["pod-runtime-assign"]["spec"]["next"]["statusTemplate"]
    assert "podIP: {{ PodIPWith" in assigned
    assert "type: Ready, status: \"False\"" in assigned
    # Without a runtime, the stages are kwok's defaults: every pod ready, deleted at once.
    defaults = {s["metadata"]["name"]: s for s in pod_stages(None)}
    assert set(defaults) == {"pod-ready", "pod-complete", "pod-delete"}
    assert not any("cel" in e for s in defaults.values() for e in s["spec"]["selector"]["matchExpressions"])
    assert logs_crd()["spec"]["names"]["plural"] == "logs"


def test_label_selectors() -> None:
    labels = {"app": "web", "tier": "front"}
    assert parse_selector("")(labels)
    assert parse_selector("app=web,tier!=back")(labels)
    assert parse_selector("app in (web, api), !missing, tier")(labels)
    assert not parse_selector("app notin (web)")(labels)
    assert not parse_selector("app==api")(labels)
    with pytest.raises(ValueError, match="not valid"):
        parse_selector("app in web")


def test_the_cacheroute_image_runs_the_sandboxs_compiled_copy_only_when_it_is_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BIN_CACHE_ENV, str(tmp_path))

    def cacheroute_driver() -> ImageDriver:
        driver = default_registry().driver(CACHEROUTE_REPOSITORY)
        assert driver is not None
        return driver

    assert cacheroute_driver().python_paths == {}
    copy = tmp_path / f"router-native-{native.source_digest()}"
    copy.mkdir()
    (copy / native.STAMP).write_text("0" * 16 + "\n")
    assert cacheroute_driver().python_paths == {}, "a copy of other sources is not used"
    (copy / native.STAMP).write_text(native.source_digest() + "\n")
    assert cacheroute_driver().python_paths == {native.IMAGE_PATH: str(copy)}
