"""Stopping a process the sandbox started, also after it exec'd another program."""

from __future__ import annotations

import sys
from pathlib import Path

from cacheroute.sandbox.process import pid_runs, spawn, wait_until


def test_a_child_that_execd_another_program_is_still_stopped(tmp_path: Path) -> None:
    # As `cacheroute router envoy` becomes Envoy: the pid no longer runs the program started.
    child = spawn("execs", [sys.executable, "-c", "import os; os.execvp('sleep', ['sleep', '60'])"],
                  log=tmp_path / "execs.log", detach=False)
    wait_until(lambda: not pid_runs(child.pid, child.program), timeout=10, what="the exec")
    assert child.alive()
    child.stop(timeout=5)
    assert not child.alive()
    assert child.exit_code() is not None


def test_a_process_gone_already_is_left_alone(tmp_path: Path) -> None:
    child = spawn("quick", [sys.executable, "-c", "pass"], log=tmp_path / "quick.log", detach=False)
    wait_until(lambda: not child.alive(), timeout=10, what="the exit")
    child.stop(timeout=1)
    assert child.exit_code() == 0
