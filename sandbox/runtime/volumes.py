"""Pod volumes on the host, written the way the kubelet writes them.

Volumes with API contents (configMap, secret, downwardAPI, projected) are directories updated
atomically: every version of the contents goes into a fresh hidden directory, the `..data`
symlink is swapped to it in one rename, and each top-level entry is a symlink through `..data`.
A reader that opens files through the mounted directory sees a whole old version or a whole new
one, never a mix (this is what lets a router follow a mounted plan safely).

Projected service-account tokens come from the TokenRequest API, bound to the pod, and are
renewed when 80 % of their lifetime has passed (as the kubelet does). emptyDir is a plain
directory; hostPath is the host's own path. Other volume types (persistent volume claims, ...)
become empty directories, with a note in the runtime's log.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cacheroute.sandbox.runtime.podenv import ConfigError, Lookup, field_value, object_data, resource_value

log = logging.getLogger("cacheroute.sandbox.runtime")

Obj = Mapping[str, Any]
Files = dict[str, tuple[bytes, int]]
DATA_LINK = "..data"
DEFAULT_MODE = 0o644
DEFAULT_TOKEN_SECONDS = 3600
MIN_TOKEN_SECONDS = 600


@dataclass(frozen=True)
class Token:
    token: str
    expires_at: float  # epoch seconds
    issued_at: float

    @property
    def refresh_at(self) -> float:
        return self.issued_at + 0.8 * (self.expires_at - self.issued_at)


# (service account, audience or "", expiration seconds) -> a token bound to the pod.
TokenSource = Callable[[str, str, int], Awaitable[Token]]


def _safe_relative(path: str) -> PurePosixPath:
    rel = PurePosixPath(path)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts or rel.parts[0].startswith(".."):
        raise ConfigError(f"volume path {path!r} must be relative, without '..'")
    return rel


def write_atomic(directory: Path, files: Files) -> bool:
    """Make `directory` hold exactly `files` (relative path -> (content, mode)); False if unchanged."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / DATA_LINK
    if data.is_symlink() and _same(directory / os.readlink(data), files):
        return False
    staged = Path(tempfile.mkdtemp(prefix=time.strftime("..%Y_%m_%d_%H_%M_%S."), dir=directory))
    for rel, (content, mode) in files.items():
        target = staged / _safe_relative(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    staged.chmod(0o755)
    old = os.readlink(data) if data.is_symlink() else None
    link = directory / "..data_tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(staged.name)
    os.replace(link, data)
    tops = {PurePosixPath(rel).parts[0] for rel in files}
    for top in tops:
        entry = directory / top
        if not entry.is_symlink():
            entry.symlink_to(f"{DATA_LINK}/{top}")
    for entry in directory.iterdir():
        if entry.name.startswith("..") or entry.name in tops:
            continue
        if entry.is_symlink() and os.readlink(entry).startswith(DATA_LINK + "/"):
            entry.unlink()
    if old is not None and old != staged.name:
        shutil.rmtree(directory / old, ignore_errors=True)
    return True


def _same(current: Path, files: Files) -> bool:
    if not current.is_dir():
        return False
    present = {str(p.relative_to(current)) for p in current.rglob("*") if p.is_file()}
    if present != set(files):
        return False
    for rel, (content, mode) in files.items():
        path = current / rel
        if path.stat().st_mode & 0o777 != mode or path.read_bytes() != content:
            return False
    return True


def _host_path(spec: Obj) -> None:
    host = Path(str(spec.get("path", "")))
    if spec.get("type") == "DirectoryOrCreate" and not host.exists():
        host.mkdir(parents=True, exist_ok=True)
    if not host.exists():
        raise ConfigError(f"hostPath {host} does not exist")


def _items(data: Mapping[str, bytes], items: list[Obj] | None, mode: int, what: str, optional: bool) -> Files:
    files: Files = {}
    if not items:
        for key, value in data.items():
            files[key] = (value, mode)
        return files
    for item in items:
        key = str(item.get("key", ""))
        if key not in data:
            if optional:
                continue
            raise ConfigError(f"{what}: no key {key!r}")
        files[str(item.get("path", key))] = (data[key], int(item.get("mode", mode)))
    return files


@dataclass
class PodVolumes:
    """The volumes of one pod under `root/<volume name>`."""

    pod: Obj
    root: Path
    lookup: Lookup
    tokens: TokenSource
    _tokens: dict[tuple[str, int], Token] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return str(self.pod.get("metadata", {}).get("namespace", "default"))

    def volumes(self) -> list[Obj]:
        return list(self.pod.get("spec", {}).get("volumes") or [])

    def path(self, name: str) -> Path:
        for volume in self.volumes():
            if volume.get("name") == name and "hostPath" in volume:
                return Path(str(volume["hostPath"].get("path", "/")))
        return self.root / name

    def references(self) -> set[tuple[str, str, str]]:
        """(kind, namespace, name) of every ConfigMap and Secret the volumes read."""
        refs = set()
        for volume in self.volumes():
            sources = [volume, *((volume.get("projected") or {}).get("sources") or [])]
            for source in sources:
                if "configMap" in source:
                    refs.add(("configmap", self.namespace, str(source["configMap"].get("name", ""))))
                if "secret" in source:
                    secret = source["secret"]
                    refs.add(("secret", self.namespace, str(secret.get("secretName") or secret.get("name", ""))))
        return refs

    def next_refresh(self) -> float | None:
        """When the earliest token must be renewed (epoch seconds), if any."""
        return min((t.refresh_at for t in self._tokens.values()), default=None)

    async def render(self) -> bool:
        """Write every volume; True when some content changed. Raises ConfigError if one cannot be built yet."""
        changed = False
        for volume in self.volumes():
            name = str(volume.get("name", ""))
            target = self.root / name
            if "emptyDir" in volume:
                target.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in volume:
                _host_path(volume["hostPath"])
            else:
                files = await self._files(volume)
                if files is None:
                    target.mkdir(parents=True, exist_ok=True)
                    note = f"volume {name}: type {sorted(k for k in volume if k != 'name')} is an empty directory here"
                    if note not in self.notes:
                        self.notes.append(note)
                        log.info("%s/%s %s", self.namespace, self.pod["metadata"]["name"], note)
                    continue
                changed |= write_atomic(target, files)
        return changed

    async def _files(self, volume: Obj) -> Files | None:
        if "configMap" in volume:
            return self._config_files("configmap", volume["configMap"], DEFAULT_MODE)
        if "secret" in volume:
            return self._config_files("secret", volume["secret"], DEFAULT_MODE)
        if "downwardAPI" in volume:
            spec = volume["downwardAPI"]
            return self._downward(spec.get("items") or [], int(spec.get("defaultMode", DEFAULT_MODE)))
        if "projected" in volume:
            spec = volume["projected"]
            mode = int(spec.get("defaultMode", DEFAULT_MODE))
            files: Files = {}
            for source in spec.get("sources") or []:
                if "configMap" in source:
                    files.update(self._config_files("configmap", source["configMap"], mode) or {})
                elif "secret" in source:
                    files.update(self._config_files("secret", source["secret"], mode) or {})
                elif "downwardAPI" in source:
                    files.update(self._downward(source["downwardAPI"].get("items") or [], mode))
                elif "serviceAccountToken" in source:
                    spec_token = source["serviceAccountToken"]
                    token = await self._token(
                        str(spec_token.get("audience") or ""),
                        int(spec_token.get("expirationSeconds") or DEFAULT_TOKEN_SECONDS),
                    )
                    files[str(spec_token.get("path", "token"))] = (token.token.encode(), mode)
            return files
        return None

    def _config_files(self, kind: str, spec: Obj, default_mode: int) -> Files | None:
        name = str(spec.get("secretName") or spec.get("name") or "")
        optional = bool(spec.get("optional"))
        obj = self.lookup(kind, self.namespace, name)
        if obj is None:
            if optional:
                return {}
            raise ConfigError(f"{kind} {name!r} not found")
        mode = int(spec.get("defaultMode", default_mode))
        return _items(object_data(kind, obj), spec.get("items"), mode, f"{kind} {name}", optional)

    def _downward(self, items: list[Obj], mode: int) -> Files:
        files: Files = {}
        containers = {c.get("name"): c for c in self.pod.get("spec", {}).get("containers") or []}
        for item in items:
            if "fieldRef" in item:
                value = field_value(self.pod, str(item["fieldRef"].get("fieldPath", "")))
            elif "resourceFieldRef" in item:
                ref = item["resourceFieldRef"]
                value = resource_value(containers.get(ref.get("containerName"), {}), ref)
            else:
                continue
            files[str(item.get("path", ""))] = (value.encode(), int(item.get("mode", mode)))
        return files

    async def _token(self, audience: str, seconds: int) -> Token:
        seconds = max(seconds, MIN_TOKEN_SECONDS)
        key = (audience, seconds)
        token = self._tokens.get(key)
        if token is None or time.time() >= token.refresh_at:
            account = str(self.pod.get("spec", {}).get("serviceAccountName") or "default")
            token = await self.tokens(account, audience, seconds)
            self._tokens[key] = token
        return token

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)


def decode_token_status(status: Obj, now: float) -> Token:
    """A Token from a TokenRequest's status."""
    import datetime as dt

    expires = dt.datetime.fromisoformat(str(status["expirationTimestamp"]).replace("Z", "+00:00")).timestamp()
    return Token(str(status["token"]), expires, now)


def b64(text: bytes) -> str:
    return base64.b64encode(text).decode()
