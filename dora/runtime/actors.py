"""The runtime's workers: a rollout worker (one rollout group) and the trainer, plain classes made Ray actors.

``RolloutWorker`` owns one rollout engine (``TorchRolloutEngine``, or vLLM's: ``rollout_engine``) and runs its
``step()`` loop in a background thread, so generation never waits on the controller. Every engine access happens
on that thread (but ``stage_weights``, which touches no engine state and runs on the caller's thread): commands
(``add_requests``, ``load_weights``, ``export_requests`` ...) are queued to it and run between two
engine steps, which keeps the engine single-threaded and commands ordered without a lock around
``step()`` (a plain lock would starve the callers: the loop re-acquires it before they wake).

Finished trajectories leave through messages numbered by a per-worker sequence: a ``poll`` (long
poll, returns as soon as anything finished) or the reply to ``export_requests`` (which carries the
trajectories that finished before the export). The controller processes a worker's messages in
sequence order, so it never sees a trajectory finish on an engine after that engine's migration.

Run as Ray actors with ``max_concurrency=2``: one thread serves the poll, one the commands; the
controller keeps at most one of each outstanding per worker.

New requests may ride on a poll (``poll(requests=...)``) instead of costing a command round trip of their own:
the controller re-arms a worker's poll after it has processed the poll's message, with the admissions that
processing made. Such a poll runs its ``add_requests`` on the engine thread before it waits. The two threads
can run a command and a carrying poll in either order, so each command names how many carrying polls the
controller had sent before it (``after``), and the engine thread holds it until that many have been applied:
the engine sees every operation in the order the controller issued it.

Incarnations: Ray restarts a dead worker on its own and delivers later calls to the new process, which
holds none of the old one's requests, versions or message sequence. Every process draws a fresh
``incarnation`` token; the controller sends the token it addresses with each poll and command, and a
process refuses a call meant for another incarnation (``WorkerRestarted``) without touching its state.
So a restart is always seen, even when no call was in flight at the moment of death.

Occupancy accounting (per worker, wall clock since ``start_clock``): ``busy_slot_s`` integrates the
sequences holding a slot over each step's duration, ``busy_s`` the time with at least one; the
rollout slot occupancy is ``busy_slot_s / (max_num_seqs * wall_s)``.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from dora.runtime.engines.base import (
    FinishedTrajectory,
    GenerationRequest,
    MigratingRequest,
    RolloutEngine,
    ScoredTrajectory,
    TrainMetrics,
)
from dora.runtime.engines.torch_rollout import RolloutConfig, TorchRolloutEngine
from dora.runtime.engines.torch_trainer import TorchTrainer, TrainerConfig, warm_up
from dora.runtime.heap import settle_heap
from dora.runtime.tasks import LengthSampler, TaskConfig

STEP_LOG_COLUMNS = ("start_s", "duration_s", "kind", "decode_rows", "context_tokens", "versions", "prefill_tokens")
"""One row per engine step (kind ``step``): when it started (worker clock since ``start_clock``), how long it
took, and its ``StepShape`` (what the cost model's step time depends on); one per weight load run on the
engine thread (kind ``load``, shape zeros): how long decoding paused for it; and one per poll that carried requests
(kind ``poll``; ``decode_rows`` the requests it carried, the rest zeros): from the previous poll's return to these
requests being in the engine, the controller's round trip (what the simulator charges a refill,
``Calibration.cpu_controller_round_trip_s``)."""
StepLogRow = tuple[float, float, str, int, int, int, int]
"""One step-log row, in ``STEP_LOG_COLUMNS`` order."""
STEP_LOG_LIMIT = 200_000
"""Rows a worker keeps (about 10 MB; a 10-minute local run makes ~30K)."""
STEP_LOG_FILE = "engine_steps.jsonl"
"""Where the controller writes every worker's step log at the end of a run (in the output directory)."""


