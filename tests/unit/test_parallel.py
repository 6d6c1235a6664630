"""dora.parallel: the plan search's simulations spread over forked processes give the same plan."""

from __future__ import annotations

import os
from pathlib import Path

from dora.parallel import fork_map
from dora.planning import make_plan
from dora.spec import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


def test_fork_map_keeps_order_and_runs_closures_in_other_processes() -> None:
    offset = 10  # a closure: nothing is pickled on the way in

    def work(x: int) -> tuple[int, int]:
        return x + offset, os.getpid()

    out = fork_map(2)(work, range(7))
    assert [v for v, _ in out] == list(range(10, 17))
    assert any(pid != os.getpid() for _, pid in out)
    assert fork_map(1)(work, [1]) == [(11, os.getpid())]  # one worker: in-process
    assert fork_map(4)(work, []) == []


def test_parallel_plan_is_the_sequential_plan() -> None:
    resolved = load_spec(str(SPECS / "local-tiny.yaml"))
    sequential = make_plan(resolved).plan.to_dict()
    assert make_plan(resolved, workers=2).plan.to_dict() == sequential


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no one reaped yet has exited
    except FileNotFoundError:
        return True


def test_workers_exit_when_the_command_is_killed(tmp_path: Path) -> None:
    # SIGKILL leaves the parent no chance to stop its pool: the kernel must take the workers down with it.
    import signal
    import subprocess
    import sys
    import time

    script = ("import os, sys, time\nfrom dora.parallel import fork_map\n"
              "def work(i):\n    open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\n    time.sleep(120)\n"
              "fork_map(2)(work, range(2))\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the workers did not start"
            time.sleep(0.05)
        workers = [int(p.name) for p in tmp_path.iterdir()]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in workers):
            assert time.monotonic() < deadline, f"workers {workers} outlived the killed command"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
