"""`make lint` enforces the dependency rules: a module that breaks one makes `lint-imports` fail.

Each case copies the source tree into a temporary folder laid out as the `cacheroute` package,
adds one module that crosses a boundary, and runs `lint-imports` with the repository's own
contracts (pyproject.toml) on the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
COMPONENTS = ("operator", "planner", "router", "sandbox")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the sources: <root>/src/cacheroute/<component>, <root>/src/tests/support."""
    root = tmp_path_factory.mktemp("contracts")
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    for component in COMPONENTS:
        shutil.copytree(REPO / component, src / "cacheroute" / component, ignore=ignore)
    shutil.copytree(REPO / "tests" / "support", src / "tests" / "support", ignore=ignore)
    shutil.copy(REPO / "tests" / "__init__.py", src / "tests" / "__init__.py")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    # Wide enough that no contract name wraps in the report.
    env = os.environ | {"PYTHONPATH": str(root / "src"), "COLUMNS": "400"}
    # The copy must be what is analysed, not the installed package.
    probe = "import cacheroute.planner as p; print(p.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.strip().startswith(str(root)), where.stdout
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_the_copied_tree_keeps_every_contract(tree: Path) -> None:
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("planner/uses_router.py", "from cacheroute.router.picker import Picker",
         "the planner imports nothing else of ours"),
        ("router/uses_admission.py", "from cacheroute.planner.admission import greedy_admit",
         "the router imports of the planner only"),
        # A planner module the router may import must not pull in the rest of the planner.
        ("planner/routing.py", "from cacheroute.planner.load import CostModel",
         "the router imports of the planner only"),
        ("operator/fleet/uses_sandbox.py", "from cacheroute.sandbox.process import wait_until",
         "the operator's reconcile code imports neither"),
        # A new module: with the import appended to the existing operator/control/loop.py, grimp
        # 3.20 (several root packages) left it out of the graph in 3 builds of 8.
        ("operator/control/uses_router.py", "import cacheroute.router.plans",
         "the operator's reconcile code imports neither"),
        ("sandbox/uses_tests.py", "from tests.support import sandbox",
         "no runtime package imports test support"),
    ],
)
def test_a_module_crossing_a_boundary_breaks_lint(tree: Path, module: str, line: str, contract: str) -> None:
    path = tree / "src" / "cacheroute" / module
    original = path.read_text() if path.exists() else None
    if original is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
    path.write_text((original or "") + "\n" + line + "\n")
    try:
        result = lint(tree)
    finally:
        if original is None:
            path.unlink()
        else:
            path.write_text(original)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = [text for text in result.stdout.splitlines() if " BROKEN" in text]
    assert len(broken) == 1 and broken[0].startswith(contract), result.stdout
    assert f"{path.parent.name}.{path.stem}" in result.stdout
