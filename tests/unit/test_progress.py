"""`dora plan`'s progress line: the simulations counted as the search runs them, shown on a terminal only."""

from __future__ import annotations

import io

from test_lower_plans import example_planned, load_example

from dora.planning import make_plan
from dora.terminal import StatusLine


class _Console:
    def __init__(self, terminal: bool) -> None:
        self.file = io.StringIO()
        self.is_terminal = terminal


def test_the_progress_callback_counts_every_simulation_and_leaves_the_plan_as_it_was() -> None:
    calls: list[tuple[int, int]] = []
    planned = make_plan(load_example("local-tiny"), progress=lambda done, running: calls.append((done, running)))
    assert planned.plan == example_planned("local-tiny").plan
    # before each batch (done, n), after it (done + n, 0): a batch never starts before the last one ended
    assert len(calls) >= 4 and len(calls) % 2 == 0
    for (before, running), (after, zero) in zip(calls[::2], calls[1::2], strict=True):
        assert running > 0 and after == before + running and zero == 0
    assert [c[0] for c in calls[::2]] == [0] + [c[0] for c in calls[1:-1:2]]
    # local-tiny pins its placement, so the count goes on through the sync search with the pins lifted
    finalists = len(planned.outcome.finalists)
    assert calls[-1][0] > finalists


def test_the_status_line_is_rewritten_in_place_on_a_terminal_and_absent_elsewhere() -> None:
    tty = _Console(terminal=True)
    line = StatusLine(tty)
    line.show("planning x: screening the candidates")
    line.show("planning x: 3 candidate plans simulated (1 s)")
    line.clear()
    line.clear()  # once shown, cleared once
    assert tty.file.getvalue() == ("\r\x1b[Kplanning x: screening the candidates"
                                   "\r\x1b[Kplanning x: 3 candidate plans simulated (1 s)\r\x1b[K")
    piped = _Console(terminal=False)
    line = StatusLine(piped)
    line.show("planning x")
    line.clear()
    assert piped.file.getvalue() == ""


def test_a_long_status_is_cut_to_the_terminal_width() -> None:
    tty = _Console(terminal=True)
    StatusLine(tty).show("x" * 500)  # a StringIO has no terminal size: 80 columns assumed
    assert tty.file.getvalue() == "\r\x1b[K" + "x" * 79


def test_dora_plan_shows_its_progress_on_a_terminal_and_clears_it_before_the_report() -> None:
    """stderr a terminal (a pty), stdout a pipe: the status line goes to the terminal, rewritten in place and cleared
    at the end; the report on stdout holds none of it."""
    import os
    import pty
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    master, slave = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "dora.cli", "plan", "specs/local-tiny.yaml"], cwd=repo,
                              stdout=subprocess.PIPE, stderr=slave, text=True, timeout=300,
                              env={**os.environ, "TERM": "xterm"})
    finally:
        os.close(slave)
    chunks = []
    while True:  # the child has exited: read what it left in the terminal until the pty reports its end
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: no writer left
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    err = b"".join(chunks).decode()
    assert proc.returncode == 0, err
    assert "\r\x1b[Kplanning local-tiny: screening the candidates" in err
    assert "candidate plans simulated" in err and err.endswith("\r\x1b[K")
    assert "planning local-tiny" not in proc.stdout and proc.stdout.startswith("dora plan: local-tiny")
