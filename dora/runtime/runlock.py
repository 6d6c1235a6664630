"""One run at a time per output directory.

Two `dora apply` runs writing one output directory would interleave their traces and checkpoints, and the second
would resume from the first's half-written state. A run holds an exclusive ``flock`` on ``<output_dir>/.dora-run.lock``
from before it reads the checkpoint until its outputs are written; a second run finds it held and stops at once,
naming the holder. The holder removes the file when it is done; the kernel releases the lock when the holder's
process ends however it ends (``kill -9`` included), so a crashed run leaves at most a file nobody holds, which the
next run takes over. Taking the lock checks that the path still names the file locked (a holder that was just
finishing may have removed it), and starts over if not.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".dora-run.lock"

_HELD: set[Path] = set()
"""Output directories this process holds (``dora apply`` takes the lock, then ``run_job`` finds it held)."""


class RunDirBusy(Exception):
    """Another process holds the output directory's lock."""


@contextmanager
def run_dir_lock(output_dir: Path) -> Iterator[None]:
    """Hold ``output_dir``'s run lock (creating the directory) for the ``with`` block; ``RunDirBusy`` if another
    process holds it, ``OSError`` if the directory or its lock file cannot be created. Re-entrant in one process."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    key = output_dir.resolve()
    if key in _HELD:
        yield
        return
    path = output_dir / LOCK_FILE
    fd = _lock(path, output_dir)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)
            path.unlink(missing_ok=True)  # still locked: whoever opens it now finds it gone once they hold it
    finally:
        os.close(fd)  # releases the lock


BRIEF_HOLD_S = 0.1
"""How long a run waits for a lock held only for a moment (another process testing it) before calling it busy."""


def _exclusive(fd: int) -> None:
    """Lock ``fd`` exclusively, retrying for ``BRIEF_HOLD_S``; ``BlockingIOError`` when another process holds it."""
    deadline = time.monotonic() + BRIEF_HOLD_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _lock(path: Path, output_dir: Path) -> int:
    """An open descriptor of ``path``, exclusively locked, ``path`` still naming it. A lock held for less than
    ``BRIEF_HOLD_S`` is waited for: `dora apply --address` tests the lock with a shared one it drops at once."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _exclusive(fd)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "a process"
            os.close(fd)
            raise RunDirBusy(f"{output_dir}/ is in use by another dora run ({holder}): wait for it to finish or stop "
                             "it (Ctrl-C, or `dora stop` for a submitted job), or give this run another --output-dir"
                             ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed it after we opened it: lock the file that is there now
