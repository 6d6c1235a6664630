"""Run independent, pure computations on several cores: the plan search's simulations.

``fork_map(workers)`` returns a ``map``-like function for ``planner.search.search``. Each call forks ``workers``
processes that inherit the function and its inputs (nothing is pickled on the way in: closures work), and
returns the results in input order. Forking is only safe before threads or native thread pools start, so only
the ``dora plan`` command uses it, and a call from a process that runs more than one thread maps in-process: a
``dora plan`` run inside the test process (80 threads by then, Ray's libraries loaded) hung, because a forked pool
worker kept a SIGTERM handler that does not exit, and the pool's teardown waited on it for ever. Without ``fork``
(not Linux/macOS), with one worker or one item, it maps in-process too. Results are the same either way: each
simulation is seeded.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

_JOB: tuple[Callable[[Any], Any], Sequence[Any]] | None = None
"""The function and items of the running ``fork_map`` call, inherited by the forked workers."""


def _die_with_parent(parent: int) -> None:
    """Pool worker initializer: exit when ``dora plan`` does. A Ctrl-C reaches the whole process group, but a SIGTERM
    or SIGKILL sent to the command alone would leave its workers simulating, orphaned, for up to minutes. On Linux the
    kernel sends SIGTERM to the worker when its parent dies (PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _run(index: int) -> Any:
    assert _JOB is not None
    fn, items = _JOB
    return fn(items[index])


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def single_threaded() -> bool:
    """Whether this process runs one thread, native ones included (``/proc/self/task`` on Linux; elsewhere Python's
    own threads only): the only state in which forking copies every lock in a consistent state."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return threading.active_count() == 1


def fork_map(workers: int) -> Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]:
    def run(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        global _JOB
        items = list(items)
        n = min(workers, len(items))
        if n <= 1 or "fork" not in multiprocessing.get_all_start_methods() or not single_threaded():
            return [fn(x) for x in items]
        _JOB = (fn, items)
        try:
            with multiprocessing.get_context("fork").Pool(n, initializer=_die_with_parent,
                                                          initargs=(os.getpid(),)) as pool:
                return pool.map(_run, range(len(items)), chunksize=1)
        finally:
            _JOB = None

    return run
