"""Starting, watching and stopping the sandbox's server processes.

Processes are tracked by pid files so that another command (`cacheroute sandbox down`) can stop
them later. A process started with `detach=False` is tied to the thread that started it
(Linux parent-death signal): a test session that dies does not leave servers behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 40


class StartError(RuntimeError):
    """A component failed to start or to become healthy; the message carries its log's tail."""


# Where `free_ports` looks: the ports just below the kernel's ephemeral range, which it never
# gives to an outgoing connection. A port from the ephemeral range (what binding port 0 returns)
# can be taken as the local end of any connection opened before its server binds it; a suite that
# starts hundreds of servers while scraping and proxying lost an Envoy listener that way.
_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FIXED_PORTS = 8192
_MIN_PORT = 10000
# Ports handed out by this process, not offered twice (a server may not have bound its port yet).
_handed_out: set[int] = set()


def fixed_port_range() -> range:
    """The loopback ports `free_ports` draws from (empty when the ephemeral range is unknown)."""
    try:
        low = int(_PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(max(_MIN_PORT, low - _FIXED_PORTS), low)


def bound_socket(port: int) -> socket.socket | None:
    """A TCP socket bound to `port` on the loopback address (0: any), or None when it is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that are free right now and that no outgoing connection
    will take before a server binds them; from the ephemeral range only when none is left."""
    sockets: list[socket.socket] = []
    try:
        if len(_handed_out) > _FIXED_PORTS // 2:
            _handed_out.clear()
        candidates = [p for p in fixed_port_range() if p not in _handed_out]
        random.shuffle(candidates)
        for port in candidates:
            if len(sockets) == count:
                break
            sock = bound_socket(port)
            if sock is not None:
                sockets.append(sock)
        while len(sockets) < count:
            sock = bound_socket(0)
            if sock is None:
                raise OSError("no loopback port is free")
            sockets.append(sock)
        ports = [s.getsockname()[1] for s in sockets]
        _handed_out.update(ports)
        return ports
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            content = handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(content.splitlines()[-lines:])


def _tie_to_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class ServerProcess:
    """One running server: its pid, the program it runs and where its output goes."""

    name: str
    pid: int
    program: str
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_runs(self.pid, self.program)

    def exit_code(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def failure(self, what: str) -> StartError:
        code = self.exit_code()
        status = f"exited with code {code}" if code is not None else "is running"
        return StartError(f"{self.name} {what} ({status}); last lines of {self.log}:\n{log_tail(self.log)}")

    def stop(self, timeout: float = 10.0) -> None:
        stop_pid(self.pid, self.program, timeout=timeout, popen=self.popen)


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    detach: bool = True,
) -> ServerProcess:
    """Start `argv` in its own session with output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as sink:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            # Only prctl runs between fork and exec: no locks are taken, so threads are harmless here.
            preexec_fn=None if detach else _tie_to_parent,  # noqa: PLW1509
        )
    return ServerProcess(name=name, pid=popen.pid, program=str(argv[0]), log=log, popen=popen)


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may contain spaces; the state follows the last ')'.
    return stat.rsplit(")", 1)[1].split()[0]


def pid_runs(pid: int, program: str) -> bool:
    """Whether `pid` is alive and still runs `program` (a recycled pid does not count)."""
    state = _proc_state(pid)
    if state is None or state in ("Z", "X"):
        return False
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except OSError:
        return False
    return argv0 == program


def _terminate(pid: int) -> None:
    """SIGTERM, then SIGCONT: a paused process (`pause_pid`) acts on the SIGTERM once continued."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)


def paused(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (`pause_pid`): alive, holding its sockets, answering nothing."""
    return _proc_state(pid) == "T"


def pause_pid(pid: int) -> None:
    """SIGSTOP: the process keeps its ports, connections are accepted by the kernel and never
    answered, as when a server hangs."""
    os.kill(pid, signal.SIGSTOP)


def resume_pid(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def stop_pid(pid: int, program: str, *, timeout: float = 10.0, popen: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM, then SIGKILL after `timeout`; a pid that no longer runs `program` is left alone."""
    if not _running(pid, program, popen):
        return
    _terminate(pid)
    if _wait_gone(pid, program, timeout, popen):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, program, 5.0, popen)


@dataclass(frozen=True)
class Stoppable:
    pid: int
    program: str
    popen: subprocess.Popen[bytes] | None = None


def stop_all(targets: Sequence[Stoppable], *, timeout: float = 10.0) -> None:
    """Stop several processes at once: SIGTERM to all, then SIGKILL to whatever outlives `timeout`."""
    running = [t for t in targets if _running(t.pid, t.program, t.popen)]
    for target in running:
        _terminate(target.pid)
    deadline = time.monotonic() + timeout
    for target in running:
        if not _wait_gone(target.pid, target.program, max(0.0, deadline - time.monotonic()), target.popen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(target.pid, signal.SIGKILL)
            _wait_gone(target.pid, target.program, 5.0, target.popen)
    for target in targets:
        if target.popen is not None:
            target.popen.poll()  # reap


def _running(pid: int, program: str, popen: subprocess.Popen[bytes] | None) -> bool:
    """Whether the process is still to stop. A child of ours (`popen`) is, until it is reaped,
    whatever it exec'd since (`cacheroute router envoy` becomes Envoy): its pid cannot be reused
    before then. Another pid must still run `program`."""
    if popen is not None:
        return popen.poll() is None
    return pid_runs(pid, program)


def _wait_gone(pid: int, program: str, timeout: float, popen: subprocess.Popen[bytes] | None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen is not None:
            if popen.poll() is not None:
                return True
        elif not pid_runs(pid, program):
            return True
        time.sleep(0.05)
    return False


def wait_until(
    check: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    process: ServerProcess | None = None,
    interval: float = 0.1,
) -> None:
    """Poll `check` until it holds; fail early when `process` dies, late when `timeout` passes.

    `check` may raise while the server is still coming up; that counts as "not yet".
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            if check():
                return
        except Exception as exc:  # a server that is still starting refuses or errs
            last_error = exc
        if process is not None and not process.alive():
            raise process.failure(f"died while waiting for {what}")
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            if process is not None:
                raise process.failure(f"did not become ready within {timeout:.0f}s: {what}{detail}")
            raise StartError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)
