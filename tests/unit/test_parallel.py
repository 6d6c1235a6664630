"""dora.parallel: the plan search's simulations spread over forked processes give the same plan."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dora.parallel import fork_map, single_threaded
from dora.planning import make_plan
from dora.spec import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _fresh(script: str) -> str:
    """Run ``script`` in a new, single-threaded interpreter (this test process runs many threads, where fork_map maps
    in-process, see ``dora.parallel``); its stdout."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=SPECS.parent)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_fork_map_keeps_order_and_runs_closures_in_other_processes() -> None:
    out = _fresh("import os\nfrom dora.parallel import fork_map\n"
                 "offset = 10  # a closure: nothing is pickled on the way in\n"
                 "def work(x):\n    return x + offset, os.getpid()\n"
                 "out = fork_map(2)(work, range(7))\n"
                 "assert [v for v, _ in out] == list(range(10, 17))\n"
                 "assert any(pid != os.getpid() for _, pid in out)\n"
                 "assert fork_map(1)(work, [1]) == [(11, os.getpid())]  # one worker: in-process\n"
                 "assert fork_map(4)(work, []) == []\n"
                 "print('ok')\n")
    assert out.strip() == "ok"


def test_a_process_running_other_threads_maps_in_process() -> None:
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not single_threaded()
        assert fork_map(2)(lambda x: (x, os.getpid()), range(3)) == [(i, os.getpid()) for i in range(3)]
    finally:
        stop.set()
        other.join()
    assert _fresh("from dora.parallel import single_threaded\nprint(single_threaded())\n").strip() == "True"


def test_parallel_plan_is_the_sequential_plan() -> None:
    resolved = load_spec(str(SPECS / "local-tiny.yaml"))
    sequential = make_plan(resolved).plan.to_dict()
    parallel = _fresh("import json\nfrom dora.planning import make_plan\nfrom dora.spec import load_spec\n"
                      "print(json.dumps(make_plan(load_spec('specs/local-tiny.yaml'), workers=2).plan.to_dict()))\n")
    assert json.loads(parallel) == json.loads(json.dumps(sequential))


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
