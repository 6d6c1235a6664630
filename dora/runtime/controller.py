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
moved request" hold.

Data: prompt group ``g`` is a pure function of ``(seed, g)`` and the sampling seed of trajectory
``g{g}/{i}`` of ``(seed, g, i)``, so every mode sees the same prompts and the same sampling noise.
Weights: version ``v`` is put into Ray's object store once (the trainer's ``publish`` return value);
workers resolve that reference when they load it, the controller never fetches the weights.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from dora.runtime.actors import RolloutWorker, TrainerActor, WorkerCounters, WorkerMessage
from dora.runtime.engines.base import FinishedTrajectory, GenerationRequest, ScoredTrajectory, TrainMetrics
from dora.runtime.engines.torch_rollout import RolloutConfig
from dora.runtime.engines.torch_trainer import TrainerConfig
from dora.runtime.tasks import Prompt, TaskConfig, make_prompt, score
from dora.runtime.trace import JsonlWriter, RunStats, TraceWriter
from planner.policies import (
    Admit,
    LoadWeights,
    MigrateRequests,
    PolicyConfig,
    PublishWeights,
    RequestsMigrated,
    StartTrainStep,
    TrainStepFinished,
    TrajectoryFinished,
    WeightsLoaded,
    WeightsPublished,
    make_policy,
)
from planner.workload import LengthDistribution


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Everything one run needs, already resolved (``dora.runtime.driver`` builds it from the runtime config)."""

    policy: PolicyConfig
    rollout: RolloutConfig
    """One engine replica (= rollout group); ``policy.num_rollout_groups`` of them are started."""
    trainer: TrainerConfig
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
    poll_linger_s: float = 0.01
    """After a first finish, how long a poll waits for a group's worth (``samples_per_prompt``) more.

    Measured on 2 cores (streaming, 2x32 slots, 16x8 per step, 30 steps, 2 runs each): 0 ms -> controller
    CPU 27% of wall, 3.5k trained tok/s; 10 ms -> 19%, 3.8-4.3k tok/s (rollout gets the CPU back)."""

    @property
    def max_new_tokens(self) -> int:
        return self.response_lengths.max_tokens


@dataclass(kw_only=True)
class _Worker:
    """Controller-side state of one rollout worker."""

    index: int
    actor: Any
    commands: deque[tuple[Callable[[], Any], Callable[[Any], None]]] = field(default_factory=deque)
    busy: bool = False
    next_seq: int = 1
    held: dict[int, WorkerMessage] = field(default_factory=dict)
    migration: MigrateRequests | None = None
    counters: WorkerCounters | None = None


Progress = Callable[[RunStats], None]


class Controller:
    """One run of ``config.policy.mode``. Call ``run()`` once, with Ray initialised."""

    def __init__(self, config: ControllerConfig, *, on_progress: Progress | None = None) -> None:
        self.config = config
        self.policy = make_policy(config.policy)
        self.on_progress = on_progress
        self.spp = config.policy.samples_per_prompt
        out = Path(config.output_dir)
        self.trace = TraceWriter(out / "trace.jsonl")
        self.metrics_out = JsonlWriter(out / "metrics.jsonl")
        p = config.policy
        self.stats = RunStats(
            num_workers=p.num_rollout_groups, slots_per_worker=p.slots_per_group, total_steps=p.total_steps, mode=p.mode,
        )
        self._pending: dict[Any, Callable[[Any], None]] = {}
        self._workers: list[_Worker] = []
        self._trainer: Any = None
        self._weights: dict[int, Any] = {}
        """version -> ObjectRef of its published weights (kept while an engine may load it)."""
        self._prompts: dict[int, Prompt] = {}
        self._group_version: dict[int, int] = {}
        self._scored: dict[int, list[ScoredTrajectory]] = {}
        self._consumed: set[int] = set()
        self._t0 = time.perf_counter()
        self._train_start_s = 0.0
        self._last_progress = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    # ------------------------------------------------------------------ run
    def run(self) -> RunStats:
        """Warm up, run ``total_steps`` steps under the policy, account for leftovers; returns the stats."""
        try:
            self._start_actors()
            self._t0 = time.perf_counter()
            p = self.config.policy
            self.trace.event(
                0.0, "run_config", mode=p.mode, k=p.max_version_lag, allow_version_mixing=p.allow_version_mixing,
                num_rollout_groups=p.num_rollout_groups, slots_per_group=p.slots_per_group,
            )
            self._execute(self.policy.start())
            for w in self._workers:
                self._poll(w)
            while not self.policy.done:
                self._wait_once()
            self.stats.observe(self.now(), self._final_counters(), self.policy.live_versions(), self.policy.engine_versions())
            self.stats.end_s = self.now()
            return self.stats
        finally:
            self._close()

    def _start_actors(self) -> None:
        cfg = self.config
        trainer_cls = ray.remote(TrainerActor).options(num_cpus=cfg.trainer_num_cpus, name=None)
        self._trainer = trainer_cls.remote(
            cfg.trainer, task=cfg.task, lengths=cfg.response_lengths, seed=cfg.seed,
            warmup_learning_rate=cfg.warmup_learning_rate,
        )
        worker_cls = ray.remote(RolloutWorker).options(num_cpus=cfg.worker_num_cpus, max_concurrency=2)
        self._workers = [
            _Worker(index=r, actor=worker_cls.remote(cfg.rollout, index=r))
            for r in range(cfg.policy.num_rollout_groups)
        ]
        cache = None if cfg.warmup_cache_dir is None else str(cfg.warmup_cache_dir)
        steps, seconds = ray.get(self._trainer.warm_up.remote(cache))
        self.stats.warmup_steps, self.stats.warmup_s = steps, seconds
        self._weights[0] = self._trainer.publish.remote(0)
        ray.get([w.actor.load_weights.remote(0, self._weights[0]) for w in self._workers])
        ray.get([w.actor.start_clock.remote() for w in self._workers])

    def _wait_once(self) -> None:
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=1.0)
        for ref in ready:
            handler = self._pending.pop(ref)
            handler(ref)
        if self.on_progress is not None and time.perf_counter() - self._last_progress > 0.25:
            self._last_progress = time.perf_counter()
            self._observe()
            self.on_progress(self.stats)

    def _submit(self, ref: Any, on_ready: Callable[[Any], None]) -> None:
        self._pending[ref] = on_ready

    # ------------------------------------------------------------------ workers: polls and commands
    def _poll(self, w: _Worker) -> None:
        def done(ref: Any) -> None:
            msg: WorkerMessage = ray.get(ref)
            if not self.policy.done:
                self._poll(w)  # re-arm first: the worker keeps reporting while we process
            self._deliver(w, msg)

        self._submit(w.actor.poll.remote(self.config.poll_timeout_s, self.config.poll_linger_s, self.spp), done)

    def _command(self, w: _Worker, call: Callable[[], Any], on_done: Callable[[Any], None]) -> None:
        w.commands.append((call, on_done))
        if not w.busy:
            self._next_command(w)

    def _next_command(self, w: _Worker) -> None:
        if not w.commands:
            w.busy = False
            return
        call, on_done = w.commands.popleft()
        w.busy = True

        def done(ref: Any) -> None:
            result = ray.get(ref)
            self._next_command(w)
            on_done(result)

        self._submit(call(), done)

    def _deliver(self, w: _Worker, msg: WorkerMessage) -> None:
        """Process ``w``'s messages strictly in sequence order (see the module doc)."""
        w.held[msg.seq] = msg
        while w.next_seq in w.held:
            m = w.held.pop(w.next_seq)
            w.next_seq += 1
            w.counters = m.counters
            for traj in m.finished:
                self._finished(w.index, traj)
            if m.export_reply:
                self._migrated(w, m)

    def _finished(self, r: int, traj: FinishedTrajectory) -> None:
        gid_s, sample_s = traj.request_id[1:].split("/")
        gid, sample = int(gid_s), int(sample_s)
        reward = score(self._prompts[gid], traj.response_ids)
        self._scored[gid].append(ScoredTrajectory(trajectory=traj, reward=reward, group_id=f"g{gid}"))
        self.trace.event(
            self.now(), "finished", traj=traj.request_id, rollout_group=r, num_tokens=len(traj.response_ids),
            spans=[list(s) for s in traj.version_spans],
        )
        self.stats.finished_trajectories += 1
        self.stats.mixed_trajectories += len(traj.version_spans) > 1
        self._execute(self.policy.handle(TrajectoryFinished(
            group_id=gid, sample=sample, rollout_group=r, num_tokens=len(traj.response_ids))))

    # ------------------------------------------------------------------ actions
    def _execute(self, actions: Any) -> None:
        for act in actions:
            if isinstance(act, Admit):
                self._admit(act)
            elif isinstance(act, LoadWeights):
                self._load(act)
            elif isinstance(act, MigrateRequests):
                self._migrate(act)
            elif isinstance(act, StartTrainStep):
                self._train(act)
            elif isinstance(act, PublishWeights):
                self._publish(act)
            else:
                raise TypeError(f"unknown action {act!r}")

    def _admit(self, act: Admit) -> None:
        cfg, g = self.config, act.group_id
        prompt = make_prompt(cfg.task, cfg.response_lengths, random.Random(f"{cfg.seed}:prompt:{g}"), f"g{g}")
        self._prompts[g], self._group_version[g], self._scored[g] = prompt, act.version, []
        requests = []
        t = self.now()
        for i in range(act.num_samples):
            rid = f"g{g}/{i}"
            requests.append(GenerationRequest(
                request_id=rid, prompt_ids=prompt.prompt_ids, version=act.version, max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature, seed=random.Random(f"{cfg.seed}:sample:{rid}").getrandbits(63),
            ))
            self.trace.event(t, "admitted", traj=rid, version=act.version, rollout_group=act.rollout_group)
        w = self._workers[act.rollout_group]
        self._command(w, lambda: w.actor.add_requests.remote(requests), lambda _: None)

    def _load(self, act: LoadWeights) -> None:
        r, v = act.rollout_group, act.version
        w = self._workers[r]
        self.trace.event(self.now(), "weights_load_started", rollout_group=r, version=v, source=act.source)
        # A peer load reads the same object-store copy of v the peer loaded (one copy per version).
        ref = self._weights[v]

        def loaded(_: Any) -> None:
            self.trace.event(self.now(), "weights_loaded", rollout_group=r, version=v)
            self.stats.weight_loads += 1
            self._execute(self.policy.handle(WeightsLoaded(rollout_group=r, version=v)))
            self._forget_old_weights()

        self._command(w, lambda: w.actor.load_weights.remote(v, ref, act.resume_in_flight), loaded)

    def _migrate(self, act: MigrateRequests) -> None:
        w = self._workers[act.src]
        if w.migration is not None:
            raise RuntimeError(f"engine {act.src}: a migration is already in progress")
        w.migration = act
        self._command(w, lambda: w.actor.export_requests.remote(), lambda msg: self._deliver(w, msg))

    def _migrated(self, w: _Worker, msg: WorkerMessage) -> None:
        act, w.migration = w.migration, None
        if act is None:
            raise RuntimeError(f"engine {w.index}: export reply without a migration")
        left = list(msg.exported)
        moves: list[tuple[int, int]] = []
        t = self.now()
        for dst, cap in act.capacity:
            batch, left = left[:cap], left[cap:]
            moves.append((dst, len(batch)))
            if batch:
                d = self._workers[dst]
                self._command(d, lambda d=d, batch=batch: d.actor.import_requests.remote(batch), lambda _: None)
                self.trace.event(t, "migrated", src=w.index, dst=dst, trajs=[m.request.request_id for m in batch])
        if left:
            raise RuntimeError(f"MigrateRequests from engine {w.index}: capacity {act.capacity} leaves {len(left)}")
        self.stats.migrated += sum(c for _, c in moves)
        self._execute(self.policy.handle(RequestsMigrated(src=w.index, moves=tuple(moves))))

    def _train(self, act: StartTrainStep) -> None:
        batch: list[ScoredTrajectory] = []
        for g in act.group_ids:
            if len(self._scored[g]) != self.spp:
                raise RuntimeError(f"step {act.step} consumes group {g} with {len(self._scored[g])}/{self.spp} finished")
            batch.extend(self._scored[g])
            self._consumed.add(g)
        start = self.now()
        versions = [self._group_version[g] for g in act.group_ids for _ in range(self.spp)]

        def trained(ref: Any) -> None:
            metrics: TrainMetrics = ray.get(ref)
            end = self.now()
            self.trace.event(
                end, "train_step", step=act.step, start_t=round(start, 6),
                consumed=[s.trajectory.request_id for s in batch], produced_version=act.step,
            )
            record = self.stats.step_finished(
                step=act.step, start_s=start, end_s=end, metrics=metrics, rewards=[s.reward for s in batch],
                versions=versions, counters=self._latest_counters(), live=self.policy.live_versions(),
                engines=self.policy.engine_versions(),
            )
            self.metrics_out.write(record.to_json())
            if self.on_progress is not None:
                self.on_progress(self.stats)
            self._execute(self.policy.handle(TrainStepFinished(step=act.step)))

        self._submit(self._trainer.train_step.remote(batch), trained)

    def _publish(self, act: PublishWeights) -> None:
        v = act.version
        ref = self._trainer.publish.remote(v)
        self._weights[v] = ref

        def published(_: Any) -> None:  # ready in the object store; the controller never fetches it
            self.trace.event(self.now(), "weights_published", version=v)
            self._execute(self.policy.handle(WeightsPublished(version=v)))

        self._submit(ref, published)

    def _forget_old_weights(self) -> None:
        keep = set(self.policy.engine_versions()) | {self.policy.latest_version}
        for v in [v for v in self._weights if v not in keep and v < self.policy.latest_version]:
            del self._weights[v]

    # ------------------------------------------------------------------ counters and shutdown
    def _latest_counters(self) -> list[WorkerCounters | None]:
        return [w.counters for w in self._workers]

    def _final_counters(self) -> list[WorkerCounters | None]:
        """Fresh counters from every worker at the end (polled counters can be ``poll_timeout_s`` old)."""
        for w, c in zip(self._workers, ray.get([w.actor.counters.remote() for w in self._workers]), strict=True):
            w.counters = c
        return self._latest_counters()

    def _observe(self) -> None:
        self.stats.observe(self.now(), self._latest_counters(), self.policy.live_versions(), self.policy.engine_versions())

    def _close(self) -> None:
        """Account for every admitted, unconsumed trajectory, stop the actors, close the files."""
        t = self.now()
        finished_ids = {s.trajectory.request_id for g in self._scored for s in self._scored[g]}
        for g in sorted(self._scored):
            if g in self._consumed:
                continue
            for i in range(self.spp):
                rid = f"g{g}/{i}"
                self.trace.event(t, "unfinished_at_end", traj=rid, finished=rid in finished_ids)
                self.stats.unfinished_at_end += 1
        for w in self._workers:
            try:
                ray.get(w.actor.stop.remote(), timeout=10)
            except Exception:  # a worker that died or hangs must not block shutdown
                pass
        # Release the actors' CPU reservations now: on a shared Ray instance the next run needs them.
        for actor in [w.actor for w in self._workers] + ([self._trainer] if self._trainer is not None else []):
            ray.kill(actor)
        self.trace.close()
        self.metrics_out.close()
