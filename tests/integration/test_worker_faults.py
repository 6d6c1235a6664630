"""Rollout-worker failure and the watchdog on a real local Ray (its own instance, started after the cluster module's
Ray head is gone): workers killed mid-run are restarted and nothing is lost; a stalled pipeline is stopped with a
report of what it waits for. The planner's checker judges every trace.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

from dora.runtime.faults import WorkerKiller, ledger
from dora.runtime.trace import read_jsonl
from planner.schedule import check_trace

sys.path.insert(0, str(Path(__file__).parent))
from test_apply_local import _short_spec  # noqa: E402  (the shortened local-tiny spec)

pytestmark = pytest.mark.integration


def _controller(tmp_path: Path, mode: str, steps: int, spec: Path | None = None, **changes):
    import dataclasses

    from dora.apply import ApplyOverrides, runtime_config_for
    from dora.runtime.controller import Controller
    from dora.runtime.driver import controller_config
    from dora.spec import load_spec

    rc = runtime_config_for(load_spec(str(spec or _short_spec(tmp_path))), ApplyOverrides(
        mode=mode, steps=steps, rollout_workers=2, max_num_seqs=16, output_dir=str(tmp_path / mode)))
    config = dataclasses.replace(controller_config(rc, cpus=2), **changes)
    return Controller(config), config


@pytest.fixture(scope="module")
def _ray_instance():
    """A fresh local Ray instance of its own, shared by this module's tests (a start and stop cost about 5 s)."""
    import ray

    # an instance of its own: without an address Ray joins any `ray start` cluster on the machine, or a dead one's
    # leftover /tmp/ray/ray_current_cluster
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def joined(_ray_instance):
    """The module's Ray instance, which each test leaves as it found it: once the run is over every CPU its actors held
    is free again (the controller stops what it starts, killed and stopped runs included), so the next test gets the
    whole instance."""
    import ray

    yield
    deadline = time.monotonic() + 10.0
    while (free := ray.available_resources().get("CPU", 0.0)) < 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free == 2.0, f"the run left actors holding {2.0 - free:g} of Ray's 2 CPUs"


def test_rollout_workers_killed_at_five_points_are_restarted_and_nothing_is_lost(tmp_path, joined):
    # Each kill hits a worker holding requests 1-8 finished trajectories after the controller restarted the
    # previous victim; results arrive about a step's worth at a time, so five kills take some 10 of the 24 steps.
    controller, config = _controller(tmp_path, "streaming", steps=24)
    # multi-version engines: a killed worker held requests of several versions and must host each again
    assert config.policy.max_versions_per_engine > 1
    rng = random.Random(3)
    killer = WorkerKiller(controller, [rng.randint(1, 8) for _ in range(5)], rng)
    controller.on_progress = killer
    stats = controller.run()
    assert len(killer.kills) == 5, (killer.kills, stats.finished_trajectories)
    assert stats.worker_restarts == 5 and len(stats.recovery_s) == 5
    events = read_jsonl(config.output_dir / "trace.jsonl")
    assert sum(e["type"] == "worker_restarted" for e in events) == 5
    report = check_trace(events, k=config.policy.max_version_lag, allow_version_mixing=False)
    assert report.ok, report.violations[:5]
    counts = ledger(config.output_dir / "trace.jsonl")
    assert counts["lost"] == 0 and counts["duplicated"] == 0, counts
    assert report.num_consumed == 24 * 4 * 4
    print("worker kills:", killer.kills, "recovery_s:", stats.recovery_s)


def test_colocated_streaming_survives_worker_kills(tmp_path, joined):
    """Colocated streaming with rollout workers killed: most kills land while rollout is suspended (the progress hook
    runs as a step ends, and a colocated step trains with every engine stopped), and a worker restarted then must come
    back stopped; either way nothing is lost or duplicated and the trace passes the checker."""
    spec = _short_spec(tmp_path, placement={"colocated": True})
    controller, config = _controller(tmp_path, "streaming", steps=12, spec=spec)
    assert config.policy.colocated
    rng = random.Random(5)
    killer = WorkerKiller(controller, [rng.randint(1, 8) for _ in range(3)], rng)
    controller.on_progress = killer
    stats = controller.run()
    assert len(killer.kills) == 3 and stats.worker_restarts == 3, (killer.kills, stats.finished_trajectories)
    events = read_jsonl(config.output_dir / "trace.jsonl")
    report = check_trace(events, k=config.policy.max_version_lag, allow_version_mixing=False)
    assert report.ok, report.violations[:5]
    assert report.num_consumed == 12 * 4 * 4
    counts = ledger(config.output_dir / "trace.jsonl")
    assert counts["lost"] == 0 and counts["duplicated"] == 0, counts
    assert sum(e["type"] == "rollout_suspended" for e in events) >= 1


