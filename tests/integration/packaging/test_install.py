"""The distribution installs cleanly and its CRD generator matches the committed files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow


def _uv() -> str:
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists():
        pytest.fail("uv is not installed in the test environment; `make test` installs it")
    return uv


def test_pip_install_then_crds_is_byte_identical(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    subprocess.run([_uv(), "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env)
    # A non-editable install from a copy proves nothing leans on the source tree.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "build", "bench-results"))
    # Offline: `make test` runs in a network namespace with no route out; every dependency is in
    # uv's cache since `make` installed the same ones into .venv.
    subprocess.run(
        [_uv(), "pip", "install", "-q", "--offline", "--python", str(venv / "bin" / "python"), str(src)],
        check=True,
        env=env,
    )
    shutil.rmtree(src)
    out = tmp_path / "crds"
    subprocess.run([str(venv / "bin" / "cacheroute"), "crds", "--out", str(out)], check=True, cwd=tmp_path)
    committed = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert sorted(p.name for p in out.glob("*.yaml")) == committed
    for name in committed:
        assert (out / name).read_bytes() == (REPO / "crds" / name).read_bytes(), name
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import cacheroute.planner.plan as m; print(m.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert "site-packages" in installed


def test_import_operator_from_repo_root_is_the_standard_library() -> None:
    for flags in ([], ["-S"]):
        out = subprocess.run(
            [sys.executable, *flags, "-c", "import operator; print(operator.__file__)"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        assert not out.startswith(str(REPO)), out
