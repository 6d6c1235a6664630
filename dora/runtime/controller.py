"""The runtime controller: the second driver of the scheduling policies (the simulator is the first).

It owns the Ray actors (rollout workers, trainer), reports their events to the policy object made by
``planner.policies.make_policy`` and executes the actions it returns, following the driver contract
in ``planner.policies``. It decides nothing itself: admission, weight loads, migrations and batches
all come from the policy.

Event loop: every outstanding Ray call (one poll and at most one command per worker; trainer calls;
weight publications) sits in ``_pending``; ``ray.wait`` returns the first that completes and its
handler turns it into policy events. Per worker, commands run one at a time in the order the policy
issued them, and finished trajectories are processed in the worker's message order (see
``dora.runtime.actors``), which is what makes "``RequestsMigrated`` before any later finish of a
moved request" hold. A worker's poll is re-armed once its message is processed, and carries the admissions
that processing made to that worker when no command of its is queued or running (a Ray round trip each saved:
most admissions follow a finish on the same worker); the worker keeps them in order with its commands.

Data: prompt group ``g`` is a pure function of ``(seed, g)`` and the sampling seed of trajectory
``g{g}/{i}`` of ``(seed, g, i)``, so every mode sees the same prompts and the same sampling noise.
Weights: version ``v`` is put into Ray's object store once (the trainer's ``publish`` return value);
workers resolve that reference when they load it, the controller never fetches the weights.
"""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from dora.runtime.actors import (
    STEP_LOG_COLUMNS,
    STEP_LOG_FILE,
    EngineFailed,
    RolloutWorker,
    TrainerActor,
    WorkerCounters,
    WorkerMessage,
    WorkerRestarted,
)
from dora.runtime.checkpoint import Checkpoint, CheckpointError, ResumePoint, checkpoint_dir, write_checkpoint
from dora.runtime.engines.base import (
    FinishedTrajectory,
    GenerationRequest,
    MigratingRequest,
    ScoredTrajectory,
    TrainMetrics,
)
from dora.runtime.engines.torch_rollout import RolloutConfig
from dora.runtime.engines.torch_trainer import TrainerConfig
from dora.runtime.heap import settle_heap
from dora.runtime.tasks import Prompt, TaskConfig, make_prompt, score
from dora.runtime.trace import JsonlWriter, RunStats, TraceWriter, write_text_atomic
from dora.terminal import Terminated, note_signal
from planner.policies import (
    POLL_LINGER_S,
    Admit,
    DropVersion,
    LoadWeights,
    MigrateRequests,
    PolicyConfig,
    PublishWeights,
    RequestsMigrated,
    ResumeRollout,
    RolloutResumed,
    RolloutSuspended,
    StartTrainStep,
    SuspendRollout,
    TrainStepFinished,
    TrajectoryFinished,
    WeightsLoaded,
    WeightsPublished,
    make_policy,
    poll_batching,
)
from planner.schedule.checker import mixes_versions
from planner.workload import LengthDistribution

Command = tuple[str, Callable[[], Any], Callable[[Any], None]]
"""``(kind, call, on_done)``; kind is ``load``, ``add``, ``import``, ``export``, ``suspend``, ``resume`` or ``drop``
(replay rules: ``_worker_failed``)."""


class PipelineStalled(RuntimeError):
    """The watchdog fired: no progress for ``watchdog_s``; the message says what the run waits for."""


class WorkerLost(RuntimeError):
    """A rollout worker died and was not restarted in time (or ran out of restarts)."""


class TrainerLost(RuntimeError):
    """The trainer's process died (the kernel's OOM killer, a lost node). It is not restarted: its state since the
    last checkpoint is gone, so the run stops, and a re-run resumes from that checkpoint."""


def _engine_failed(exc: EngineFailed) -> str:
    """``exc``'s own message (Ray's wrapper, ``RayTaskError``, adds the remote traceback, which the worker's log has)."""
    return str(getattr(exc, "cause", None) or exc)


def _trainer_argument_lost(exc: BaseException) -> bool:
    """Whether a rollout worker's call failed because an argument from the trainer (published weights) could not be
    computed: the trainer died. Ray raises that as the call's ``RayTaskError`` whose cause is the trainer's
    ``RayActorError``, and the error is an instance of both classes: caught as the worker's own death, it made the
    controller restart a live worker, whose reload of the same weights failed again."""
    return isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, ray.exceptions.RayActorError)


def _cause(exc: ray.exceptions.RayTaskError) -> str:
    """'RuntimeError: <its first sentence>': what failed in the actor, without Ray's wrapping, the remote traceback and
    the advice torch adds to a failed load."""
    first = str(exc.cause).strip().split("\n")[0].split(". ")[0]
    return f"{type(exc.cause).__name__}: {first or 'no detail'}"


