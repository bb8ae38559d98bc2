"""Container logs in the CRI format, which kwok's log server (and `kubectl logs`) read.

One line per log line: `<RFC 3339 time with nanoseconds> <stdout|stderr> <F|P> <text>`, `P` for a
partial line (an over-long line, split), `F` for the end of a line.
"""

from __future__ import annotations

import time
from pathlib import Path

MAX_LINE = 16 * 1024


def _stamp(t: float) -> str:
    whole = int(t)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((t - whole) * 1e9):09d}Z"


class LogFile:
    """The log of one run of one container (the kubelet keeps one file per restart)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._handle = path.open("ab", buffering=0)
        self._pending = {"stdout": b"", "stderr": b""}

    def line(self, text: str, stream: str = "stdout") -> None:
        self._emit(stream, text.encode(errors="replace"), full=True)

    def feed(self, stream: str, data: bytes) -> None:
        """Bytes read from the container's pipe; complete lines are written, the rest waits."""
        buffered = self._pending[stream] + data
        *lines, rest = buffered.split(b"\n")
        for line in lines:
            self._emit(stream, line, full=True)
        while len(rest) > MAX_LINE:
            self._emit(stream, rest[:MAX_LINE], full=False)
            rest = rest[MAX_LINE:]
        self._pending[stream] = rest

    def _emit(self, stream: str, data: bytes, *, full: bool) -> None:
        if self._handle.closed:
            return
        tag = b"F" if full else b"P"
        self._handle.write(b"%s %s %s %s\n" % (_stamp(time.time()).encode(), stream.encode(), tag, data))

    def close(self) -> None:
        for stream, rest in self._pending.items():
            if rest:
                self._emit(stream, rest, full=True)
        self._pending = {"stdout": b"", "stderr": b""}
        self._handle.close()


def plain_text(path: Path) -> str:
    """The log's content without the CRI framing (what `kubectl logs` prints)."""
    out: list[str] = []
    partial = ""
    for raw in path.read_text(errors="replace").splitlines():
        parts = raw.split(" ", 3)
        if len(parts) < 3:
            continue
        text = parts[3] if len(parts) == 4 else ""
        if parts[2] == "P":
            partial += text
            continue
        out.append(partial + text)
        partial = ""
    return "\n".join(out) + ("\n" if out else "")
