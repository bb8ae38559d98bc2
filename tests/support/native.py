"""The router's compiled request path (`router/native.py`), built once per version of its sources.

Cached like the sandbox's Go builds (`cache_root()`, ~/.cache/cacheroute/bin by default), under a
folder named for `native.source_digest()`: a change to any router or planner source, or another
interpreter, builds a new copy.
"""

from __future__ import annotations

import os
from pathlib import Path

from cacheroute.router import native
from cacheroute.sandbox.binaries import cache_entry_lock, cache_root, fresh_staging, publish


def native_path() -> Path:
    """A compiled copy of the installed sources (built here if not cached); put it first on PYTHONPATH."""
    key = f"router-native-{native.source_digest()}"
    entry = cache_root() / key
    if not native.stale(entry):
        return entry
    with cache_entry_lock(key) as directory:
        if native.stale(directory):
            staging = fresh_staging(key)
            native.build(staging)
            publish(staging, directory)
    return entry


def native_env(path: Path) -> dict[str, str]:
    """The environment of a process that runs the compiled copy at `path`."""
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(path) if not inherited else f"{path}{os.pathsep}{inherited}"}