def _trainer_lost(exc: BaseException, when: str) -> TrainerLost:
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
    return TrainerLost(f"the trainer died {when} ({type(cause).__name__}); the usual cause is the kernel's OOM "
                       "killer (see dmesg), or its node was lost")


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Everything one run needs, already resolved (``dora.runtime.driver`` builds it from the runtime config)."""

    policy: PolicyConfig
    rollout: RolloutConfig
    """One engine replica (= rollout group); ``policy.num_rollout_groups`` of them are started."""
    trainer: TrainerConfig
    megatron: dict[str, Any] | None = None
    """The lowered Megatron config when megatron-core trains (after the torch trainer's warm-up); ``None``: the
    torch trainer trains."""
    task: TaskConfig
    response_lengths: LengthDistribution
    """Target response lengths of the task (the long tail the asynchronous modes hide)."""
    temperature: float = 1.0
    seed: int = 0
    output_dir: Path
    warmup_learning_rate: float = 3e-3
    warmup_cache_dir: Path | None = None
    """Where the warm-up weights are cached (by content hash); ``None``: no cache."""
    worker_num_cpus: float = 0.5
    """Ray CPU reservation of one rollout worker (fractional so several fit on 2 cores)."""
    trainer_num_cpus: float = 0.5
    poll_timeout_s: float = 0.25
    """Longest a worker's poll waits with nothing finished (bounds how stale its counters get)."""
    poll_linger_s: float = POLL_LINGER_S
    """After a first finish, how long a poll waits for a group's worth (``samples_per_prompt``) more; with an
    admission queue of ``q >= 1`` groups, for ``q`` groups' worth, up to ``q`` times as long (``poll_batching``).
    It stops waiting when the engine has no request left. The default is the simulator's (``POLL_LINGER_S``, where
    the measurement behind it is)."""
    resume: ResumePoint | None = None
    """Continue a stopped run from its checkpoint (``dora.runtime.checkpoint``); ``None``: a fresh run."""
    checkpoint: bool = True
    """Checkpoint after warm-up and after every step (``<output_dir>/checkpoint/``)."""
    config_key: str = ""
    """Identifies the job in its checkpoints (``dora.runtime.checkpoint.config_key``)."""
    watchdog_s: float = 300.0
    """With no progress (a trajectory finished, a step trained, weights loaded or published) for this
    long, stop with a report of what the run waits for instead of hanging."""
    worker_max_restarts: int = 20
    """Ray restarts of one rollout worker process before the run fails."""
    restart_timeout_s: float = 60.0
    """Longest wait for a died rollout worker to come back."""

    @property
    def max_new_tokens(self) -> int:
        return self.response_lengths.max_tokens


@dataclass(kw_only=True)
class _Worker:
    """Controller-side state of one rollout worker."""

    index: int
    actor: Any
    commands: deque[Command] = field(default_factory=deque)
    busy: bool = False
    next_seq: int = 1
    held: dict[int, WorkerMessage] = field(default_factory=dict)
    migration: MigrateRequests | None = None
    counters: WorkerCounters | None = None
    running: Command | None = None
    epoch: int = 0
    """Incremented at each restart: replies from an earlier incarnation are ignored."""
    incarnation: str | None = None
    """The process token every poll and command addresses (see ``dora.runtime.actors``)."""
    target: int | None = None
    """The (global) version this worker serves or is loading, as last commanded."""
    requests: dict[str, GenerationRequest] = field(default_factory=dict)
    """Requests given to this worker (sent or queued), not yet finished or exported: what a restart regenerates."""
    queued_add: tuple[Command, list[GenerationRequest]] | None = None
    """The last add command and its request list, which grows while that command waits in ``commands``."""
    polling: bool = False
    """A poll of this incarnation is outstanding."""
    carry: list[GenerationRequest] = field(default_factory=list)
    """Requests for the next poll to carry (made while no poll was outstanding)."""
    carried: int = 0
    """Polls sent to this incarnation that carried requests: each command says how many came before it."""
    dead_counters: WorkerCounters | None = None
    """Counters of earlier incarnations (a restarted process counts from zero)."""
    last_heard: float = 0.0


Progress = Callable[[RunStats], None]
Phase = Callable[[str], None]
"""Told, in words, what the run does before its first step (starting actors, the warm-up), which can take a
while with nothing else to show."""


@dataclass(kw_only=True)
class _EarlyStep:
    """A training step the policy started before all its groups finished (``StartTrainStep.joining``)."""

    step: int
    waiting: set[int]
    """Its groups still generating."""
    joined: dict[int, float]
    """group -> when it finished and went to the trainer."""
    finish: Callable[[list[ScoredTrajectory]], None]
    """Submits the step's ``train_step`` with the last group's trajectories."""


class Controller:
    """One run (or one resumed attempt) of ``config.policy.mode``. Call ``run()`` once, with Ray initialised.

    Versions, steps and prompt-group ids are global (trace, actors, checkpoints). The policy is a fresh
    state machine per attempt: its version 0 is global version ``base`` (the checkpoint's step) and its
    group ``j`` is data group ``_data_group(j)``; ``_execute`` and the event calls translate.
    """

    def __init__(self, config: ControllerConfig, *, on_progress: Progress | None = None,
                 on_phase: Phase | None = None) -> None:
        self.config = config
        self.on_phase = on_phase
        resume = config.resume
        self.base = resume.step if resume else 0
        p = config.policy
        if self.base >= p.total_steps:
            raise ValueError(f"nothing to run: the checkpoint is at step {self.base} of {p.total_steps}")
        self.policy = make_policy(dataclasses.replace(p, total_steps=p.total_steps - self.base))
        self.on_progress = on_progress
        self._ctrl_c = _CtrlC()
        self.spp = p.samples_per_prompt
        self._poll_args = (config.poll_timeout_s, *poll_batching(p, config.poll_linger_s))
        out = Path(config.output_dir)
        self.trace = TraceWriter(out / "trace.jsonl", append=resume is not None,
                                 offset_s=resume.clock_s if resume else 0.0)
        self.metrics_out = JsonlWriter(out / "metrics.jsonl", append=resume is not None)
        self.stats = RunStats(
            num_workers=p.num_rollout_groups, slots_per_worker=p.slots_per_group, total_steps=p.total_steps, mode=p.mode,
            resumed_from_step=resume.step if resume else None,
        )
        self._pending: dict[Any, Callable[[Any], None]] = {}
        self._workers: list[_Worker] = []
        self._trainer: Any = None
        self._weights: dict[int, Any] = {}
        """global version -> ObjectRef of its published weights (kept while an engine may load it)."""
        self._asked_publish: tuple[int, Any, Any] | None = None
        """``(version, held ref, weights ref)``: the publish asked for with the training step that makes the version."""
        self._train_start: dict[int, float] = {}
        """global step -> when its span starts: its submission, or for a step submitted behind a publish in flight
        (``PolicyBase`` module doc: it queues behind it on the trainer actor) that publish's reply, the earliest the
        controller knows the trainer free."""
        self._publishing: list[int] | None = None
        """While a publish is in flight: the steps submitted behind it (at most one); None otherwise."""
        self._early: _EarlyStep | None = None
        """The running early step while some of its groups generate (``PolicyConfig.early_steps``)."""
        self._prompts: dict[int, Prompt] = {}
        self._group_version: dict[int, int] = {}
        self._scored: dict[int, list[ScoredTrajectory]] = {}
        self._trained_groups: set[int] = set(resume.consumed_groups) if resume else set()
        self._regenerate = resume.regenerate if resume else ()
        self._next_group = resume.next_group if resume else 0
        self._local_group: dict[int, int] = {}
        self._t0 = time.perf_counter()
        self._train_start_s = 0.0
        self._last_progress = 0.0
        self._last_event = time.perf_counter()
        self._rollout_stopped = False
        """Colocated streaming: the workers were told to stop (``SuspendRollout``) and not yet to resume."""

    def now(self) -> float:
        return time.perf_counter() - self._t0

    # ------------------------------------------------------------------ global <-> policy-local ids
    def _data_group(self, local: int) -> int:
        """Policy group ``local`` -> data group: first the groups to regenerate, then never-admitted ones."""
        n = len(self._regenerate)
        return self._regenerate[local] if local < n else self._next_group + local - n

    def _live(self) -> tuple[int, ...]:
        return tuple(v + self.base for v in self.policy.live_versions())

    def _engines(self) -> tuple[int, ...]:
        return tuple(v + self.base for v in self.policy.engine_versions())

    # ------------------------------------------------------------------ run
    def run(self) -> RunStats:
        """Warm up (or restore), run to ``total_steps`` under the policy, account for leftovers; the stats."""
        ctrl_c = self._ctrl_c
        ctrl_c.install()
        try:
            self._start_actors()
            self._t0 = time.perf_counter()
            p = self.config.policy
            if self.config.resume is None:
                self.trace.event(
                    0.0, "run_config", mode=p.mode, k=p.max_version_lag, allow_version_mixing=p.allow_version_mixing,
                    num_rollout_groups=p.num_rollout_groups, slots_per_group=p.slots_per_group,
                )
            else:
                self.trace.event(0.0, "resumed", step=self.base)
            self._last_event = time.perf_counter()
            ctrl_c.holding = True
            self._execute(self.policy.start())
            for w in self._workers:
                self._poll(w)
            ctrl_c.release()
            while not self.policy.done:
                self._wait_once()
            self.stats.observe(self.now(), self._final_counters(), self._live(), self._engines())
            self.stats.end_s = self.now()
            self._write_step_logs()
            return self.stats
        finally:
            ctrl_c.holding = True  # _close's accounting is written whole too (a second Ctrl-C still goes through)
            try:
                self._close()
            finally:
                ctrl_c.restore()
            ctrl_c.release()

    def _start_actors(self) -> None:
        cfg = self.config
        trainer_cls = ray.remote(TrainerActor).options(num_cpus=cfg.trainer_num_cpus, name=None)
        self._trainer = trainer_cls.remote(
            cfg.trainer, task=cfg.task, lengths=cfg.response_lengths, seed=cfg.seed,
            warmup_learning_rate=cfg.warmup_learning_rate, megatron=cfg.megatron,
        )
        worker_cls = ray.remote(RolloutWorker).options(
            num_cpus=cfg.worker_num_cpus, max_concurrency=2, max_restarts=cfg.worker_max_restarts, max_task_retries=0,
        )
        self._workers = [
            _Worker(index=r, actor=worker_cls.remote(cfg.rollout, index=r), target=self.base)
            for r in range(cfg.policy.num_rollout_groups)
        ]
        if cfg.resume is None:
            cache = None if cfg.warmup_cache_dir is None else str(cfg.warmup_cache_dir)
            self._phase(f"starting the trainer and {self._workers_text()}; warm-up: "
                        f"{cfg.task.warmup_steps} supervised steps on the task's answers"
                        + (f", unless {cache}/ holds their result" if cache else ""))
            steps, seconds, notes = self._get_trainer(self._trainer.warm_up.remote(cache), "during the warm-up")
            self.stats.warmup_steps, self.stats.warmup_s = steps, seconds
            for note in notes:
                self._phase(note)
            self._phase(f"warm-up: {steps} steps in {seconds:.1f} s" if steps else
                        f"warm-up: weights loaded from {cache} in {seconds:.1f} s")
            trainer_file = self._trainer_file(0)
            if trainer_file is not None:
                self._get_trainer(self._trainer.save_state.remote(trainer_file), "while saving its warmed-up state")
            self._checkpoint(0, None)
        else:
            self._phase(f"starting the trainer and {self._workers_text()}; restoring the trainer "
                        f"from {cfg.resume.trainer_state}")
            try:
                held = self._get_trainer(self._trainer.load_state.remote(str(cfg.resume.trainer_state)),
                                         f"while restoring {cfg.resume.trainer_state}")
            except ray.exceptions.RayTaskError as exc:  # the file is damaged where `check_resumable` does not look
                raise CheckpointError(f"{cfg.resume.trainer_state}: unreadable trainer state ({_cause(exc)}); delete "
                                      f"{cfg.resume.trainer_state.parent} to start over") from None
            if held != self.base:
                raise RuntimeError(f"checkpoint {cfg.resume.trainer_state} holds v{held}, expected v{self.base}")
        self._phase(f"loading v{self.base} on {self._workers_text()}")
        _, self._weights[self.base] = self._trainer.publish.options(num_returns=2).remote(self.base)
        tokens = ray.get([w.actor.incarnation.remote() for w in self._workers])
        for w, token in zip(self._workers, tokens, strict=True):
            w.incarnation = token
        self._get_loads([w.actor.load_weights.remote(self.base, self._weights[self.base], incarnation=w.incarnation)
                         for w in self._workers], f"before it published v{self.base}")
        settled = self._trainer.settle_heap.remote()
        ray.get([w.actor.start_clock.remote(incarnation=w.incarnation) for w in self._workers])  # theirs: first load
        settle_heap()
        self._get_trainer(settled, "after the start-up")
        now = time.perf_counter()
        for w in self._workers:
            w.last_heard = now

    def _get_trainer(self, ref: Any, when: str) -> Any:
        """``ray.get`` of a trainer call; ``TrainerLost`` (``when`` says what it did) if its process died."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise _trainer_lost(exc, when) from None

    def _get_loads(self, refs: Any, when: str) -> Any:
        """``ray.get`` of rollout workers' weight loads; ``TrainerLost`` if the weights, which the trainer computes,
        could not be (``_trainer_argument_lost``)."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            if _trainer_argument_lost(exc):
                raise _trainer_lost(exc, when) from None
            raise

    def _phase(self, what: str) -> None:
        if self.on_phase is not None:
            self.on_phase(what)

    def _workers_text(self) -> str:
        n = len(self._workers)
        return f"{n} rollout worker" + ("s" if n != 1 else "")

    def _trainer_file(self, step: int) -> str | None:
        """Where the trainer saves its state after ``step`` (``None``: checkpoints are off)."""
        if not self.config.checkpoint:
            return None
        return str(checkpoint_dir(self.config.output_dir) / f"trainer-{step:06d}.pt")

    def _checkpoint(self, step: int, step_event: dict[str, Any] | None,
                    metrics_row: dict[str, Any] | None = None) -> None:
        """Commit ``checkpoint.json`` for ``step``, whose trainer file is written (see ``dora.runtime.checkpoint``)."""
        trainer_file = self._trainer_file(step)
        if trainer_file is None:
            return
        write_checkpoint(self.config.output_dir, Checkpoint(
            step=step, consumed_groups=tuple(self._trained_groups), trainer_state=Path(trainer_file).name,
            step_event=step_event, metrics_row=metrics_row, config_key=self.config.config_key,
        ))

    def _wait_once(self) -> None:
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=1.0)
        self._ctrl_c.holding = True  # Ctrl-C takes effect between events, never halfway through handling one
        for ref in ready:
            handler = self._pending.pop(ref)
            handler(ref)
        self._ctrl_c.release()
        idle = time.perf_counter() - self._last_event
        if idle > self.config.watchdog_s:
            raise PipelineStalled(self._stall_report(idle))
        if self.on_progress is not None and time.perf_counter() - self._last_progress > 0.25:
            self._last_progress = time.perf_counter()
            self._observe()
            self.on_progress(self.stats)

    def _progressed(self) -> None:
        self._last_event = time.perf_counter()

    def _submit(self, ref: Any, on_ready: Callable[[Any], None]) -> None:
        self._pending[ref] = on_ready

    # ------------------------------------------------------------------ workers: polls and commands
    def _poll(self, w: _Worker) -> None:
        epoch = w.epoch

        def done(ref: Any) -> None:
            if epoch != w.epoch:
                return  # a reply of an incarnation that died: its work was regenerated
            w.polling = False
            try:
                msg: WorkerMessage = ray.get(ref)
            except EngineFailed as exc:
                raise WorkerLost(_engine_failed(exc)) from None
            except (ray.exceptions.RayActorError, WorkerRestarted) as exc:
                self._worker_failed(w, exc)
                return
            w.last_heard = time.perf_counter()
            self._deliver(w, msg)  # its admissions to w gather in w.carry, for the poll re-armed next
            if w.polling or epoch != w.epoch:
                return  # a restart while delivering re-armed it
            if not self.policy.done:
                self._poll(w)
            elif w.carry:
                carry, w.carry = w.carry, []
                self._queue_add(w, carry)

        carry, w.carry = w.carry, []
        if carry:
            w.carried += 1
        w.polling = True
        self._submit(w.actor.poll.remote(*self._poll_args, incarnation=w.incarnation, requests=carry or None), done)

    def _command(self, w: _Worker, kind: str, call: Callable[[], Any], on_done: Callable[[Any], None]) -> Command:
        """Queue a command for ``w`` (sent at once when none is in flight); the queued tuple. Admissions waiting for
        ``w``'s next poll go first, as a command of their own: the engine sees everything in the policy's order."""
        if w.carry:
            carry, w.carry = w.carry, []
            self._queue_add(w, carry)
        command = (kind, call, on_done)
        w.commands.append(command)
        if not w.busy:
            self._next_command(w)
        return command

    def _next_command(self, w: _Worker) -> None:
        if not w.commands:
            w.busy = False
            w.running = None
            return
        command = w.commands.popleft()
        _, call, on_done = command
        w.busy, w.running = True, command
        epoch = w.epoch

        def done(ref: Any) -> None:
            if epoch != w.epoch:
                return  # the restart replayed this command's effect
            try:
                result = ray.get(ref)
            except EngineFailed as exc:
                raise WorkerLost(_engine_failed(exc)) from None
            except (ray.exceptions.RayActorError, WorkerRestarted) as exc:
                if _trainer_argument_lost(exc):  # the worker is fine; the weights it was to load never came
                    raise _trainer_lost(exc, f"before it published the weights for rollout worker {w.index}") from None
                self._worker_failed(w, exc)
                return
            self._next_command(w)
            on_done(result)

        self._submit(call(), done)

    def _add(self, w: _Worker, requests: list[GenerationRequest]) -> None:
        """Give ``requests`` to ``w``: they join the add command queued last, when that is the worker's last command
        and not yet sent, instead of waiting one more round trip (an engine step at least) behind it: the policy
        admits many groups at once (a sync step admits the whole batch)."""
        for r in requests:
            w.requests[r.request_id] = r
        self._count_open()
        if not w.polling and not w.busy and not w.commands:
            w.carry.extend(requests)  # the next poll carries them (see the module doc)
            return
        self._queue_add(w, requests)

    def _queue_add(self, w: _Worker, requests: list[GenerationRequest]) -> None:
        """Give ``requests`` to ``w`` by an add command (joining the one queued last, if not sent yet)."""
        if w.queued_add is not None and w.commands and w.commands[-1] is w.queued_add[0]:
            w.queued_add[1].extend(requests)
            return
        batch = list(requests)
        command = self._command(
            w, "add", lambda: w.actor.add_requests.remote(batch, incarnation=w.incarnation, after=w.carried),
            lambda _: None,
        )
        w.queued_add = (command, batch)

    def _count_open(self) -> None:
        self.stats.trajectories_open(self.now(), sum(len(w.requests) for w in self._workers))

    def _deliver(self, w: _Worker, msg: WorkerMessage) -> None:
        """Process ``w``'s messages strictly in sequence order (see the module doc)."""
        w.held[msg.seq] = msg
        while w.next_seq in w.held:
            m = w.held.pop(w.next_seq)
            w.next_seq += 1
            w.counters = m.counters
            for traj in m.finished:
                self._finished(w, traj)
            if m.export_reply:
                self._migrated(w, m)

    def _finished(self, w: _Worker, traj: FinishedTrajectory) -> None:
        r = w.index
        w.requests.pop(traj.request_id, None)
        self._count_open()
        gid_s, sample_s = traj.request_id[1:].split("/")
        gid, sample = int(gid_s), int(sample_s)
        reward = score(self._prompts[gid], traj.response_ids)
        self._scored[gid].append(ScoredTrajectory(trajectory=traj, reward=reward, group_id=f"g{gid}"))
        self.trace.event(
            self.now(), "finished", traj=traj.request_id, rollout_group=r, num_tokens=len(traj.response_ids),
            spans=[list(s) for s in traj.version_spans],
        )
        self.stats.finished_trajectories += 1
        self.stats.mixed_trajectories += mixes_versions(traj.version_spans)  # as the audit counts them
        early = self._early
        if early is not None and gid in early.waiting and len(self._scored[gid]) == self.spp:
            self._joined(early, gid)  # after its ``finished`` event: the group joins the step when (not before) it is
        self._progressed()
        self._execute(self.policy.handle(TrajectoryFinished(
            group_id=self._local_group[gid], sample=sample, rollout_group=r, num_tokens=len(traj.response_ids))))

    # ------------------------------------------------------------------ worker failure
    def _worker_failed(self, w: _Worker, exc: BaseException) -> None:
        """A rollout worker's process died: wait for Ray to restart it, reload the version it was
        serving, regenerate every request it held (recorded), and carry on; the policy sees nothing.

        Requests it held keep their version (a multi-version worker reloads every version they used), so
        consistency and the staleness
        bound are untouched; their lost tokens are recorded as ``regenerated``. A migration off the
        dead worker completes by regenerating its requests on the planned destinations instead.
        """
        started = time.perf_counter()
        cfg = self.config
        w.epoch += 1
        dropped = ([w.running] if w.running is not None else []) + list(w.commands)
        w.commands.clear()
        w.running, w.busy = None, False
        w.polling, w.carry, w.carried = False, [], 0  # w.requests holds the carry: it is regenerated below
        w.held.clear()
        w.next_seq = 1
        if w.counters is not None:
            w.dead_counters = _plus(w.dead_counters, w.counters)
            w.counters = None
        deadline = started + cfg.restart_timeout_s
        while True:
            try:
                w.incarnation = ray.get(w.actor.incarnation.remote(),
                                        timeout=max(0.1, min(5.0, deadline - time.perf_counter())))
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as again:
                if time.perf_counter() > deadline:
                    raise WorkerLost(f"rollout worker {w.index} died ({type(exc).__name__}) and was not back "
                                     f"within {cfg.restart_timeout_s:.0f} s ({type(again).__name__})") from None
                time.sleep(0.1)
        lost = list(w.requests.values())
        w.requests.clear()
        reload = f"before it published the weights for restarted rollout worker {w.index}"
        if w.target is not None:
            self._get_loads(w.actor.load_weights.remote(w.target, self._weights[w.target], incarnation=w.incarnation),
                            reload)
        if w.migration is None:  # a multi-version engine also held requests of older versions: host them again
            for v in sorted({r.version for r in lost} - {w.target}):
                self._get_loads(w.actor.load_weights.remote(v, self._weights[v], keep_loaded=True,
                                                            incarnation=w.incarnation), reload)
        if self._rollout_stopped:  # the trainer has the cores: the new process stays stopped too
            ray.get(w.actor.set_suspended.remote(True, incarnation=w.incarnation))
        self.trace.event(self.now(), "worker_restarted", rollout_group=w.index, version=w.target or 0)
        if w.migration is not None:
            act, w.migration = w.migration, None
            moves: list[tuple[int, int]] = []
            for dst, cap in act.capacity:
                batch, lost = lost[:cap], lost[cap:]
                moves.append((dst, len(batch)))
                if batch:
                    self._regenerate_on(self._workers[dst], batch)
            if lost:
                raise RuntimeError(f"MigrateRequests from engine {w.index}: capacity {act.capacity} leaves {len(lost)}")
            self._execute(self.policy.handle(RequestsMigrated(src=w.index, moves=tuple(moves))))
        elif lost:
            self._regenerate_on(w, lost)
        self.stats.worker_restarts += 1
        self.stats.recovery_s.append(round(time.perf_counter() - started, 3))
        w.last_heard = time.perf_counter()
        self._progressed()
        self._poll(w)
        for kind, _, on_done in dropped:
            if kind in ("load", "suspend", "resume"):  # the reload and the stop above served it
                on_done(None)

    def _regenerate_on(self, w: _Worker, requests: list[GenerationRequest]) -> None:
        """Start ``requests`` again from their prompt on ``w``, each on the version it was admitted on (their
        tokens were lost; the policy still books each group on that version, and ``w`` hosts it)."""
        t = self.now()
        fresh = []
        for r in requests:
            v = r.version
            self.trace.event(t, "regenerated", traj=r.request_id, version=v)
            self.trace.event(t, "admitted", traj=r.request_id, version=v, rollout_group=w.index)
            fresh.append(GenerationRequest(request_id=r.request_id, prompt_ids=r.prompt_ids, version=v,
                                           max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens,
                                           temperature=r.temperature, seed=r.seed))
        self.stats.regenerated += len(fresh)
        self._add(w, fresh)

    # ------------------------------------------------------------------ actions
    def _execute(self, actions: Any) -> None:
        for act in actions:
            if isinstance(act, Admit):
                self._admit(act)
            elif isinstance(act, LoadWeights):
                self._load(act)
            elif isinstance(act, MigrateRequests):
                self._migrate(act)
            elif isinstance(act, DropVersion):
                self._drop(act)
            elif isinstance(act, StartTrainStep):
                self._train(act)
            elif isinstance(act, PublishWeights):
                self._publish(act)
            elif isinstance(act, SuspendRollout):
                self._set_rollout_stopped(True)
            elif isinstance(act, ResumeRollout):
                self._set_rollout_stopped(False)
            else:
                raise TypeError(f"unknown action {act!r}")

    def _set_rollout_stopped(self, stop: bool) -> None:
        """``SuspendRollout`` / ``ResumeRollout``: every worker stops (or resumes) stepping its engine, after the
        commands queued before; the policy hears ``RolloutSuspended`` / ``RolloutResumed`` once all have. Finishes
        from before a worker stopped still arrive through its polls, in order."""
        self._rollout_stopped = stop
        left = [len(self._workers)]

        def acked(_: Any) -> None:
            left[0] -= 1
            if left[0]:
                return
            self.trace.event(self.now(), "rollout_suspended" if stop else "rollout_resumed")
            self._progressed()
            self._execute(self.policy.handle(RolloutSuspended() if stop else RolloutResumed()))

        for w in self._workers:
            # the default binds this iteration's worker; its incarnation is read when the command is sent
            def send(w: _Worker = w) -> Any:
                return w.actor.set_suspended.remote(stop, incarnation=w.incarnation, after=w.carried)

            self._command(w, "suspend" if stop else "resume", send, acked)

    def _admit(self, act: Admit) -> None:
        cfg = self.config
        g, v = self._data_group(act.group_id), act.version + self.base
        regenerate = act.group_id < len(self._regenerate)
        self._local_group[g] = act.group_id
        prompt = make_prompt(cfg.task, cfg.response_lengths, random.Random(f"{cfg.seed}:prompt:{g}"), f"g{g}")
        self._prompts[g], self._group_version[g], self._scored[g] = prompt, v, []
        requests = []
        t = self.now()
        for i in range(act.num_samples):
            rid = f"g{g}/{i}"
            requests.append(GenerationRequest(
                request_id=rid, prompt_ids=prompt.prompt_ids, version=v, max_new_tokens=prompt.max_new_tokens,
                min_new_tokens=prompt.min_new_tokens, temperature=cfg.temperature, seed=random.Random(f"{cfg.seed}:sample:{rid}").getrandbits(63),
            ))
            if regenerate:  # admitted by an attempt that stopped before a checkpointed step trained it
                self.trace.event(t, "regenerated", traj=rid, version=v)
                self.stats.regenerated += 1
            self.trace.event(t, "admitted", traj=rid, version=v, rollout_group=act.rollout_group)
        self._add(self._workers[act.rollout_group], requests)

    def _load(self, act: LoadWeights) -> None:
        r, v = act.rollout_group, act.version + self.base
        w = self._workers[r]
        self.trace.event(self.now(), "weights_load_started", rollout_group=r, version=v, source=act.source)
        # A peer load reads the same object-store copy of v the peer loaded (one copy per version).
        ref = self._weights[v]
        w.target = v

        def loaded(_: Any) -> None:
            self.trace.event(self.now(), "weights_loaded", rollout_group=r, version=v)
            self.stats.weight_loads += 1
            self._progressed()
            self._execute(self.policy.handle(WeightsLoaded(rollout_group=r, version=act.version)))
            self._forget_old_weights()

        self._command(w, "load", lambda: w.actor.load_weights.remote(v, ref, act.resume_in_flight, act.keep_loaded,
                                                               incarnation=w.incarnation, after=w.carried),
                      loaded)

    def _drop(self, act: DropVersion) -> None:
        r, v = act.rollout_group, act.version + self.base
        w = self._workers[r]
        self.trace.event(self.now(), "version_dropped", rollout_group=r, version=v)
        self._command(w, "drop", lambda: w.actor.drop_version.remote(v, incarnation=w.incarnation, after=w.carried),
                      lambda _: None)

    def _migrate(self, act: MigrateRequests) -> None:
        w = self._workers[act.src]
        if w.migration is not None:
            raise RuntimeError(f"engine {act.src}: a migration is already in progress")
        w.migration = act
        self._command(w, "export", lambda: w.actor.export_requests.remote(incarnation=w.incarnation, after=w.carried),
                      lambda msg: self._deliver(w, msg))

    def _migrated(self, w: _Worker, msg: WorkerMessage) -> None:
        act, w.migration = w.migration, None
        if act is None:
            raise RuntimeError(f"engine {w.index}: export reply without a migration")
        left = list(msg.exported)
        for m in left:
            w.requests.pop(m.request.request_id, None)
        moves: list[tuple[int, int]] = []
        t = self.now()
        for dst, cap in act.capacity:
            batch, left = left[:cap], left[cap:]
            moves.append((dst, len(batch)))
            if batch:
                d = self._workers[dst]
                for m in batch:
                    d.requests[m.request.request_id] = m.request

                # defaults bind this iteration's worker and batch; incarnation is read when the command is sent
                def send(d: _Worker = d, batch: list[MigratingRequest] = batch) -> Any:
                    return d.actor.import_requests.remote(batch, incarnation=d.incarnation, after=d.carried)

                self._command(d, "import", send, lambda _: None)
                self.trace.event(t, "migrated", src=w.index, dst=dst, trajs=[m.request.request_id for m in batch])
        if left:
            raise RuntimeError(f"MigrateRequests from engine {w.index}: capacity {act.capacity} leaves {len(left)}")
        self.stats.migrated += sum(c for _, c in moves)
        self._progressed()
        self._execute(self.policy.handle(RequestsMigrated(src=w.index, moves=tuple(moves))))

    def _train(self, act: StartTrainStep) -> None:
        """Submit step ``act.step`` to the trainer. An early step's groups still generating (``act.joining``) go to
        it as each finishes (``_joined``): the others now as a ``train_part``, the last one with the ``train_step``."""
        step = act.step + self.base
        groups = [self._data_group(j) for j in act.group_ids]
        waiting = {g for g in map(self._data_group, act.joining) if len(self._scored[g]) < self.spp}
        batch: list[ScoredTrajectory] = []
        for g in groups:
            if g in waiting:
                continue
            if len(self._scored[g]) != self.spp:
                raise RuntimeError(f"step {step} consumes group {g} with {len(self._scored[g])}/{self.spp} finished")
            batch.extend(self._scored[g])
        # a step the policy starts while the last one's publish is in flight queues behind it on the trainer actor:
        # its span starts when that publish's reply comes back (``_publish``), not at this submission
        self._train_start[step] = self.now()
        if self._publishing is not None:
            self._publishing.append(step)
        versions = [self._group_version[g] for g in groups for _ in range(self.spp)]
        joined: dict[int, float] = {}
        """group -> when it joined the step (``_joined``)."""

        def trained(ref: Any) -> None:
            metrics: TrainMetrics = self._get_trainer(ref, f"while training step {step}")
            end, start = self.now(), self._train_start.pop(step)
            scored = [s for g in groups for s in self._scored[g]]
            event = {"t": round(self.trace.offset_s + end, 6), "type": "train_step", "step": step,
                     "start_t": round(self.trace.offset_s + start, 6),
                     "consumed": [s.trajectory.request_id for s in scored], "produced_version": step}
            late = {s.trajectory.request_id: round(self.trace.offset_s + joined[g], 6)
                    for g in groups if joined.get(g, start) > start for s in self._scored[g]}
            if late:  # groups that finished before the step's span began (behind a publish) simply joined it then
                event["joined"] = late
            self._trained_groups.update(groups)
            record = self.stats.step_finished(
                step=step, start_s=start, end_s=end, metrics=metrics, rewards=[s.reward for s in scored],
                versions=versions, counters=self._latest_counters(), live=self._live(), engines=self._engines(),
                joined_s=max((t for t in joined.values() if t > start), default=None),
            ).to_json()
            # the trainer saved; commit before the trace and the metrics record the step (see checkpoint)
            self._checkpoint(step, event, record)
            self.trace.write(event)
            self.metrics_out.write(record)
            self._progressed()
            if self.on_progress is not None:
                self.on_progress(self.stats)
            self._execute(self.policy.handle(TrainStepFinished(step=act.step)))

        def finish(last: list[ScoredTrajectory]) -> None:
            self._submit(self._trainer.train_step.remote(last, self._trainer_file(step)), trained)
            # Every policy publishes a step's weights as soon as the step ends (PolicyBase.on_train_step_finished).
            # Asked now, behind the step in the trainer's queue, the trainer exports them the moment it has trained and
            # saved, not a round trip and the controller's bookkeeping of the step (checkpoint commit, trace, display)
            # later. Nothing sees them before the policy's PublishWeights: `_publish` takes these refs then.
            self._asked_publish = (step, *self._trainer.publish.options(num_returns=2).remote(step))

        if not waiting:
            finish(batch)
            return
        self._early = _EarlyStep(step=step, waiting=waiting, joined=joined, finish=finish)
        self._train_part(step, batch)

    def _train_part(self, step: int, part: list[ScoredTrajectory]) -> None:
        if part:
            self._submit(self._trainer.train_part.remote(part),
                         lambda ref: self._get_trainer(ref, f"while training part of step {step}"))

    def _joined(self, early: _EarlyStep, g: int) -> None:
        """Group ``g``, which the running early step took while it generated, finished: the trainer takes it now,
        with the step's optimizer step if it is the last."""
        early.waiting.discard(g)
        early.joined[g] = self.now()
        if early.waiting:
            self._train_part(early.step, self._scored[g])
        else:
            self._early = None
            early.finish(self._scored[g])

    def _publish(self, act: PublishWeights) -> None:
        v = act.version + self.base
        # Two results: the version held (fetched here, a few bytes) and the weights (left in the object store for the
        # workers; the controller never fetches them). If publish raised, both hold its error and the fetch raises it
        # before the trace says v was published.
        asked, self._asked_publish = self._asked_publish, None
        if asked is not None and asked[0] == v:
            _, held, self._weights[v] = asked
        else:
            held, self._weights[v] = self._trainer.publish.options(num_returns=2).remote(v)

        behind: list[int] = []
        self._publishing = behind

        def published(ref: Any) -> None:
            self._get_trainer(ref, f"while publishing v{v}")
            now = self.now()
            for step in behind:  # the step queued behind this publish: the trainer went on to it
                self._train_start[step] = now
            if self._publishing is behind:
                self._publishing = None
            self.trace.event(now, "weights_published", version=v)
            self._progressed()
            self._execute(self.policy.handle(WeightsPublished(version=act.version)))

        self._submit(held, published)

    def _forget_old_weights(self) -> None:
        latest = self.policy.latest_version + self.base
        keep = set(self._engines()) | {latest} | {w.target for w in self._workers if w.target is not None}
        keep |= {r.version for w in self._workers for r in w.requests.values()}  # a restart regenerates on them
        for v in [v for v in self._weights if v not in keep and v < latest]:
            del self._weights[v]

    # ------------------------------------------------------------------ watchdog
    def _stall_report(self, idle_s: float) -> str:
        """What the run waits for, in words: the step, the trainer's wait, each worker's state."""
        p, cfg = self.policy, self.config
        step = p.next_step + self.base
        lines = [f"pipeline stalled: no progress for {idle_s:.0f} s (watchdog {cfg.watchdog_s:g} s), "
                 f"{p.steps_done + self.base} of {cfg.policy.total_steps} steps done"]
        if p.training:
            lines.append(f"  waiting for the trainer to finish step {step - 1}")
        else:
            unconsumed = {v + self.base: n for v, n in p.unconsumed_groups.items() if n}
            finished = {v + self.base: len(q) for v, q in p.finished_groups.items() if q}
            forced = step - p.k - 1
            lines.append(f"  step {step} waits for {p.prompts_per_step} finished groups (k={p.k}: every group of "
                         f"v<={forced} first); unconsumed groups by version {unconsumed}, finished {finished}")
        now = time.perf_counter()
        for w in self._workers:
            queued = [kind for kind, _, _ in ([w.running] if w.running else []) + list(w.commands)]
            lines.append(f"  rollout worker {w.index}: version {w.target}, {len(w.requests)} requests in flight, "
                         f"commands {queued or 'none'}, last reply {now - w.last_heard:.0f} s ago")
        return "\n".join(lines)

    # ------------------------------------------------------------------ counters and shutdown
    def _latest_counters(self) -> list[WorkerCounters | None]:
        return [_plus(w.dead_counters, w.counters) if w.dead_counters else w.counters for w in self._workers]

    def _final_counters(self) -> list[WorkerCounters | None]:
        """Fresh counters from every worker at the end (polled counters can be ``poll_timeout_s`` old)."""
        for w in self._workers:
            try:
                w.counters = ray.get(w.actor.counters.remote(), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # died at the very end: its last polled counters stand
        return self._latest_counters()

    def _write_step_logs(self) -> None:
        """``engine_steps.jsonl``: every engine step of this attempt (a header line, then one row per step with
        the worker index first, ``start_s`` on the run clock of ``metrics.jsonl``); ``dora calibrate --from-run``
        fits the cost model to it."""
        rows: list[str] = [json.dumps({"columns": ["worker", *STEP_LOG_COLUMNS]})]
        for w in self._workers:
            try:
                origin, log = ray.get(w.actor.step_log.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue  # died at the very end: its steps are lost with it (the calibration fits the others)
            shift = origin - self._t0
            rows.extend(json.dumps([w.index, round(start + shift, 6), *rest]) for start, *rest in log)
        write_text_atomic(self.config.output_dir / STEP_LOG_FILE, "\n".join(rows) + "\n")

    def _observe(self) -> None:
        self.stats.observe(self.now(), self._latest_counters(), self._live(), self._engines())

    def _close(self) -> None:
        """Account for every admitted, untrained trajectory, stop the actors, close the files.

        A group a train step took is untrained until that step finished: when the run stops while the step runs
        (Ctrl-C, a lost worker), its trajectories are recorded ``unfinished_at_end`` with ``finished=True``, and a
        resume regenerates them from the last checkpoint. A resumed attempt's groups to regenerate that it never
        re-admitted need no event here: ``prepare_resume`` recorded every leftover of the attempt before unfinished
        at the seam (or that attempt's own end did), and only a regeneration, which re-admits, supersedes that. The
        same holds when this method never runs (a kill): the next ``prepare_resume`` writes what it would have."""
        t = self.now()
        finished_ids = {s.trajectory.request_id for g in self._scored for s in self._scored[g]}
        for g in sorted(self._scored):
            if g in self._trained_groups:
                continue
            for i in range(self.spp):
                rid = f"g{g}/{i}"
                self.trace.event(t, "unfinished_at_end", traj=rid, finished=rid in finished_ids)
                self.stats.unfinished_at_end += 1
        stops = [w.actor.stop.remote() for w in self._workers]
        ray.wait(stops, num_returns=len(stops), timeout=10)  # a worker that died or hangs must not block shutdown
        # Release the actors' CPU reservations now: on a shared Ray instance the next run needs them.
        for actor in [w.actor for w in self._workers] + ([self._trainer] if self._trainer is not None else []):
            ray.kill(actor)
        self.trace.close()
        self.metrics_out.close()


class _CtrlC:
    """Ctrl-C (SIGINT), and SIGTERM, take effect between the controller's events, never halfway through handling one.

    The controller handles each event whole: a KeyboardInterrupt raised halfway through one would leave the trace
    and ``_close``'s accounting disagreeing, e.g. a step's groups marked trained before its ``train_step`` event is
    written (so neither trained nor recorded unfinished), or a group recorded unfinished whose ``admitted`` events
    were not all written (an audit violation when the run resumes). While ``holding``, a SIGINT is noted and raised
    as KeyboardInterrupt by ``release``; a second one while holding (an event that blocks, such as a worker restart
    waiting for its actor) is raised at once. Installed for the run only, and only over Python's default handler in
    the main thread (the one place Python runs signal handlers); otherwise Ctrl-C behaves as it would without it.
    One handler for the whole run, so holding and releasing cost two attribute writes per event."""

    def __init__(self) -> None:
        self.holding = False
        self.pending: int | None = None  # the signal noted while holding
        self.installed: dict[int, Any] = {}  # signal -> the handler to put back

    def install(self) -> None:
        """SIGINT over Python's default handler; SIGTERM (as a ``Terminated``) over whatever handles it, put back
        after: ``ray.init`` makes it ``sys.exit``, which ended the run at once, the trace unflushed and no resume
        hint given, with Ray's crash dump and exit code 15."""
        if threading.current_thread() is not threading.main_thread():
            return
        note_signal(None)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.installed[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        self.installed[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)

    def restore(self) -> None:
        for signum, previous in self.installed.items():
            signal.signal(signum, previous)
        self.installed = {}

    def release(self) -> None:
        self.holding = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise _interrupt(signum)

    def _on_signal(self, signum: int, frame: Any) -> None:
        note_signal(signum)
        if self.holding and self.pending is None:
            self.pending = signum
            return
        self.pending = None
        raise _interrupt(signum)


def _interrupt(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _plus(a: WorkerCounters | None, b: WorkerCounters | None) -> WorkerCounters | None:
    """Counters of two incarnations of one worker, added (``num_active`` is the newer one's)."""
    if a is None or b is None:
        return b if a is None else a
    return WorkerCounters(wall_s=a.wall_s + b.wall_s, busy_s=a.busy_s + b.busy_s, busy_slot_s=a.busy_slot_s + b.busy_slot_s,
                          generated_tokens=a.generated_tokens + b.generated_tokens, num_active=b.num_active)