def test_watchdog_reports_what_a_stalled_run_waits_for(tmp_path, joined):
    import ray

    from dora.runtime.controller import PipelineStalled

    controller, _ = _controller(tmp_path, "streaming", steps=50, watchdog_s=3.0)
    frozen: list[int] = []

    def freeze(stats) -> None:  # after the first step, stop every rollout process (SIGSTOP: alive, silent)
        if stats.steps and not frozen:
            for w in controller._workers:
                pid = ray.get(w.actor.pid.remote())
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)

    controller.on_progress = freeze
    started = time.monotonic()
    try:
        with pytest.raises(PipelineStalled, match=r"no progress for \d+ s \(watchdog 3 s\)") as info:
            controller.run()
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert time.monotonic() - started < 120
    message = str(info.value)
    assert "rollout worker 0" in message and "rollout worker 1" in message and "last reply" in message
    assert "waits for" in message or "waiting for the trainer" in message


def test_ctrl_c_while_a_step_commits_waits_for_the_commit(tmp_path, joined, terminal_sigint):
    # A real SIGINT lands while step 3 writes its checkpoint, after the controller took its groups as trained: the
    # step's trace event must still be written before the KeyboardInterrupt, or its batch is lost from the trace.
    import os
    import signal

    controller, config = _controller(tmp_path, "streaming", steps=20)
    checkpoint = controller._checkpoint

    def checkpoint_then_ctrl_c(step, event, metrics_row=None) -> None:
        checkpoint(step, event, metrics_row)
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    controller._checkpoint = checkpoint_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        controller.run()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    events = read_jsonl(config.output_dir / "trace.jsonl")
    assert [e["step"] for e in events if e["type"] == "train_step"] == [1, 2, 3]
    assert len(read_jsonl(config.output_dir / "metrics.jsonl")) == 3
    counts = ledger(config.output_dir / "trace.jsonl")
    assert counts["lost"] == 0 and counts["duplicated"] == 0, counts
    report = check_trace(events, k=config.policy.max_version_lag, allow_version_mixing=False)
    assert report.ok, report.violations[:5]


def test_a_run_stopped_while_a_step_trains_accounts_for_that_steps_batch(tmp_path, joined):
    # Ctrl-C (or any stop) lands while the trainer holds a batch: the step never finished, so its trajectories
    # were not trained and must be recorded unfinished, not silently lost.
    from dora.runtime.controller import Controller

    controller, config = _controller(tmp_path, "streaming", steps=20)
    train, taken = Controller._train, []

    def train_then_stop(self, act) -> None:
        train(self, act)
        taken.append(act)
        if len(taken) == 3:
            raise KeyboardInterrupt

    controller._train = train_then_stop.__get__(controller)
    with pytest.raises(KeyboardInterrupt):
        controller.run()
    events = read_jsonl(config.output_dir / "trace.jsonl")
    trained = {t for e in events if e["type"] == "train_step" for t in e["consumed"]}
    unfinished = {e["traj"]: e["finished"] for e in events if e["type"] == "unfinished_at_end"}
    in_flight = [f"g{g}/{i}" for g in taken[-1].group_ids for i in range(4)]
    # an early step (streaming on separate engines) takes some groups while they still generate: those may be
    # unfinished; the checker below holds each ``finished`` flag to the trace
    joining = {f"g{g}/{i}" for g in taken[-1].joining for i in range(4)}
    assert not trained & set(in_flight) and set(in_flight) <= set(unfinished), unfinished
    assert all(unfinished[t] is True for t in in_flight if t not in joining), unfinished
    counts = ledger(config.output_dir / "trace.jsonl")
    assert counts["lost"] == 0 and counts["duplicated"] == 0, counts
    report = check_trace(events, k=config.policy.max_version_lag, allow_version_mixing=False)
    assert report.ok, report.violations[:5]


