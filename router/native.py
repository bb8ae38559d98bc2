"""The router's request path, compiled: the modules every ext_proc stream runs, built with mypyc.

Per stream, the interpreted router spends about 70,000 instructions of its own on top of what
gRPC costs any Python servicer; compiled, about 30,000 (docs/router.md "The compiled request
path"). The code is the same typed source: mypyc turns each module in `COMPILED_MODULES` into a C
extension, and nothing is rewritten by hand.

`build(out)` copies the installed `cacheroute.router` and `cacheroute.planner` packages into
`out/cacheroute/` and compiles `COMPILED_MODULES` there, in place. A process whose `PYTHONPATH`
starts with `out` imports both packages from that copy: the compiled modules from their extension
files, the others from the copied sources. The image builds it into `IMAGE_PATH` and only the
router's container puts it on its path, so the operator in the same image keeps the installed
modules. The copy is of one version of the sources: `build` stamps it with their digest, and
`stale(out)` says when the installed sources have moved on.

The gRPC service (`service.py`) stays interpreted on purpose (its docstring says why).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# Where the image keeps the compiled copy; the router's container has it on PYTHONPATH.
IMAGE_PATH = "/opt/cacheroute/native"
PACKAGES = ("cacheroute.router", "cacheroute.planner")
# What a stream runs, from the message bytes to the stream's end: the wire reader, the exchange,
# the pick and its routing rule, the endpoints' load, keys, the key sketch and the counters.
COMPILED_MODULES = (
    "cacheroute.router.wire",
    "cacheroute.router.extproc",
    "cacheroute.router.picker",
    "cacheroute.router.endpoints",
    "cacheroute.router.keys",
    "cacheroute.router.sketch",
    "cacheroute.router.metrics",
    "cacheroute.router.table",
    "cacheroute.router.following",
    "cacheroute.router.prompts",
    "cacheroute.planner.keyring",
    "cacheroute.planner.prefixes",
    "cacheroute.planner.routing",
    "cacheroute.planner.tokenload",
)
STAMP = "SOURCES"
# The copy holds only these two packages: the namespace has no __init__.py, and what they import
# from elsewhere (pydantic, numpy, protobuf) is typed loosely at the boundary.
_MYPY_OPTIONS = ("--explicit-package-bases", "--namespace-packages", "--ignore-missing-imports")
_SETUP = """\
from setuptools import setup
from mypyc.build import mypycify

setup(name="cacheroute-native", ext_modules=mypycify({arguments!r}, opt_level="3"))
"""


class BuildError(RuntimeError):
    """The compiler is missing or failed."""


def package_dir(package: str) -> Path:
    """Where an installed package's sources are (an editable install's are the repository's)."""
    return Path(importlib.import_module(package).__path__[0])


def _sources(package: str) -> list[Path]:
    root = package_dir(package)
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def source_digest(packages: Sequence[str] = PACKAGES) -> str:
    """A digest of the sources `build` compiles, and of the interpreter it compiles them for."""
    digest = hashlib.sha256(sys.version.encode() + b"\0")
    for package in packages:
        root = package_dir(package)
        for path in _sources(package):
            digest.update(f"{package}/{path.relative_to(root)}".encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _module_path(module: str) -> Path:
    return Path(*module.split(".")).with_suffix(".py")


def build(out: Path, *, timeout: float = 900) -> Path:
    """Build the compiled copy in `out` (which must not exist yet, or be empty); returns `out`."""
    if out.exists() and any(out.iterdir()):
        raise BuildError(f"{out}: not empty; build into a new folder")
    try:
        importlib.import_module("mypyc.build")
    except ImportError:
        raise BuildError("mypyc is not installed: pip install mypy setuptools") from None
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        raise BuildError("no C compiler on PATH (cc or gcc)")
    digest = source_digest()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _compile(out, timeout)
    except BaseException:
        # Nothing half-built stays behind: the folder is as empty as it was given.
        for child in out.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
        raise
    (out / STAMP).write_text(digest + "\n")
    return out


def _compile(out: Path, timeout: float) -> None:
    """Copy both packages into `out` and compile `COMPILED_MODULES` there, in place."""
    for package in PACKAGES:
        root = package_dir(package)
        target = out / Path(*package.split("."))
        for path in _sources(package):
            copied = target / path.relative_to(root)
            copied.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copied)
        marker = root / "py.typed"
        if marker.exists():
            shutil.copyfile(marker, target / "py.typed")
    work = out / "build"
    work.mkdir()
    arguments = [*_MYPY_OPTIONS, *(str(_module_path(m)) for m in COMPILED_MODULES)]
    (work / "setup.py").write_text(_SETUP.format(arguments=arguments))
    done = subprocess.run(
        [sys.executable, str(work / "setup.py"), "build_ext", "--inplace", "--build-temp", str(work / "temp")],
        cwd=out, capture_output=True, text=True, timeout=timeout, check=False,
    )
    if done.returncode != 0:
        raise BuildError(f"mypyc failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    shutil.rmtree(work)
    shutil.rmtree(out / ".mypy_cache", ignore_errors=True)


def stale(out: Path, digest: str | None = None) -> bool:
    """Whether the copy in `out` was built from other sources than the installed ones (whose
    `source_digest()` the caller may pass, having computed it already)."""
    stamp = out / STAMP
    return not stamp.exists() or stamp.read_text().strip() != (digest or source_digest())


def compiled_modules() -> list[str]:
    """The modules of `COMPILED_MODULES` this process imported from extension files."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    out = []
    for name in COMPILED_MODULES:
        module = sys.modules.get(name)
        if module is not None and str(getattr(module, "__file__", "")).endswith(suffixes):
            out.append(name)
    return out


def request_path() -> str:
    """`compiled`, `interpreted`, or `partly compiled (n of m)`: how this process runs a stream."""
    compiled = len(compiled_modules())
    if compiled == len(COMPILED_MODULES):
        return "compiled"
    return "interpreted" if compiled == 0 else f"partly compiled ({compiled} of {len(COMPILED_MODULES)})"
