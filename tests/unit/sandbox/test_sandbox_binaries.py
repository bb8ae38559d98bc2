"""Locating and pinning the sandbox's programs, without building anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheroute.sandbox import binaries
from cacheroute.sandbox.binaries import (
    GO_COMPONENTS,
    BinaryNotFoundError,
    ModuleFacts,
    env_override_name,
    locate,
)

KUBERNETES_GOMOD = """module k8s.io/kubernetes

go 1.24.0

godebug default=go1.24

require (
\tk8s.io/api v0.0.0
\tk8s.io/client-go v0.0.0
\tgithub.com/kylelemons/godebug v1.1.0 // indirect
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tgithub.com/example/fork => github.com/example/fork v1.2.3
)
"""


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [*GO_COMPONENTS, *binaries.OTHER_PROGRAMS]:
        monkeypatch.delenv(env_override_name(name), raising=False)
    monkeypatch.delenv(binaries.ASSETS_ENV, raising=False)
    monkeypatch.setenv(binaries.BIN_CACHE_ENV, str(tmp_path / "cache"))


def test_versions_are_one_kubernetes_minor_and_etcd_3_5() -> None:
    kube = {c.version for c in GO_COMPONENTS.values() if c.module == "k8s.io/kubernetes"}
    assert len(kube) == 1
    major, minor, _ = next(iter(kube)).lstrip("v").split(".")
    assert (int(major), int(minor)) >= (1, 33)
    assert GO_COMPONENTS["etcd"].version.startswith("v3.5.")
    assert GO_COMPONENTS["helm"].version.startswith("v3.")


def test_env_override_names() -> None:
    assert env_override_name("kube-apiserver") == "CACHEROUTE_KUBE_APISERVER"
    assert env_override_name("etcd") == "CACHEROUTE_ETCD"


def test_per_binary_override_wins_over_assets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    executable(assets / "kube-apiserver")
    mine = executable(tmp_path / "my-apiserver")
    monkeypatch.setenv(binaries.ASSETS_ENV, str(assets))
    assert locate("kube-apiserver").path == assets / "kube-apiserver"
    monkeypatch.setenv("CACHEROUTE_KUBE_APISERVER", str(mine))
    found = locate("kube-apiserver")
    assert (found.path, found.source) == (mine, "CACHEROUTE_KUBE_APISERVER")


def test_envtest_assets_need_not_hold_every_component(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    executable(tmp_path / "etcd")
    executable(tmp_path / "kube-apiserver")
    monkeypatch.setenv(binaries.ASSETS_ENV, str(tmp_path))
    missing = [c.name for c in binaries.missing_go_components()]
    assert missing == ["kube-controller-manager", "kube-scheduler", "kwok", "helm", "prometheus"]


def test_tools_built_on_demand_are_left_out_unless_named() -> None:
    assert "promtool" not in [c.name for c in binaries.missing_go_components()]
    assert [c.name for c in binaries.missing_go_components(["promtool"])] == ["promtool"]
    with pytest.raises(BinaryNotFoundError, match=r"binaries ensure promtool"):
        locate("promtool")


def test_override_that_is_not_executable_is_named_in_the_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHEROUTE_ETCD", str(tmp_path / "absent"))
    with pytest.raises(BinaryNotFoundError, match=r"CACHEROUTE_ETCD points at .*absent"):
        locate("etcd")


def test_missing_component_says_how_to_get_it() -> None:
    with pytest.raises(BinaryNotFoundError, match=r"binaries ensure.*CACHEROUTE_KWOK"):
        locate("kwok")
    with pytest.raises(BinaryNotFoundError, match="unknown program 'kubelet'"):
        locate("kubelet")


def test_cached_build_is_found_only_with_its_stamp(tmp_path: Path) -> None:
    component = GO_COMPONENTS["kwok"]
    target = binaries.cached_path(component)
    target.parent.mkdir(parents=True)
    executable(target)
    with pytest.raises(BinaryNotFoundError):
        locate("kwok")  # an interrupted build leaves no stamp
    (target.parent / "build.json").write_text('{"seconds": 1.0}')
    assert locate("kwok").path == target
    assert target.parent.name == f"kwok-{component.version}"


def test_staging_modules_are_pinned_to_the_matching_published_version() -> None:
    replaces = binaries._staging_replaces(KUBERNETES_GOMOD, "v1.33.13")
    assert replaces == {"k8s.io/api": "v0.33.13", "k8s.io/client-go": "v0.33.13"}
    assert binaries._godebug_settings(KUBERNETES_GOMOD) == ["default=go1.24"]


def test_version_ldflags() -> None:
    kube = binaries._kubernetes_ldflags(ModuleFacts("v1.33.13", ""))
    assert kube["k8s.io/component-base/version.gitVersion"] == "v1.33.13"
    assert kube["k8s.io/component-base/version.gitMinor"] == "33"
    helm = binaries._helm_ldflags(ModuleFacts("v3.22.0", "require (\n\tk8s.io/client-go v0.37.0\n)\n"))
    assert helm["helm.sh/helm/v3/internal/version.version"] == "v3.22.0"
    assert helm["helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor"] == "37"


def test_bad_job_count_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(binaries.GO_JOBS_ENV, "two")
    with pytest.raises(binaries.BuildError, match="CACHEROUTE_GO_BUILD_JOBS='two'"):
        binaries.default_jobs()
