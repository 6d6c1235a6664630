"""`dora plan --out DIR` writes all or nothing: a failure at any file or rename leaves DIR exactly as it was
(absent if it was absent), never an earlier plan's files mixed with a new one's; dora replaces only its own
entries, and refuses, never deletes, what it did not write."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import REPO

from dora.cli import main
from dora.lower import render as render_module
from dora.lower import write_launch_artifacts
from dora.plan_cmd import PLAN_DIR_ENTRIES, write_plan_dir
from dora.planning import Planned, make_plan
from dora.spec import ResolvedSpec, load_spec
from planner.calibration import DEFAULT_CALIBRATION

TINY = REPO / "specs" / "local-tiny.yaml"
TOP = ["launch", "plan.json", "report.txt", "schedule.dot", "schedule.json", "timeline.html"]


@pytest.fixture(scope="module")
def tiny() -> tuple[ResolvedSpec, Planned]:
    resolved = load_spec(str(TINY))
    return resolved, make_plan(resolved, DEFAULT_CALIBRATION)


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under ``root`` (hidden ones included): its mode and, for a file, its bytes."""
    entries: dict[str, tuple[int, bytes | None]] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            mode = path.lstat().st_mode
            entries[str(path.relative_to(root))] = (mode, path.read_bytes() if path.is_file() else None)
    return entries


def earlier_plan(out: Path, tiny: tuple[ResolvedSpec, Planned]) -> None:
    """A plan directory as an earlier `dora plan --out` left it (every file marked, so any rewrite shows), with a
    launch file that lowering no longer writes and a file of the user's."""
    write_plan_dir(*tiny, out)
    for path in out.rglob("*"):
        if path.is_file() and path != out / "plan.json":
            path.write_bytes(path.read_bytes() + b"\nearlier plan\n")
    plan = json.loads((out / "plan.json").read_text())
    (out / "plan.json").write_text(json.dumps(plan | {"dora_version": "earlier plan"}))  # still a plan dora wrote
    (out / "launch" / "stale.txt").write_text("from an earlier lowering")
    (out / "notes.md").write_text("the user's own file")


def fail_on_write(monkeypatch: pytest.MonkeyPatch, n: int) -> list[Path]:
    """Make the ``n``-th file write (0-based) fail as a full disk does; the paths written, in order."""
    real = render_module._write_file
    written: list[Path] = []

    def write(path: Path, text: str, mode: int) -> None:
        if len(written) == n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, text, mode)
        written.append(path)

    monkeypatch.setattr(render_module, "_write_file", write)
    return written


FILES = 10  # what write_plan_dir writes for local-tiny (5 plan files, 5 launch artifacts)


def test_the_plan_writes_the_files_the_failure_tests_count(tiny, tmp_path: Path) -> None:
    written = write_plan_dir(*tiny, tmp_path / "plan")
    assert len(written) == FILES and all(p.is_file() for p in written)
    assert sorted(p.name for p in (tmp_path / "plan").iterdir()) == TOP


@pytest.mark.parametrize("n", range(FILES))
def test_a_failed_write_leaves_no_directory_behind(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   n: int) -> None:
    out = tmp_path / "plans" / "new" / "plan"  # its parents are made too, and removed again
    fail_on_write(monkeypatch, n)
    with pytest.raises(OSError) as failed:
        write_plan_dir(*tiny, out)
    assert failed.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n", range(FILES))
def test_a_failed_write_leaves_an_earlier_plan_as_it_was(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         n: int) -> None:
    out = tmp_path / "plan"
    earlier_plan(out, tiny)
    before = snapshot(tmp_path)
    written = fail_on_write(monkeypatch, n)
    with pytest.raises(OSError, match="No space left on device"):
        write_plan_dir(*tiny, out)
    assert len(written) == n
    assert snapshot(tmp_path) == before  # no new plan.json beside the old launch/, no temporary directory


@pytest.mark.parametrize("n", range(2 * len(TOP)))
def test_a_failed_rename_puts_the_earlier_plan_back(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    n: int) -> None:
    """The swap moves each earlier entry aside and the new one in (12 renames): any of them failing is undone."""
    out = tmp_path / "plan"
    earlier_plan(out, tiny)
    before = snapshot(tmp_path)
    real = os.replace
    calls = []

    def replace(src, dst):
        if out in (Path(src).parent, Path(dst).parent):
            calls.append((src, dst))
            if len(calls) == n + 1:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(src), None, str(dst))
        return real(src, dst)

    monkeypatch.setattr(render_module.os, "replace", replace)
    with pytest.raises(OSError) as failed:
        write_plan_dir(*tiny, out)
    monkeypatch.undo()
    assert failed.value.errno == errno.EIO
    assert ".dora-" not in str(failed.value.filename)  # the error names the plan's file, not a temporary copy
    assert snapshot(tmp_path) == before


def test_a_new_plan_replaces_doras_files_and_keeps_the_users(tiny, tmp_path: Path) -> None:
    out = tmp_path / "plan"
    earlier_plan(out, tiny)
    written = write_plan_dir(*tiny, out)
    fresh = tmp_path / "fresh"
    assert [p.relative_to(out) for p in written] == [p.relative_to(fresh) for p in write_plan_dir(*tiny, fresh)]
    mine = out / "notes.md"
    assert mine.read_text() == "the user's own file"
    mine.unlink()
    assert snapshot(out) == snapshot(fresh)  # byte for byte and mode for mode: no stale launch file, no leftovers


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_something_in_the_way_of_launch_is_refused_not_deleted(tiny, tmp_path: Path, kind: str) -> None:
    """A directory where plan.json goes was always refused; a file (or link) where launch/ goes is refused the
    same way: dora never wrote it, so it is not dora's to delete."""
    out = tmp_path / "plan"
    write_plan_dir(*tiny, out)  # an earlier plan's directory, whose launch/ the user replaced
    shutil.rmtree(out / "launch")
    (tmp_path / "elsewhere").mkdir()
    if kind == "file":
        (out / "launch").write_text("the user's notes on how to launch")
    else:
        (out / "launch").symlink_to(tmp_path / "elsewhere")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match="in the way of its launch/ directory"):
        write_plan_dir(*tiny, out)
    with pytest.raises(FileExistsError, match="in the way of its launch/ directory"):
        write_launch_artifacts(tiny[0], tiny[1].plan, out)
    assert snapshot(tmp_path) == before


