"""Writing files so that nothing is lost: a temporary file in the same folder, then a rename.

A rename within one file system is atomic, so a reader (or a failed write: a full disk, an
interrupted command) sees either the old file whole or the new file whole, never a mixture.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


class OutputPathError(ValueError):
    """An output path that cannot be written; the message names the option and the path."""


def check_output_file(path: Path, option: str) -> None:
    """Refuse an output file whose folder does not exist, or that names a directory or anything
    else a rename would destroy (a device, a pipe), before any work."""
    if path.is_dir():
        raise OutputPathError(f"{option} {path}: is a directory, not a file")
    target = written_path(path)
    if _special(target):
        raise OutputPathError(
            f"{option} {path}: not a regular file (a device or a pipe), which a file written in its place would "
            "replace; name a file, or leave the option out to print"
        )
    parent = target.parent
    if parent.exists() and not parent.is_dir():
        raise OutputPathError(f"{option} {path}: {parent} is a file, not a folder")
    if not parent.is_dir():
        raise OutputPathError(f"{option} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise OutputPathError(f"{option} {path}: folder {parent} is not writable")


def check_output_dir(path: Path, option: str) -> None:
    """Refuse an output folder that is a file, that sits below one, or whose nearest existing
    folder takes no file, before any work (a long run would otherwise lose its results)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise OutputPathError(f"{option} {path}: {candidate} is a file, not a folder")
            try:
                # A file written and removed at once: the permission bits do not tell (root, read-only
                # mounts, /proc).
                with tempfile.TemporaryFile(dir=candidate):
                    pass
            except OSError as exc:
                raise OutputPathError(f"{option} {path}: cannot write in {candidate}: {exc.strerror or exc}") from None
            return


def written_path(path: Path) -> Path:
    """The file a write to `path` replaces: the final target of a symbolic link (the link stays,
    as a shell's `>` keeps it), else `path` itself."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _special(path: Path) -> bool:
    """A device, a pipe or a socket: a rename would put a regular file in its place (as root, in
    place of /dev/null)."""
    return path.exists() and not path.is_file() and not path.is_dir()


def _refuse_special(path: Path) -> None:
    if _special(path):
        raise OSError(errno.EEXIST, "not a regular file (a device or a pipe), so it is not replaced", str(path))


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[str]]:
    """A text file handle whose content replaces `path` only when the block completes."""
    path = written_path(path)
    _refuse_special(path)
    fd, staged = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        _keep_mode(path, staged)
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise


def write_atomically(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is written as UTF-8)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    write_with(path, lambda staged: staged.write_bytes(raw))


def write_with(path: Path, write: Callable[[Path], object]) -> None:
    """Let `write` fill a temporary path beside `path`, then rename it over `path`."""
    path = written_path(path)
    _refuse_special(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    staged = Path(name)
    try:
        write(staged)
        with open(staged, "rb+") as handle:
            os.fsync(handle.fileno())
        _keep_mode(path, name)
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            staged.unlink()
        raise


def _keep_mode(path: Path, staged: str) -> None:
    # mkstemp creates 0600; the replacement keeps the old file's mode, or the umask's default.
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(staged, mode)
