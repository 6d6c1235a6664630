"""One run at a time per output directory: a second run stops at once, naming the holder; a killed holder leaves
no stale lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora.apply import ApplyOverrides, run_apply
from dora.runtime.runlock import LOCK_FILE, RunDirBusy, run_dir_lock

HOLD = """
import sys, time
from pathlib import Path
from dora.runtime.runlock import run_dir_lock
with run_dir_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def _holder(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_and_a_killed_one_leaves_no_lock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _holder(out)
    try:
        with pytest.raises(RunDirBusy, match=rf"in use by another dora run \(pid {proc.pid} on "):
            with run_dir_lock(out):
                raise AssertionError("took a lock another process holds")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (out / LOCK_FILE).read_text().startswith(f"pid {proc.pid} ")  # kill -9 left the file, not the lock
    with run_dir_lock(out):  # the kernel dropped the dead holder's lock
        with run_dir_lock(out):  # re-entrant in one process (dora apply, then run_job)
            assert (out / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
    assert not (out / LOCK_FILE).exists()  # removed on leaving the block
    with run_dir_lock(out):  # and taken again
        assert (out / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")


def test_apply_into_a_directory_another_run_holds_stops_before_writing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    proc = _holder(out)
    try:
        t0 = time.monotonic()
        code = run_apply("specs/local-tiny.yaml", overrides=ApplyOverrides(output_dir=str(out), steps=2), live=False)
        assert code == 1 and time.monotonic() - t0 < 30
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert "is in use by another dora run" in " ".join(capsys.readouterr().err.split())  # the console wraps it
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # the holder's; no runtime.json, no trace


def test_a_lock_held_for_a_moment_is_waited_for(tmp_path: Path) -> None:
    """`dora apply --address` tests a directory's lock with a shared one it drops at once: a run starting in that
    moment was refused as if another run held the directory (109 of 3,000 starts beside a checking loop)."""
    import fcntl
    import threading

    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    release = threading.Timer(0.03, lambda: os.close(fd))
    release.start()
    try:
        with run_dir_lock(out):
            assert (out / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
    finally:
        release.join()
