"""One run of one container: a local process in a private mount namespace, or a hosted emulator.

Process containers get the pod's volumes bind-mounted at their `mountPath`s inside a mount
namespace of their own (`unshare --mount --propagation private`), so a path like
`/var/run/secrets/kubernetes.io/serviceaccount` is real for that process and for nobody else.
A missing mount point is created on the host as an empty directory (or file, for a file
`subPath`); nothing else on the host changes. The process leads its own process group; stopping
it signals the group (SIGTERM, then SIGKILL after the grace period), and it is killed if the
runtime itself dies (parent-death signal), so no container outlives the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cacheroute.sandbox.emulator.server import Emulator
from cacheroute.sandbox.runtime.logs import LogFile

_PR_SET_PDEATHSIG = 1
_READ_CHUNK = 64 * 1024
_UNSHARE = ("unshare", "--mount", "--propagation", "private", "--")
# What a container stopped after its grace period is spent still gets, as a kubelet gives a
# preStop hook that ran over (2 s).
_LEAST_STOP_S = 2.0


class ContainerStartError(RuntimeError):
    """The container could not be started (kubelet: CreateContainerError / StartError)."""


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool = False


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_checked: dict[str, str | None] = {}


def mount_namespace_problem() -> str | None:
    """Why private mount namespaces cannot be used here, or None when they can (checked once)."""
    if "unshare" not in _checked:
        try:
            result = subprocess.run(
                [*_UNSHARE, "mount", "--bind", "/", "/"], capture_output=True, text=True, timeout=10, check=False
            )
            _checked["unshare"] = (
                None if result.returncode == 0 else (result.stderr.strip() or f"exit status {result.returncode}")
            )
        except (OSError, subprocess.SubprocessError) as exc:
            _checked["unshare"] = str(exc)
    return _checked["unshare"]


def mount_script(mounts: list[Mount]) -> str:
    """Shell commands that bind the mounts (parents first) and exec the container's argv."""
    lines = ["set -e"]
    for mount in sorted(mounts, key=lambda m: len(Path(m.target).parts)):
        source, target = shlex.quote(str(mount.source)), shlex.quote(mount.target)
        lines.append(f"mount --bind {source} {target}")
        if mount.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    lines.append('exec "$@"')
    return "\n".join(lines)


def prepare_mount_points(mounts: list[Mount]) -> None:
    for mount in mounts:
        target = Path(mount.target)
        if target.exists() or target.is_symlink():
            continue
        if mount.source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()


class Run(Protocol):
    pid: int | None

    async def wait(self) -> int: ...

    async def stop(self, grace: float) -> None: ...


class ProcessRun:
    """A container process."""

    def __init__(self, process: asyncio.subprocess.Process, log: LogFile) -> None:
        self.process = process
        self.pid: int | None = process.pid
        self.log = log
        self._pumps = [
            asyncio.create_task(self._pump(process.stdout, "stdout")),
            asyncio.create_task(self._pump(process.stderr, "stderr")),
        ]

    @classmethod
    async def start(
        cls, argv: list[str], *, env: dict[str, str], cwd: Path, mounts: list[Mount], log: LogFile
    ) -> ProcessRun:
        full = list(argv)
        if mounts:
            problem = mount_namespace_problem()
            if problem is not None:
                raise ContainerStartError(
                    "volumes are mounted in a private mount namespace (unshare --mount), which is not permitted "
                    f"here: {problem}; run the sandbox as root (CAP_SYS_ADMIN)"
                )
            prepare_mount_points(mounts)
            full = [*_UNSHARE, "/bin/sh", "-c", mount_script(mounts), argv[0], *argv]
        try:
            process = await asyncio.create_subprocess_exec(
                *full,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=str(cwd),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise ContainerStartError(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
        return cls(process, log)

    async def _pump(self, stream: asyncio.StreamReader | None, name: str) -> None:
        if stream is None:
            return
        while True:
            data = await stream.read(_READ_CHUNK)
            if not data:
                return
            self.log.feed(name, data)

    async def wait(self) -> int:
        code = await self.process.wait()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self.log.close()
        return code

    def _signal(self, sig: int) -> None:
        if self.process.returncode is None and self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    async def stop(self, grace: float) -> None:
        self._signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self.process.wait()), timeout=max(grace, 0.0))
        except TimeoutError:
            self._signal(signal.SIGKILL)
            await self.process.wait()
        # The process group may hold children that ignored SIGTERM.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.pid is not None:
                os.killpg(self.pid, signal.SIGKILL)


class EmulatorRun:
    """A vLLM container served by an emulator in the runtime's own loop."""

    pid: int | None = None

    def __init__(self, emulator: Emulator, log: LogFile) -> None:
        self.emulator = emulator
        self.log = log
        self._stopped = asyncio.Event()
        self._code = 0
        self._task = emulator.start()
        self._task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            self.log.line(f"ERROR {task.exception()}", "stderr")
            self._code = 1
            self._stopped.set()

    async def wait(self) -> int:
        await self._stopped.wait()
        self.log.close()
        return self._code

    async def stop(self, grace: float) -> None:
        # vLLM exits with status 0 on SIGTERM after shutting its server down; one that outlives
        # the grace period is killed (137), so that no server can keep a pod Terminating.
        code = 0
        allowed = max(grace, _LEAST_STOP_S)
        try:
            await asyncio.wait_for(self.emulator.stop(), allowed)
        except TimeoutError:
            self.log.line(f"ERROR the server did not stop within {allowed:.0f}s: killed", "stderr")
            code = 137
        if not self._stopped.is_set():
            self._code = code
            self._stopped.set()
