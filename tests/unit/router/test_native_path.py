"""What the compiled request path covers, and how a process tells which path it runs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cacheroute.operator.fleet import router as router_objects
from cacheroute.router import native
from cacheroute.router.cli import app


def test_every_compiled_module_is_a_source_module_of_the_copied_packages() -> None:
    for name in native.COMPILED_MODULES:
        package, _, module = name.rpartition(".")
        assert package in native.PACKAGES, name
        assert (native.package_dir(package) / f"{module}.py").is_file(), name


def test_the_grpc_service_stays_interpreted() -> None:
    assert "cacheroute.router.service" not in native.COMPILED_MODULES


def test_this_process_runs_the_request_path_interpreted() -> None:
    importlib.import_module("cacheroute.router.server")
    assert native.compiled_modules() == []
    assert native.request_path() == "interpreted"


def test_a_copy_without_a_stamp_or_with_another_digest_is_stale(tmp_path: Path) -> None:
    assert native.stale(tmp_path)
    (tmp_path / native.STAMP).write_text("0" * 16 + "\n")
    assert native.stale(tmp_path)
    (tmp_path / native.STAMP).write_text(native.source_digest() + "\n")
    assert not native.stale(tmp_path)


def test_a_build_never_writes_into_a_folder_that_holds_something(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(native.BuildError, match="not empty"):
        native.build(tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_the_operator_points_the_picker_where_the_image_keeps_the_compiled_copy() -> None:
    # The operator may not import the router (import contracts): the path is written twice.
    assert router_objects.NATIVE_PATH == native.IMAGE_PATH
    dockerfile = (Path(__file__).resolve().parents[3] / "Dockerfile").read_text()
    assert f"build-native --out {native.IMAGE_PATH}" in dockerfile


def test_a_failed_build_leaves_its_folder_empty_to_build_into_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "copy"
    monkeypatch.setattr(native, "_MYPY_OPTIONS", ("--no-such-mypy-option",))
    with pytest.raises(native.BuildError, match="mypyc failed"):
        native.build(out)
    assert list(out.iterdir()) == []
    assert native.stale(out)


def test_a_folder_that_is_not_empty_is_refused_before_anything_compiles(tmp_path: Path) -> None:
    (tmp_path / "kept.txt").write_text("mine")
    result = CliRunner().invoke(app, ["build-native", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: out {tmp_path}: not empty; build into a new folder"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]
