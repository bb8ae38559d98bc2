"""Which container images the runtime runs, and how: the image registry.

An image is matched by repository (registry host and path, without tag or digest), normalised the
way container runtimes do (`vllm/vllm-openai` is `docker.io/vllm/vllm-openai`). A registered
repository maps to a driver:

- `process`: the image's entry point is a local command; the container runs that command (or
  the container's own `command`) with the container's `args`, as a local process;
- `emulator`: a vLLM server, emulated inside the runtime's event loop.

kwok's stages must agree with the runtime on which pods it serves, so both come from one
registry: `kwok_predicate()` is the same test as `ImageRegistry.served`, written in CEL. Pods of a
Job (which carry the Job controller's `batch.kubernetes.io/job-name` label) are never served: they
complete as kwok completes them (e.g. memory-profiling Jobs).
"""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cacheroute.router import native
from cacheroute.sandbox import nativecopy

DOCKER_HUB = "docker.io"
_HUB_ALIASES = ("docker.io/", "index.docker.io/", "registry-1.docker.io/")

CACHEROUTE_REPOSITORY = "ghcr.io/cacheroute/cacheroute"
VLLM_REPOSITORY = "vllm/vllm-openai"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"

DriverKind = Literal["process", "emulator"]


def repository(image: str) -> str:
    """The normalised repository of an image reference (no tag, no digest, Docker Hub spelled short)."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name = name[:colon]
    for alias in _HUB_ALIASES:
        if name.startswith(alias):
            name = name[len(alias) :]
            break
    first = name.split("/", 1)[0]
    on_hub = "/" not in name or ("." not in first and ":" not in first and first != "localhost")
    if on_hub and "/" not in name:
        name = "library/" + name
    return name


def _spellings(repo: str) -> list[str]:
    """Every way an image reference may name `repo` (for the CEL predicate, which cannot normalise)."""
    names = [repo]
    first = repo.split("/", 1)[0]
    if "." not in first and ":" not in first and first != "localhost":
        names += [alias + repo for alias in _HUB_ALIASES]
        if repo.startswith("library/"):
            short = repo[len("library/") :]
            names += [short] + [alias + short for alias in _HUB_ALIASES]
    return names


@dataclass(frozen=True)
class ImageDriver:
    """How the runtime runs containers of one repository."""

    repository: str
    kind: DriverKind
    # process: the local command standing for the image's entry point.
    entrypoint: tuple[str, ...] = ()
    # The entry point's name inside the image: a container `command` of that name means the entry point.
    entrypoint_name: str = ""
    # The image's own environment (what its Dockerfile's ENV lines would set).
    env: Mapping[str, str] = field(default_factory=dict)
    # Folders of the image that a local folder stands for, where a container's PYTHONPATH names them.
    python_paths: Mapping[str, str] = field(default_factory=dict)


def _cacheroute_command() -> tuple[str, ...]:
    script = Path(sys.executable).with_name("cacheroute")
    if script.is_file():
        return (str(script),)
    found = shutil.which("cacheroute")
    if found:
        return (found,)
    return (sys.executable, "-m", "cacheroute.operator.cli.main")


def _native_paths() -> dict[str, str]:
    """The image's compiled request path, where the sandbox has a fresh copy (`nativecopy.py`)."""
    copy = nativecopy.located()
    return {native.IMAGE_PATH: str(copy)} if copy is not None else {}


def default_drivers() -> list[ImageDriver]:
    return [
        ImageDriver(
            CACHEROUTE_REPOSITORY,
            "process",
            entrypoint=_cacheroute_command(),
            entrypoint_name="cacheroute",
            env={"PYTHONUNBUFFERED": "1"},
            python_paths=_native_paths(),
        ),
        ImageDriver(VLLM_REPOSITORY, "emulator", entrypoint_name="vllm"),
    ]


class ImageRegistry:
    """Repository -> driver."""

    def __init__(self, drivers: Iterable[ImageDriver]) -> None:
        self._drivers: dict[str, ImageDriver] = {}
        for driver in drivers:
            self.register(driver)

    def register(self, driver: ImageDriver) -> None:
        self._drivers[repository(driver.repository)] = driver

    def driver(self, image: str | None) -> ImageDriver | None:
        return self._drivers.get(repository(image)) if image else None

    @property
    def repositories(self) -> list[str]:
        return sorted(self._drivers)

    def served(self, pod: Mapping[str, Any]) -> bool:
        """Whether the runtime (not kwok) runs this pod: a registered image, and no Job owns it."""
        if JOB_NAME_LABEL in (pod.get("metadata", {}).get("labels") or {}):
            return False
        containers = pod.get("spec", {}).get("containers") or []
        return any(self.driver(c.get("image")) is not None for c in containers)

    def kwok_predicate(self) -> str:
        """`served` as a CEL expression over a kwok Stage's `self` (the pod)."""
        tests = []
        for repo in self.repositories:
            for name in _spellings(repo):
                tests += [f"c.image == '{name}'", f"c.image.startsWith('{name}:')", f"c.image.startsWith('{name}@')"]
        images = " || ".join(tests) or "false"
        # kwok's CEL environment knows the pod's containers and labels but not owner references.
        return f"self.spec.containers.exists(c, {images}) && !('{JOB_NAME_LABEL}' in self.metadata.labels)"

    def to_args(self) -> list[str]:
        """The runtime command-line options that rebuild the non-default part of this registry."""
        defaults = {d.repository: d for d in default_drivers()}
        out = []
        for repo, driver in sorted(self._drivers.items()):
            if defaults.get(repo) == driver:
                continue
            out += ["--image", f"{repo}={shlex.join(driver.entrypoint)}"]
        return out


def parse_image_option(text: str) -> ImageDriver:
    """`REPOSITORY=COMMAND` (a local command standing for the image's entry point)."""
    repo, eq, command = text.partition("=")
    if not eq or not repo.strip() or not command.strip():
        raise ValueError(f"--image {text!r} is not REPOSITORY=COMMAND")
    argv = shlex.split(command)
    return ImageDriver(repository(repo.strip()), "process", entrypoint=tuple(argv), entrypoint_name=Path(argv[0]).name)


def default_registry(extra: Sequence[ImageDriver] = ()) -> ImageRegistry:
    return ImageRegistry([*default_drivers(), *extra])
