"""The capacity bench refuses bad settings before it spends minutes replaying."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheroute.planner.replay.capacity import DEFAULT_REL_TOL
from tests.bench import bench_capacity


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rel-tol", "0"], "--rel-tol 0.0 must be in (0, 1)"),
        (["--rel-tol", "1.5"], "--rel-tol 1.5 must be in (0, 1)"),
        (["--jobs", "0"], "--jobs 0 must be at least 1"),
        (["--only", "paper,nope"], "--only nope is not one of"),
    ],
)
def test_bad_setting_exits_2_naming_it(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    assert bench_capacity.main([*argv, "--out", str(tmp_path / "capacity.json")]) == 2
    assert message in capsys.readouterr().err


def test_rel_tol_defaults_to_the_documented_step() -> None:
    assert bench_capacity.rel_tol() == DEFAULT_REL_TOL == 0.03