def test_plan_out_on_a_full_disk_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "plan"
    fail_on_write(monkeypatch, 3)
    assert main(["plan", str(TINY), "--out", str(out)]) == 1  # an error of the machine's, not bad input (2)
    err = capsys.readouterr().err
    assert f"cannot write the plan to {out}/: No space left on device" in err
    assert "free space" in err and "writable" not in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_long_legal_directory_name_is_written(tiny, tmp_path: Path) -> None:
    """The staging directory beside a new DIR was `.DIR.dora-new-XXXXXXXX`: a name of 240+ bytes could not be
    written, and the error blamed the parent."""
    out = tmp_path / "plans" / ("p" * 250)
    write_plan_dir(tiny[0], tiny[1], out)
    assert sorted(p.name for p in out.iterdir()) == TOP
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no staging directory left beside it


@pytest.mark.parametrize("where", ["dir", "parent"])
def test_a_name_too_long_for_the_filesystem_is_named_before_anything_is_made(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str],
                                                                              monkeypatch: pytest.MonkeyPatch,
                                                                              where: str) -> None:
    monkeypatch.chdir(REPO)
    long = tmp_path / "plans" / ("p" * 256)
    out = long if where == "dir" else long / "x"
    assert main(["plan", str(TINY), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the plan to {out}/: File name too long: 256 bytes, and this filesystem allows at most" in err
    assert "to fix: choose a shorter name for --out" in err and "Traceback" not in err
    assert (f"({long})" in err) == (where == "parent")  # the directory whose name is too long, when not --out's
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_holds_no_plan_is_not_taken_over(tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`--out` into a directory of the user's that never held a plan replaced its launch/ wholesale and its
    report.txt: refused, naming them, and nothing is touched."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "project"
    (out / "launch").mkdir(parents=True)
    (out / "launch" / "deploy.sh").write_text("echo mine")
    (out / "report.txt").write_text("my notes")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match="it holds launch/, report.txt but no plan `dora plan` wrote"):
        write_plan_dir(*tiny, out)
    assert main(["plan", str(TINY), "--json", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before planning: no report or plan JSON printed for a plan not written
    err = captured.err
    assert f"cannot write the plan to {out}/: it holds launch/, report.txt but no plan `dora plan` wrote" in err
    assert "to fix: move that out of the way, or choose another directory for --out" in err
    assert snapshot(tmp_path) == before
    (out / "plan.json").write_text('{"format_version": 5}')  # a plan.json, but not one dora wrote
    with pytest.raises(FileExistsError, match="it holds launch/, plan.json, report.txt but no plan"):
        write_plan_dir(*tiny, out)


def test_a_directory_of_other_files_or_an_empty_one_is_written(tiny, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    write_plan_dir(*tiny, empty)
    assert sorted(p.name for p in empty.iterdir()) == TOP
    assert set(TOP) == set(PLAN_DIR_ENTRIES)
    others = tmp_path / "others"  # nothing of the user's in the way of dora's entries
    others.mkdir()
    (others / "notes.md").write_text("the user's own file")
    write_plan_dir(*tiny, others)
    assert sorted(p.name for p in others.iterdir()) == sorted([*TOP, "notes.md"])
    write_plan_dir(*tiny, others)  # and again: it now holds dora's plan
    assert (others / "notes.md").read_text() == "the user's own file"


def test_the_report_and_launch_files_print_the_figures_plan_json_holds(tiny, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """plan.json rounds to 6 significant digits; report.txt and the printed report were made from the unrounded plan
    (117,074.4 accelerator-hours where plan.json holds 117074.0)."""
    import dataclasses

    import dora.plan_cmd
    from dora.report import plan_report_text
    from planner.plan import Plan

    resolved, planned = tiny
    plan = planned.plan
    unrounded = dataclasses.replace(planned, plan=dataclasses.replace(plan, predictions=dataclasses.replace(
        plan.predictions, accelerator_hours=117074.41234)))
    out = tmp_path / "plan"
    write_plan_dir(resolved, unrounded, out)
    saved = Plan.from_dict(json.loads((out / "plan.json").read_text()))
    assert saved.predictions.accelerator_hours == 117074.0
    report = (out / "report.txt").read_text()
    assert report == plan_report_text(saved) and "117,074.0" in report
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(dora.plan_cmd, "make_plan", lambda *args, **kwargs: unrounded)
    assert main(["plan", str(TINY)]) == 0
    printed = capsys.readouterr().out
    assert "117,074.0" in printed and "117,074.4" not in printed


def test_a_file_size_limit_is_not_called_a_full_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    real = render_module._write_file

    def write(path: Path, text: str, mode: int) -> None:
        if path.name == "timeline.html":
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        real(path, text, mode)

    monkeypatch.setattr(render_module, "_write_file", write)
    assert main(["plan", str(TINY), "--out", str(tmp_path / "plan")]) == 1
    err = capsys.readouterr().err
    assert "File too large" in err and "`ulimit -f`" in err and "free space" not in err
    assert list(tmp_path.iterdir()) == []