@dataclass(frozen=True, kw_only=True)
class WorkerCounters:
    """Cumulative counters of one rollout worker since ``start_clock`` (seconds of wall time)."""

    wall_s: float
    busy_s: float
    """Time with at least one sequence in a slot."""
    busy_slot_s: float
    """Integral of occupied slots over time (slot-seconds)."""
    generated_tokens: int
    num_active: int


@dataclass(frozen=True, kw_only=True)
class WorkerMessage:
    """What a poll or an export returns: finished trajectories, numbered for in-order processing."""

    seq: int
    finished: tuple[FinishedTrajectory, ...]
    counters: WorkerCounters
    exported: tuple[MigratingRequest, ...] = ()
    """Only in an ``export_requests`` reply: the in-flight requests, with their KV cache."""
    export_reply: bool = False


class WorkerRestarted(RuntimeError):
    """A call addressed to an earlier incarnation of a rollout worker reached the process Ray restarted."""


class EngineFailed(RuntimeError):
    """A rollout worker's engine raised during a step (vLLM's, say, on a request it cannot serve): its requests' state
    is unknown, so the worker serves no more calls, and the run stops with the error (the worker's log has the
    traceback) rather than wait for trajectories that will not come."""


class RolloutWorker:
    """One rollout group: a continuous-batching engine hosting one version (or several: ``keep_loaded``).

    Polls and commands take the ``incarnation`` they address (see the module doc); ``None``, for
    in-process use where no restart can happen, skips the check.
    """

    def __init__(self, config: RolloutConfig, *, index: int) -> None:
        torch.set_num_threads(config.num_threads)
        self.index = index
        self._incarnation = uuid.uuid4().hex
        self.config = config
        self._engine = rollout_engine(config)
        self._inbox: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._carried = 0
        """Polls whose requests the engine thread has added (see the module doc)."""
        self._held: deque[_Op] = deque()
        """Commands waiting for an earlier carrying poll's requests (``_Op.after > _carried``)."""
        self._cond = threading.Condition()
        self._outbox: list[FinishedTrajectory] = []
        self._seq = 0
        self._stopping = False
        self._suspended = False
        """Colocated streaming: the engine keeps its requests but takes no step (``set_suspended``)."""
        self._t0 = time.perf_counter()
        self._busy_s = 0.0
        self._busy_slot_s = 0.0
        self._step_start: float | None = None
        """``perf_counter()`` at the start of the engine step under way, ``None`` between steps."""
        self._generated_base = 0
        self._settled = False
        """Whether ``settle_heap`` ran in this process (after its first weight load)."""
        self._step_log: deque[StepLogRow] = deque(maxlen=STEP_LOG_LIMIT)
        self._poll_returned: float | None = None
        """``perf_counter()`` when the last poll returned its message (the start of a ``poll`` row)."""
        self._failure: str | None = None
        """What the engine raised, once it has (``EngineFailed``)."""
        self._thread = threading.Thread(target=self._loop, name=f"rollout-{index}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        engine = self._engine
        while True:
            self._run_commands(block=self._suspended or not (engine.num_active() or engine.num_waiting()))
            if self._stopping:
                return
            if self._suspended or not (engine.num_active() or engine.num_waiting()):
                continue
            with self._cond:  # read the clock and mark the step under the lock _counters holds: snapshots stay ordered
                start = self._step_start = time.perf_counter()
            try:
                finished = engine.step()
            except Exception as exc:
                self._fail(exc)
                return
            duration = time.perf_counter() - start
            occupied = engine.num_active() + len(finished)
            shape = engine.last_step_shape()
            with self._cond:
                self._step_log.append((round(start - self._t0, 6), round(duration, 7), "step", *shape))
                self._busy_s += duration
                self._busy_slot_s += occupied * duration
                self._step_start = None
                if finished:
                    self._outbox.extend(finished)
                    self._cond.notify_all()

    def _fail(self, exc: Exception) -> None:
        """The engine raised at a step: record it, fail the commands queued for the engine thread, and wake the poll
        (each then raises ``EngineFailed``); the thread ends."""
        traceback.print_exc()  # into the worker's log
        with self._cond:
            self._failure = f"{type(exc).__name__}: {exc}"
            self._step_start = None
            self._cond.notify_all()
        for op in (*self._held, *_drain(self._inbox)):
            op.future.set_exception(self._failed())
        self._held.clear()

    def _failed(self) -> EngineFailed:
        return EngineFailed(f"rollout worker {self.index}: its engine failed at a step ({self._failure}); the worker's "
                            "log has the traceback")

    def _run_commands(self, *, block: bool) -> None:
        try:
            op = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if op.after > self._carried:
                self._held.append(op)  # issued after a carrying poll that has not reached this thread yet
            else:
                self._run(op)
                while self._held and self._held[0].after <= self._carried:
                    self._run(self._held.popleft())
            try:
                op = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self, op: _Op) -> None:
        try:
            op.future.set_result(op.fn())
        except BaseException as exc:  # the caller's thread re-raises it
            op.future.set_exception(exc)
        finally:
            if op.carried:
                self._carried += 1

    def _expect(self, incarnation: str | None) -> None:
        if incarnation is not None and incarnation != self._incarnation:
            raise WorkerRestarted(f"rollout worker {self.index}: a call for incarnation {incarnation[:8]} reached "
                                  f"incarnation {self._incarnation[:8]} (the process was restarted)")

    def _call(self, fn: Callable[[], Any], incarnation: str | None, after: int = 0, *, carried: bool = False) -> Any:
        """Run ``fn`` on the engine thread between two steps, once ``after`` carrying polls' requests are in (see
        the module doc), and return its result."""
        self._expect(incarnation)
        if self._stopping:
            raise RuntimeError(f"rollout worker {self.index} is stopped")
        if self._failure is not None:
            raise self._failed()
        future: Future[Any] = Future()
        self._inbox.put(_Op(fn, future, after, carried))
        if self._failure is not None:  # the engine thread failed since the check above: it will not run this
            for op in _drain(self._inbox):
                op.future.set_exception(self._failed())
        return future.result()

    def _message(self, exported: tuple[MigratingRequest, ...] = (), *, export: bool = False) -> WorkerMessage:
        """Take the outbox as the next numbered message (caller holds ``_cond``)."""
        self._seq += 1
        finished, self._outbox = tuple(self._outbox), []
        return WorkerMessage(
            seq=self._seq, finished=finished, counters=self._counters(), exported=exported, export_reply=export,
        )

    def _counters(self) -> WorkerCounters:
        """The counters as of the last instant they account for (caller holds ``_cond``): during an engine step that
        is the step's start, since the step's slot-seconds are added when it ends. So ``busy_slot_s`` never exceeds
        ``max_num_seqs * wall_s``, and neither does the difference of two snapshots (a step's occupancy)."""
        in_step = self._step_start
        return WorkerCounters(
            wall_s=(time.perf_counter() if in_step is None else in_step) - self._t0,
            busy_s=self._busy_s,
            busy_slot_s=self._busy_slot_s,
            generated_tokens=self._engine.stats().generated_tokens - self._generated_base,
            num_active=self._engine.num_active() + self._engine.num_waiting(),
        )

    # ------------------------------------------------------------------ controller API
    def incarnation(self) -> str:
        """This process's token (a restarted worker has a new one)."""
        return self._incarnation

    def poll(
        self, timeout_s: float, linger_s: float = 0.0, min_batch: int = 1, *, incarnation: str | None = None,
        requests: list[GenerationRequest] | None = None,
    ) -> WorkerMessage:
        """Add ``requests`` (if any: a carrying poll, see the module doc); then wait up to ``timeout_s`` for a
        finished trajectory, then up to ``linger_s`` more until ``min_batch`` have finished; return them (possibly
        none) as the next message.

        Lingering trades a few milliseconds of refill latency for fewer, larger messages: each message
        costs the controller a Ray round trip, and on a small machine that CPU comes out of rollout.
        """
        self._expect(incarnation)
        if requests is not None:
            self._call(lambda: self._add(requests), incarnation, carried=True)
            if requests and self._poll_returned is not None and self._poll_returned >= self._t0:
                added = time.perf_counter()
                with self._cond:
                    self._step_log.append((round(self._poll_returned - self._t0, 6),
                                           round(max(added - self._poll_returned, 1e-7), 7), "poll", len(requests),
                                           0, 0, 0))
        with self._cond:
            self._cond.wait_for(lambda: bool(self._outbox) or self._stopping or self._failure is not None,
                                timeout=timeout_s)
            if self._failure is not None:
                raise self._failed()
            if self._outbox and linger_s > 0:
                engine = self._engine  # lingering for a request that is not there would only delay this message
                self._cond.wait_for(lambda: len(self._outbox) >= min_batch or self._stopping
                                    or not (engine.num_active() or engine.num_waiting()), timeout=linger_s)
            self._poll_returned = time.perf_counter()
            return self._message()

    def counters(self) -> WorkerCounters:
        """The cumulative counters now (outside the message sequence: carries no trajectories)."""
        with self._cond:
            return self._counters()

    def step_log(self) -> tuple[float, list[StepLogRow]]:
        """``(clock origin, rows)``: every engine step since ``start_clock`` (the latest ``STEP_LOG_LIMIT``) as
        ``STEP_LOG_COLUMNS`` rows, ``start_s`` counted from the origin (a ``time.perf_counter()`` reading: one
        system-wide monotonic clock on Linux, so the controller can put the rows on its own clock). The in-situ
        timings ``dora calibrate --from-run`` fits the cost model to."""
        with self._cond:
            return self._t0, list(self._step_log)

    def start_clock(self, *, incarnation: str | None = None) -> None:
        """Zero the occupancy counters: the run's wall clock starts now (after warm-up and first load)."""

        def reset() -> None:
            with self._cond:
                self._t0 = time.perf_counter()
                self._busy_s = self._busy_slot_s = 0.0
                self._step_log.clear()
                self._generated_base = self._engine.stats().generated_tokens

        self._call(reset, incarnation)

    def load_weights(
        self, version: int, weights: dict[str, torch.Tensor], resume_in_flight: bool = False, keep_loaded: bool = False,
        *, incarnation: str | None = None, after: int = 0,
    ) -> None:
        """Serve ``version``. Ray resolves ``weights`` from the object store (one copy per version).

        With ``resume_in_flight`` the in-flight requests are aborted, and resumed on ``version`` with
        their tokens so far re-prefilled (partial rollout: they get a new version span). With
        ``keep_loaded`` ``version`` is added beside the hosted versions and their requests keep running
        on them (multi-version engines). Otherwise the engine must be empty; the old versions are dropped.
        The model is built (``stage_weights``) on the calling thread while the engine keeps decoding; the
        engine thread only installs it (the ``load`` row of the step log is that pause).
        """
        self._expect(incarnation)
        staged = self._engine.stage_weights(version, weights)

        def load() -> None:
            start = time.perf_counter()
            _load()
            with self._cond:
                self._step_log.append((round(start - self._t0, 6), round(time.perf_counter() - start, 7), "load",
                                       0, 0, 0, 0))

        def _load() -> None:
            engine = self._engine
            partials = []
            if keep_loaded:
                engine.install_weights(version, staged)
                return
            if resume_in_flight:
                partials = [(request, engine.abort(request.request_id)) for request in _in_flight(engine)]
            elif engine.num_active() or engine.num_waiting():
                raise RuntimeError(
                    f"worker {self.index}: load v{version} with {engine.num_active() + engine.num_waiting()} "
                    "requests in flight and resume_in_flight=False"
                )
            engine.install_weights(version, staged)
            for old in engine.hosted_versions():
                if old != version:
                    engine.drop_version(old)
            for request, partial in partials:
                engine.add_request(GenerationRequest(
                    request_id=request.request_id, prompt_ids=request.prompt_ids, version=version,
                    max_new_tokens=request.max_new_tokens, min_new_tokens=request.min_new_tokens,
                    temperature=request.temperature, seed=request.seed, prefix=partial,
                ))

        self._call(load, incarnation, after)
        if not self._settled:  # start-up is over, for this process: a restarted one too (dora.runtime.heap)
            self._settled = True
            settle_heap()

    def set_suspended(self, suspended: bool, *, incarnation: str | None = None, after: int = 0) -> None:
        """Stop (or resume) taking engine steps, keeping every request with its KV cache and version: colocated
        streaming hands the cores to the trainer meanwhile. Runs between two steps: once it returns, the engine
        is stopped; its finishes until then are in the outbox, for the next poll. On ``cpu`` the requests stay where
        they are (device memory is host memory); a GPU engine would move them to host memory here."""

        def set_flag() -> None:
            self._suspended = suspended

        self._call(set_flag, incarnation, after)

    def drop_version(self, version: int, *, incarnation: str | None = None, after: int = 0) -> None:
        """Free ``version``'s weights (no request of it may remain; the engine checks)."""
        self._call(lambda: self._engine.drop_version(version), incarnation, after)

    def add_requests(self, requests: list[GenerationRequest], *, incarnation: str | None = None,
                     after: int = 0) -> None:
        self._call(lambda: self._add(requests), incarnation, after)

    def _add(self, requests: list[GenerationRequest]) -> None:
        for r in requests:
            self._engine.add_request(r)

    def export_requests(self, *, incarnation: str | None = None, after: int = 0) -> WorkerMessage:
        """Remove every in-flight request with its KV cache; the reply also carries unpolled finishes."""

        def export() -> WorkerMessage:
            engine = self._engine
            moved = tuple(engine.export_request(r.request_id) for r in _in_flight(engine))
            with self._cond:
                return self._message(exported=moved, export=True)

        return self._call(export, incarnation, after)

    def import_requests(self, requests: list[MigratingRequest], *, incarnation: str | None = None,
                        after: int = 0) -> None:
        def imp() -> None:
            for m in requests:
                self._engine.import_request(m)

        self._call(imp, incarnation, after)

    def pid(self) -> int:
        """The worker's process id (fault-injection tests and benchmarks kill it)."""
        import os

        return os.getpid()

    def stop(self) -> None:
        """Stop the engine thread (in-flight requests are abandoned; the controller accounts for them)."""
        self._stopping = True
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5.0)


