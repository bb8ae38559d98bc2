"""Volumes are written like the kubelet writes them: whole versions swapped in one rename."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any

import pytest

from cacheroute.sandbox.runtime.podenv import ConfigError
from cacheroute.sandbox.runtime.volumes import PodVolumes, Token, write_atomic


def test_contents_are_swapped_atomically_through_the_data_link(tmp_path: Path) -> None:
    volume = tmp_path / "plan"
    assert write_atomic(volume, {"plan.json": (b"v1", 0o644), "nested/part": (b"p1", 0o600)})
    first = os.readlink(volume / "..data")
    assert (volume / "plan.json").read_bytes() == b"v1"
    assert os.readlink(volume / "plan.json") == "..data/plan.json"
    assert (volume / "nested" / "part").stat().st_mode & 0o777 == 0o600
    # The same contents change nothing.
    assert not write_atomic(volume, {"plan.json": (b"v1", 0o644), "nested/part": (b"p1", 0o600)})
    # A new version: a new hidden directory, one link swapped, the old version and stale keys gone.
    held = (volume / "plan.json").open("rb")
    assert write_atomic(volume, {"plan.json": (b"v2", 0o644), "extra": (b"x", 0o644)})
    assert os.readlink(volume / "..data") != first
    assert not (volume / first).exists()
    assert (volume / "plan.json").read_bytes() == b"v2"
    assert not (volume / "nested").exists()
    assert held.read() == b"v1"  # an open reader keeps the version it opened
    held.close()
    assert sorted(p.name for p in volume.iterdir() if not p.name.startswith("..")) == ["extra", "plan.json"]


def test_paths_may_not_escape_the_volume(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="relative"):
        write_atomic(tmp_path / "v", {"../escape": (b"x", 0o644)})


OBJECTS: dict[tuple[str, str, str], dict[str, Any]] = {
    ("configmap", "ns", "plan"): {"data": {"a": "1", "b": "2"}, "binaryData": {"c": base64.b64encode(b"\0").decode()}},
    ("configmap", "ns", "kube-root-ca.crt"): {"data": {"ca.crt": "CERT"}},
    ("secret", "ns", "creds"): {"data": {"user": base64.b64encode(b"admin").decode()}},
}


async def test_every_volume_type_is_materialised(tmp_path: Path) -> None:
    issued: list[tuple[str, str, int]] = []

    async def tokens(account: str, audience: str, seconds: int) -> Token:
        issued.append((account, audience, seconds))
        now = time.time()
        return Token(f"token-{len(issued)}", now + seconds, now)

    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"app": "x"}},
        "spec": {
            "serviceAccountName": "router",
            "volumes": [
                {"name": "plan", "configMap": {"name": "plan", "items": [{"key": "b", "path": "sub/b.txt"}]}},
                {"name": "all", "configMap": {"name": "plan", "defaultMode": 0o600}},
                {"name": "creds", "secret": {"secretName": "creds"}},
                {"name": "maybe", "configMap": {"name": "absent", "optional": True}},
                {"name": "info", "downwardAPI": {"items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
                {"name": "scratch", "emptyDir": {}},
                {"name": "kube-api-access", "projected": {"sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace",
                                                "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
                ]}},
            ],
        },
    }
    volumes = PodVolumes(pod, tmp_path, lambda k, n, m: OBJECTS.get((k, n, m)), tokens)
    assert await volumes.render()
    assert (tmp_path / "plan" / "sub" / "b.txt").read_text() == "2"
    assert not (tmp_path / "plan" / "a").exists()
    assert (tmp_path / "all" / "c").read_bytes() == b"\0"
    assert (tmp_path / "all" / "a").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "creds" / "user").read_text() == "admin"
    assert not [p for p in (tmp_path / "maybe").iterdir() if not p.name.startswith("..")]
    assert (tmp_path / "info" / "labels").read_text() == 'app="x"'
    assert (tmp_path / "scratch").is_dir()
    access = tmp_path / "kube-api-access"
    assert (access / "token").read_text() == "token-1"
    assert (access / "ca.crt").read_text() == "CERT"
    assert (access / "namespace").read_text() == "ns"
    assert issued == [("router", "", 3607)]
    assert volumes.references() == {
        ("configmap", "ns", "plan"), ("configmap", "ns", "absent"), ("configmap", "ns", "kube-root-ca.crt"),
        ("secret", "ns", "creds"),
    }
    # Nothing changed: nothing rewritten, and the token is reused until 80 % of its life.
    assert not await volumes.render()
    assert len(issued) == 1
    refresh = volumes.next_refresh()
    assert refresh is not None and refresh > time.time() + 0.79 * 3607 - 5

    OBJECTS[("configmap", "ns", "plan")] = {"data": {"a": "1", "b": "3"}}
    assert await volumes.render()
    assert (tmp_path / "plan" / "sub" / "b.txt").read_text() == "3"
    del OBJECTS[("secret", "ns", "creds")]
    with pytest.raises(ConfigError, match="secret 'creds' not found"):
        await volumes.render()
