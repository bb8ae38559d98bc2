"""The router's compiled request path (`router/native.py`) for tests and benchmarks: the
sandbox's cached copy (`sandbox/nativecopy.py`), built if missing, and the environment that runs it."""

from __future__ import annotations

import os
from pathlib import Path

from cacheroute.sandbox.nativecopy import ensure as native_path

__all__ = ["native_env", "native_path"]


def native_env(path: Path) -> dict[str, str]:
    """The environment of a process that runs the compiled copy at `path`."""
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(path) if not inherited else f"{path}{os.pathsep}{inherited}"}