@dataclass(frozen=True, slots=True)
class _Op:
    """An operation for the engine thread: ``fn``, its result's ``future``; run once ``after`` carrying polls'
    requests are in; ``carried``: it adds a carrying poll's requests."""

    fn: Callable[[], Any]
    future: Future[Any]
    after: int
    carried: bool


def _drain(inbox: queue.SimpleQueue[_Op]) -> list[_Op]:
    """Take every operation left in ``inbox``."""
    ops = []
    while True:
        try:
            ops.append(inbox.get_nowait())
        except queue.Empty:
            return ops


def rollout_engine(config: RolloutConfig) -> RolloutEngine:
    """The engine ``config.engine`` names (vLLM's is imported only when asked for: the torch runtime needs no vLLM)."""
    if config.engine == "vllm":
        from dora.runtime.engines.vllm_rollout import VLLMRolloutEngine

        return VLLMRolloutEngine(config)
    return TorchRolloutEngine(config)


def _in_flight(engine: RolloutEngine) -> list[GenerationRequest]:
    """Requests holding a slot or waiting for one, in slot then arrival order."""
    return list(engine.in_flight_requests())


class TrainerActor:
    """The trainer: supervised warm-up (version 0), GRPO steps, and weights published per version.

    With ``megatron`` (the lowered Megatron config), megatron-core trains the GRPO steps: the torch trainer's
    warm-up still makes version 0 (megatron-core's model starts from its weights, through the checkpoint's
    names), and each published version comes back from those names into the torch engines' model, whose
    ``swiglu`` MLP is the one megatron-core builds."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        task: TaskConfig,
        lengths: LengthSampler,
        seed: int,
        warmup_learning_rate: float,
        megatron: dict[str, Any] | None = None,
    ) -> None:
        torch.set_num_threads(config.num_threads)
        self._trainer = TorchTrainer(config)
        self._task = task
        self._lengths = lengths
        self._seed = seed
        self._warmup_lr = warmup_learning_rate
        self._megatron_config = megatron
        self._megatron: Any = None

    def _policy(self, *, from_warm_up: bool = True) -> Any:
        """The trainer of the GRPO steps: the torch one, or the Megatron one (built at first use, from the warmed
        torch model's weights unless ``from_warm_up`` is False: a restore brings its own)."""
        if self._megatron_config is None:
            return self._trainer
        if self._megatron is None:
            from dora.runtime.engines.megatron_trainer import MegatronTrainer, MegatronTrainerConfig
            from dora.runtime.engines.tiny_model import hf_weights
            from dora.runtime.engines.torch_trainer import GRPOSettings

            cfg = MegatronTrainerConfig(megatron=self._megatron_config, grpo=GRPOSettings.of(self._trainer.config),
                                        device="cpu", seed=self._seed)
            start = hf_weights(self._trainer.export_weights()[1], self._trainer.config.model) if from_warm_up else None
            self._megatron = MegatronTrainer(cfg, initial_weights=start)
        return self._megatron

    def warm_up(self, cache_dir: str | None) -> tuple[int, float, list[str]]:
        """Supervised warm-up (cached by content hash in ``cache_dir``); returns ``(steps run, seconds, notes)``, the
        notes for the user (an unreadable cache file, warmed up again)."""
        from pathlib import Path

        start = time.perf_counter()
        notes: list[str] = []
        losses = warm_up(
            self._trainer, self._task, self._lengths, seed=self._seed, learning_rate=self._warmup_lr,
            cache_dir=None if cache_dir is None else Path(cache_dir), notes=notes,
        )
        self._megatron = None  # a Megatron trainer starts from the warmed weights
        return len(losses), time.perf_counter() - start, notes

    def train_part(self, part: list[ScoredTrajectory]) -> None:
        """Part of an early step's batch (whole groups), trained at once; its ``train_step`` call brings the last part
        (``torch_trainer.StepInParts``)."""
        self._policy().train_part(part)

    def train_step(self, batch: list[ScoredTrajectory], save_to: str | None = None) -> TrainMetrics:
        """One GRPO step; with ``save_to``, then ``save_state(save_to)`` in the same call (a checkpointed step
        costs the controller no extra round trip, and the controller never waits on the save)."""
        metrics: TrainMetrics = self._policy().train_step(batch)
        if save_to is not None:
            self.save_state(save_to)
        return metrics

    def save_state(self, path: str) -> int:
        """Write weights, optimizer, step and version to ``path`` (a temporary file of its own, fsync, rename); the
        version. A kill halfway leaves the temporary file, which the next commit removes (``write_checkpoint``)."""
        from pathlib import Path

        from dora.runtime.trace import write_atomic

        state = self._policy().state_dict()
        write_atomic(Path(path), lambda f: torch.save(state, f))
        return int(state["version"])  # type: ignore[call-overload]

    def load_state(self, path: str) -> int:
        """Restore what ``save_state`` wrote (replaces warm-up on resume); returns the version now held."""
        trainer = self._policy(from_warm_up=False)
        trainer.load_state_dict(torch.load(path, weights_only=True))
        return int(trainer.version)

    def settle_heap(self) -> int:
        """Start-up is over (warm-up or restore, the first publish): see ``dora.runtime.heap``."""
        return settle_heap()

    def publish(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, its weights)``: the controller calls it with ``num_returns=2`` and fetches only the version;
        the weights land in Ray's object store, and workers fetch them."""
        have, weights = self._policy().export_weights()
        if have != version:
            raise RuntimeError(f"publish v{version} but the trainer holds v{have}")
        if self._megatron_config is not None:  # checkpoint names -> the torch engines' model
            from dora.runtime.engines.tiny_model import tiny_weights

            weights = tiny_weights(weights, self._trainer.config.model)
        return have, weights
