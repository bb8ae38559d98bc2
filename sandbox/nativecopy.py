"""The compiled request path for the sandbox's router pods, built once per version of the sources.

The image keeps a compiled copy of the router's request path in `native.IMAGE_PATH`, and the
operator puts that folder first on the picker container's PYTHONPATH. The sandbox runs the
image's containers as local processes, so it keeps a copy of its own, cached like the Go builds
(`cache_root()`) in a folder named for `native.source_digest()`, and its pod runtime puts that
copy where a container's PYTHONPATH names the image's folder (`images.default_drivers`). Without
a fresh copy the sandbox's routers run the sources, and say so in
`cacheroute_router_build_info`.
"""

from __future__ import annotations

from pathlib import Path

from cacheroute.router import native
from cacheroute.sandbox.binaries import cache_entry_lock, cache_root, fresh_staging, publish


def _entry() -> tuple[str, Path, str]:
    """The cache key and folder of the installed sources' copy, and their digest (hashed once)."""
    digest = native.source_digest()
    key = f"router-native-{digest}"
    return key, cache_root() / key, digest


def located() -> Path | None:
    """The cached copy of the installed sources, or None when there is none (or only older ones)."""
    _key, entry, digest = _entry()
    return None if native.stale(entry, digest) else entry


def ensure() -> Path:
    """The cached copy, compiled first if missing (about 20 s; needs mypy, setuptools and a C
    compiler, `native.BuildError` otherwise)."""
    key, entry, digest = _entry()
    if not native.stale(entry, digest):
        return entry
    with cache_entry_lock(key) as directory:
        if native.stale(directory, digest):
            staging = fresh_staging(key)
            native.build(staging)
            publish(staging, directory)
    return entry