def test_a_run_stopped_while_an_early_step_waits_for_its_tail_accounts_for_every_group(tmp_path, joined):
    # k=1 streaming on separate engines starts a step held by the oldest version's tail early (PolicyConfig.
    # early_steps): the trainer holds part of the batch while the rest still generates. A stop then must record the
    # whole batch unfinished, the generating groups' trajectories with finished=False, and train none of it.
    from dora.runtime.controller import Controller

    spec = _short_spec(tmp_path, max_version_lag=1, placement={"colocated": False,
                                                               "rollout": {"versions_per_engine": 2}})
    controller, config = _controller(tmp_path, "streaming", steps=40, spec=spec)
    assert config.policy.early_steps
    train, early = Controller._train, []

    def train_then_stop_if_early(self, act) -> None:
        train(self, act)
        if self._early is not None:  # the step is waiting for a group that still generates
            early.append((act, set(self._early.waiting)))
            raise KeyboardInterrupt

    controller._train = train_then_stop_if_early.__get__(controller)
    with pytest.raises(KeyboardInterrupt):
        controller.run()
    assert early, "no step started early in 40 steps of k=1 streaming"
    act, waiting = early[0]
    events = read_jsonl(config.output_dir / "trace.jsonl")
    assert act.step not in {e["step"] for e in events if e["type"] == "train_step"}
    trained = {t for e in events if e["type"] == "train_step" for t in e["consumed"]}
    unfinished = {e["traj"]: e["finished"] for e in events if e["type"] == "unfinished_at_end"}
    batch = {f"g{g}/{i}" for g in act.group_ids for i in range(4)}
    generating = {f"g{g}/{i}" for g in waiting for i in range(4)}
    assert generating and not trained & batch and batch <= set(unfinished), unfinished
    assert all(unfinished[t] for t in batch - generating) and not all(unfinished[t] for t in generating)
    counts = ledger(config.output_dir / "trace.jsonl")
    assert counts["lost"] == 0 and counts["duplicated"] == 0, counts
    report = check_trace(events, k=config.policy.max_version_lag, allow_version_mixing=False)
    assert report.ok, report.violations[:5]


def test_a_worker_killed_while_an_early_step_waits_on_its_group_is_restarted_and_the_step_takes_the_group(
        tmp_path, joined):
    # The rollout worker generating a group an early step waits for dies: the controller restarts it and regenerates
    # the group's unfinished trajectories on their version, and the step takes the group when they finish; nothing is
    # lost or trained twice and the trace passes the checker.
    import ray

    from dora.runtime.controller import Controller
    from dora.runtime.faults import wait_restarted

    spec = _short_spec(tmp_path, max_version_lag=1, placement={"colocated": False,
                                                               "rollout": {"versions_per_engine": 2}})
    steps = 8
    controller, config = _controller(tmp_path, "streaming", steps=steps, spec=spec)
    train, killed = Controller._train, []

    def train_then_kill(self, act) -> None:
        train(self, act)
        if killed or self._early is None:
            return
        waiting = {f"g{g}/" for g in self._early.waiting}
        victim = next((w for w in self._workers if any(r[:r.index("/") + 1] in waiting for r in w.requests)), None)
        if victim is None:
            return
        pid = ray.get(victim.actor.pid.remote(), timeout=30)
        ray.kill(victim.actor, no_restart=False)
        wait_restarted(victim.actor, pid, what="the killed rollout worker")  # back before the controller looks again
        killed.append((act.step, sorted(self._early.waiting)))

    controller._train = train_then_kill.__get__(controller)
    stats = controller.run()
    assert killed, f"no early step in {steps} steps of k=1 streaming"
    assert stats.worker_restarts == 1
    step, waiting = killed[0]
    events = read_jsonl(config.output_dir / "trace.jsonl")
    regenerated = {e["traj"] for e in events if e["type"] == "regenerated"}
    # the waiting groups are the step's, however they finished: on the worker before it died (a poll's reply can
    # beat the kill) or generated again on the restarted one
    (event,) = [e for e in events if e["type"] == "train_step" and e["step"] == step]
    assert {f"g{g}/{i}" for g in waiting for i in range(4)} <= set(event["consumed"])
    print("step", step, "regenerated for it:", sorted(t for t in regenerated if int(t[1:t.index("/")]) in waiting))
    report = check_trace(events, k=config.policy.max_version_lag, allow_version_mixing=False)
    assert report.ok, report.violations[:5]
    assert report.num_consumed == steps * 4 * 4
    counts = ledger(config.output_dir / "trace.jsonl")
    assert counts["lost"] == 0 and counts["duplicated"] == 0, counts
