"""Fault injection for the reliability tests and ``bench/faults.py``: kill rollout workers, kill the run.

- ``WorkerKiller``: an ``on_progress`` hook for an in-process ``Controller`` that kills a rollout worker's
  process (``ray.kill`` with restart allowed, or ``SIGKILL`` of its PID) once the given count of
  trajectories finished after the controller recovered from the previous kill, and waits for Ray to restart
  it. The controller must notice, reload and regenerate.
- ``kill_and_resume``: run a command (the driver, or ``dora apply``) in its own process group, ``SIGKILL``
  the group at random moments after it made progress, re-run the same command, and time each recovery.
- ``ledger``: from a trace, how many admitted trajectories were lost (neither trained nor accounted for)
  and how many were trained more than once -- the figures that must be 0.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dora.runtime.trace import read_jsonl


@dataclass
class WorkerKiller:
    """Kill a rollout worker holding requests once ``gaps[i]`` more trajectories finished since the controller
    recovered from the previous kill, alternating ``ray.kill`` (restart allowed) and ``SIGKILL`` of its PID.

    Each kill is seen by the controller, exactly once:

    - the hook blocks (the controller with it) until Ray has restarted the victim, so the controller's
      outstanding poll of the dead process has failed, or reaches the new process and is refused there
      (``WorkerRestarted``), by the time the controller looks again: a fast run cannot end first;
    - the next kill waits for the controller to have restarted the previous victim
      (``stats.worker_restarts``), so two deaths never fold into the one failure the controller sees.

    (The controller recovers synchronously, so the finishes of the other workers during a recovery are
    delivered together after it.)"""

    controller: Any
    gaps: Sequence[int]
    rng: random.Random
    methods: Sequence[str] = ("ray", "sigkill")
    restart_timeout_s: float = 60.0
    kills: list[dict[str, Any]] = field(default_factory=list)
    _armed_at: int = 0

    def __call__(self, stats: Any) -> None:
        import ray

        if len(self.kills) >= len(self.gaps):
            return
        if self.kills and self.kills[-1]["recovered_at"] is None:
            if stats.worker_restarts < len(self.kills):
                return  # the previous victim is not back yet
            self.kills[-1]["recovered_at"] = self._armed_at = stats.finished_trajectories
        if stats.finished_trajectories - self._armed_at < self.gaps[len(self.kills)]:
            return
        busy = [w for w in self.controller._workers if w.requests]
        if not busy:
            return  # kill one with work to regenerate: wait
        w = busy[self.rng.randrange(len(busy))]
        method = self.methods[len(self.kills) % len(self.methods)]
        try:  # the victim must be up to be killed; if it is not, pick again at the next call
            pid = ray.get(w.actor.pid.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        started = time.monotonic()
        if method == "ray":
            ray.kill(w.actor, no_restart=False)
        else:
            os.kill(pid, signal.SIGKILL)
        new_pid = wait_restarted(w.actor, pid, what=f"rollout worker {w.index}", timeout_s=self.restart_timeout_s)
        self._armed_at = stats.finished_trajectories
        self.kills.append({"worker": w.index, "method": method, "at_finished": stats.finished_trajectories,
                           "in_flight": len(w.requests), "pid": pid, "new_pid": new_pid,
                           "restart_s": round(time.monotonic() - started, 3), "recovered_at": None})


def wait_restarted(actor: Any, pid: int, *, what: str, timeout_s: float = 60.0) -> int:
    """Block until Ray has restarted ``actor``, whose process ``pid`` was killed; its new process id."""
    started = time.monotonic()
    while (new_pid := _pid(actor, timeout_s=5.0)) in (None, pid):
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{what} was not restarted within {timeout_s} s")
        time.sleep(0.05)
    assert new_pid is not None
    return new_pid


def _pid(actor: Any, timeout_s: float) -> int | None:
    """The actor's process id, or None while it is dead or restarting."""
    import ray

    try:
        return ray.get(actor.pid.remote(), timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def ledger(trace: Path) -> dict[str, int]:
    """``{"admitted", "trained", "lost", "duplicated", "regenerated"}`` counted from ``trace`` directly.

    lost: admitted, never trained, not discarded or recorded unfinished at the end; duplicated:
    trained by more than one step (or more than once by one).
    """
    events = read_jsonl(trace)
    admitted = {e["traj"] for e in events if e["type"] == "admitted"}
    uses: dict[str, int] = {}
    for e in events:
        if e["type"] == "train_step":
            for traj in e["consumed"]:
                uses[traj] = uses.get(traj, 0) + 1
    accounted: set[str] = set()
    for e in events:  # a later regeneration supersedes an earlier attempt's unfinished_at_end
        if e["type"] in ("discarded", "unfinished_at_end"):
            accounted.add(e["traj"])
        elif e["type"] == "regenerated":
            accounted.discard(e["traj"])
    return {
        "admitted": len(admitted),
        "trained": sum(1 for t in admitted if uses.get(t)),
        "lost": sum(1 for t in admitted if not uses.get(t) and t not in accounted),
        "duplicated": sum(1 for n in uses.values() if n > 1),
        "regenerated": sum(1 for e in events if e["type"] == "regenerated"),
    }


def kill_and_resume(argv: Sequence[str], *, trace: Path, kills: int, rng: random.Random, env: dict[str, str] | None = None,
                    cwd: Path | None = None, min_new_events: int = 20, max_new_events: int = 400,
                    attempt_timeout_s: float = 180.0) -> tuple[int, list[dict[str, Any]], str]:
    """Run ``argv``; ``kills`` times, SIGKILL its process group once this attempt recorded a random number
    of ``finished``/``train_step`` events (uniform in ``[min_new_events, max_new_events]``; the burst of
    ``regenerated``/``admitted`` a resume writes at once does not count), then run it again. Returns the final exit
    code, one record per fault (``recovery_s``: from the re-run to the first step trained after the
    checkpoint), and the last attempt's stderr.
    """
    faults: list[dict[str, Any]] = []
    for attempt in range(kills + 1):
        before = len(read_jsonl(trace)) if trace.exists() else 0
        started = time.monotonic()
        proc = subprocess.Popen(list(argv), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        target = rng.randint(min_new_events, max_new_events) if attempt < kills else None
        killed = False
        try:
            while proc.poll() is None:
                if time.monotonic() - started > attempt_timeout_s:
                    raise TimeoutError(f"attempt {attempt} of {' '.join(argv)} ran over {attempt_timeout_s:.0f} s")
                events = read_jsonl(trace)[before:] if trace.exists() else []
                _note_recovery(faults, events, started, attempt)
                progress = sum(e["type"] in ("finished", "train_step") for e in events)
                if target is not None and progress >= target:
                    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
                    proc.wait(timeout=30)
                    steps = [e["step"] for e in read_jsonl(trace) if e["type"] == "train_step"]
                    faults.append({"fault": "kill -9 run", "attempt": attempt, "after_events": progress,
                                   "last_step": max(steps, default=0), "recovery_s": None})
                    killed = True
                    break
                time.sleep(0.1)
        except BaseException:
            _kill_group(proc)
            raise
        _, err = proc.communicate(timeout=60)
        _note_recovery(faults, read_jsonl(trace)[before:] if trace.exists() else [], started, attempt)
        if not killed:  # finished: the last attempt, or one that ended before its kill point
            return proc.returncode, faults, err
    raise AssertionError("unreachable: the last attempt is never killed")


def _note_recovery(faults: list[dict[str, Any]], events: list[dict[str, Any]], started: float, attempt: int) -> None:
    """Time the last fault's recovery: the re-run that follows it trained its first step."""
    if faults and faults[-1]["recovery_s"] is None and faults[-1]["attempt"] < attempt \
            and any(e["type"] == "train_step" for e in events):
        faults[-1]["recovery_s"] = round(time.monotonic() - started, 2)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


__all__ = ["WorkerKiller", "kill_and_resume", "ledger"]
