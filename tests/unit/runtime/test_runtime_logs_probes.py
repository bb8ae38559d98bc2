"""Container logs in the CRI format, and probe verdicts from consecutive results."""

from __future__ import annotations

from pathlib import Path

from cacheroute.sandbox.runtime.logs import MAX_LINE, LogFile, plain_text
from cacheroute.sandbox.runtime.probes import ProbeSpec, ProbeState


def test_log_lines_are_framed_as_cri_and_read_back(tmp_path: Path) -> None:
    log = LogFile(tmp_path / "c" / "0.log")
    log.feed("stdout", b"first line\nsecond ")
    log.feed("stderr", b"oops\n")
    log.feed("stdout", b"half\n" + b"x" * (MAX_LINE + 10))
    log.close()
    lines = (tmp_path / "c" / "0.log").read_text().splitlines()
    stamp, stream, tag, text = lines[0].split(" ", 3)
    assert stamp.endswith("Z") and "T" in stamp and len(stamp.split(".")[1]) == 10
    assert (stream, tag, text) == ("stdout", "F", "first line")
    assert [line.split(" ", 3)[1:] for line in lines[1:3]] == [["stderr", "F", "oops"], ["stdout", "F", "second half"]]
    assert lines[3].split(" ", 3)[2] == "P"
    expected = ["first line", "oops", "second half", "x" * (MAX_LINE + 10)]
    assert plain_text(tmp_path / "c" / "0.log").splitlines() == expected


def test_probe_verdicts_need_consecutive_results() -> None:
    spec = ProbeSpec.parse({"httpGet": {"port": 1}, "successThreshold": 2, "failureThreshold": 3}, kind="readiness")
    assert spec is not None
    state = ProbeState(spec, initial=False)
    assert [state.record(ok) for ok in (True, False, True, True, False, False, True, False, False, False)] == [
        False, False, False, True, True, True, True, True, True, False
    ]
    liveness = ProbeSpec.parse({"tcpSocket": {"port": 1}, "successThreshold": 5}, kind="liveness")
    assert liveness is not None and liveness.success_threshold == 1 and liveness.period == 10
    assert ProbeSpec.parse(None, kind="readiness") is None
