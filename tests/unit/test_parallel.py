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
