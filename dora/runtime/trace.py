"""Run outputs: the event trace, per-step metrics, and atomically written summary files.

``trace.jsonl`` holds one JSON object per line in the ``planner.schedule`` event schema (the one the
simulator records), times ``t`` in seconds since the run's clock started:

=====================  ============================================================================
``type``               fields
=====================  ============================================================================
``admitted``           ``traj``, ``version``, ``rollout_group``
``run_config``         ``mode``, ``k``, ``allow_version_mixing``, ``num_rollout_groups``, ``slots_per_group``
``finished``           ``traj``, ``rollout_group``, ``num_tokens``, ``spans`` ``[[version, n], ...]``
``weights_load_started`` ``rollout_group``, ``version``, ``source``
``weights_loaded``     ``rollout_group``, ``version``
``version_dropped``    ``rollout_group``, ``version`` (a multi-version engine freed a drained version)
``migrated``           ``src``, ``dst``, ``trajs``
``train_step``         ``step``, ``start_t``, ``consumed`` (trajectory ids), ``produced_version``
``weights_published``  ``version``
``unfinished_at_end``  ``traj``, ``finished`` (whether it had finished but was never consumed)
=====================  ============================================================================

The trace and the metrics are append-only and flushed per record: after a crash or Ctrl-C they hold
exactly what happened up to that point, which is what an audit of a partial run should see.
Whole-file outputs (summary, timeline) are written to a temporary file and renamed, so a reader
never sees half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO


class JsonlWriter:
    """Append JSON objects, one per line, flushed after each (see the module doc for why)."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = path.open("a" if append else "w", encoding="utf-8")
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path} is closed")
        self._file.write(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
        self._file.flush()
        self.count += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


class TraceWriter(JsonlWriter):
    """``trace.jsonl``: stamps every event with the run clock ``t`` (seconds) it is given.

    A resumed attempt appends (``append=True``) with ``offset_s``, the clock where the previous attempt's
    trace stops, added to every ``t`` it is given, so the combined trace stays in time order."""

    def __init__(self, path: Path, *, append: bool = False, offset_s: float = 0.0) -> None:
        super().__init__(path, append=append)
        self.offset_s = offset_s

    def event(self, t_s: float, kind: str, **fields: Any) -> None:
        self.write({"t": round(self.offset_s + t_s, 6), "type": kind, **fields})


class JsonlError(ValueError):
    """A line of a JSON-lines file that is not JSON, and not the unterminated last line a killed writer leaves."""

    def __init__(self, path: Path, lineno: int, reason: str) -> None:
        super().__init__(f"{path}, line {lineno}: not a JSON record ({reason})")
        self.path, self.lineno = path, lineno


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file. An unterminated last line that is not JSON (a writer killed mid-write) is
    skipped; any other line that is not JSON raises ``JsonlError``: skipping it, or stopping there, would lose records
    that callers (a resume rewrites ``metrics.jsonl`` from what it read) take for the whole file."""
    out = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                if not line.endswith(b"\n"):
                    break  # the cut last line (only the last line can lack its newline)
                if isinstance(exc, json.JSONDecodeError):  # its messages end in " at" or want it: "Extra data"
                    reason = f"{exc.msg}{'' if exc.msg.endswith(' at') else ' at'} column {exc.colno}"
                else:
                    reason = f"not UTF-8: {exc.reason}"
                raise JsonlError(path, lineno, reason) from None
    return out


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a temporary file of its own in ``path``'s directory, fsync it, and rename it onto ``path``: a
    reader never sees half a file, and writers of one path at the same time never write through one another's file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; outputs are meant to be shared like any other file
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- metrics
@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One line of ``metrics.jsonl``. Times in seconds on the run clock.

    ``forward_tokens`` (prompt + response tokens the trainer processed) is what *trained tokens* counts, here and
    in the planner's predictions; ``response_tokens`` are the response tokens that carry the loss.

    Interval figures cover ``(previous step's end, this step's end]``: ``rollout_occupancy`` is
    occupied slot-seconds over ``slots x`` the worker-seconds they were counted in (each worker's counters carry
    its own clock, and the controller holds them as of the worker's last message, which may be a poll timeout
    older than the step's end: dividing by the controller's interval instead read above 100% for short steps);
    ``rollout_share`` is the part of the
    interval with rollout under way: at least one admitted trajectory unfinished on any worker (in
    ``sync``, the generation phase over the step time, as the simulator and the published step
    breakdowns count it). ``mean_staleness`` is ``step - version - 1`` averaged over the batch (the
    constraint's own measure: 0 is on-policy).
    """

    step: int
    start_s: float
    end_s: float
    step_time_s: float
    train_time_s: float
    reward_mean: float
    exact_fraction: float
    loss: float
    grad_norm: float
    is_weight_mean: float
    is_weight_max: float
    is_weight_clip_frac: float
    ppo_clip_frac: float
    kl_mean: float
    """Mean KL estimate to the reference policy per trained token (0 without ``algorithm.kl_coef``)."""
    mean_staleness: float
    max_staleness: int
    num_sequences: int
    response_tokens: int
    forward_tokens: int
    forward_sum_sq_tokens: int
    train_threads: int
    mean_response_tokens: float
    generated_tokens: int
    rollout_occupancy: float
    rollout_share: float
    live_versions: tuple[int, ...]
    engine_versions: tuple[int, ...]
    cum_generated_tokens: int
    cum_busy_slot_s: float
    cum_busy_s: float
    """Summed over workers: each worker's time with at least one sequence in its engine."""
    cum_worker_wall_s: float
    """Summed over workers: the wall time their counters cover (the denominator of the occupancy)."""
    cum_rollout_s: float
    """Time with at least one admitted trajectory unfinished anywhere (see ``rollout_share``)."""
    joined_s: float | None = None
    """An early step (``PolicyConfig.early_steps``): when the last of its groups that finished after it started went to
    the trainer. Its span holds the trainer's waits for them, so ``dora calibrate --from-run`` leaves it out of the
    training fit. None: every group was in when it started."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 6)
            elif isinstance(value, tuple):
                out[key] = list(value)
        return out


def _sums(counters: Sequence[Any]) -> tuple[float, float, int, float]:
    """(busy slot-seconds, busy seconds, generated tokens, wall seconds) summed over the workers that reported."""
    live = [c for c in counters if c is not None]
    return (sum(c.busy_slot_s for c in live), sum(c.busy_s for c in live), sum(c.generated_tokens for c in live),
            sum(c.wall_s for c in live))


def _occupancy(slot_s: float, wall_s: float, slots: int) -> float:
    """Occupied slot-seconds over the slot-seconds of ``wall_s`` worker-seconds (0 before any were counted)."""
    return slot_s / (slots * wall_s) if wall_s > 0 else 0.0


@dataclass(kw_only=True)
class RunStats:
    """The controller's running tally: per-step records plus what the live display shows."""

    num_workers: int
    slots_per_worker: int
    total_steps: int
    mode: str
    steps: list[StepRecord] = field(default_factory=list)
    warmup_steps: int = 0
    warmup_s: float = 0.0
    weight_loads: int = 0
    migrated: int = 0
    mixed_trajectories: int = 0
    finished_trajectories: int = 0
    unfinished_at_end: int = 0
    now_s: float = 0.0
    end_s: float | None = None
    live_versions: tuple[int, ...] = (0,)
    engine_versions: tuple[int, ...] = ()
    max_live_versions: int = 1
    in_flight: int = 0
    occupancy_now: float = 0.0
    generated_tokens: int = 0
    busy_slot_s: float = 0.0
    busy_s: float = 0.0
    worker_wall_s: float = 0.0
    resumed_from_step: int | None = None
    """The checkpoint step this attempt resumed from (``None``: a fresh run)."""
    regenerated: int = 0
    """Trajectories started again from their prompt (resume, or a restarted rollout worker)."""
    worker_restarts: int = 0
    recovery_s: list[float] = field(default_factory=list)
    """Per worker restart: seconds from noticing the failure to the worker serving again."""
    rollout_s: float = 0.0
    """Time with at least one admitted trajectory unfinished anywhere, up to ``_open_t``."""
    _open: int = 0
    _open_t: float = 0.0

    def trajectories_open(self, now_s: float, count: int) -> None:
        """``count`` admitted trajectories are unfinished from ``now_s`` on (the controller calls this at
        each admission and finish): accumulates ``rollout_s``."""
        if self._open > 0:
            self.rollout_s += max(0.0, now_s - self._open_t)
        self._open, self._open_t = count, now_s

    def observe(self, now_s: float, counters: Sequence[Any], live: tuple[int, ...], engines: tuple[int, ...]) -> None:
        """Refresh the live figures (called between events, a few times a second)."""
        self.now_s = now_s
        self.live_versions, self.engine_versions = live, engines
        self.max_live_versions = max(self.max_live_versions, len(live))
        reported = [c for c in counters if c is not None]
        self.in_flight = sum(c.num_active for c in reported)
        self.occupancy_now = min(1.0, self.in_flight / (self.num_workers * self.slots_per_worker))
        self.busy_slot_s, self.busy_s, self.generated_tokens, self.worker_wall_s = _sums(counters)

    def step_finished(
        self, *, step: int, start_s: float, end_s: float, metrics: Any, rewards: Sequence[float],
        versions: Sequence[int], counters: Sequence[Any], live: tuple[int, ...], engines: tuple[int, ...],
        joined_s: float | None = None,
    ) -> StepRecord:
        self.observe(end_s, counters, live, engines)
        self.trajectories_open(end_s, self._open)
        prev_end = self.steps[-1].end_s if self.steps else 0.0
        prev = self.steps[-1] if self.steps else None
        interval = max(end_s - prev_end, 1e-9)
        d_slot = self.busy_slot_s - (prev.cum_busy_slot_s if prev else 0.0)
        d_rollout = self.rollout_s - (prev.cum_rollout_s if prev else 0.0)
        d_gen = self.generated_tokens - (prev.cum_generated_tokens if prev else 0)
        d_wall = self.worker_wall_s - (prev.cum_worker_wall_s if prev else 0.0)
        staleness = [step - v - 1 for v in versions]
        record = StepRecord(
            step=step, start_s=start_s, end_s=end_s, step_time_s=interval, train_time_s=metrics.train_time_s,
            reward_mean=metrics.reward_mean, exact_fraction=sum(r == 1.0 for r in rewards) / len(rewards),
            loss=metrics.loss, grad_norm=metrics.grad_norm, is_weight_mean=metrics.is_weight_mean,
            is_weight_max=metrics.is_weight_max, is_weight_clip_frac=metrics.is_weight_clip_frac,
            ppo_clip_frac=metrics.ppo_clip_frac, kl_mean=metrics.kl_mean, mean_staleness=sum(staleness) / len(staleness),
            max_staleness=max(staleness), num_sequences=metrics.num_sequences,
            response_tokens=metrics.num_trained_tokens, forward_tokens=metrics.num_forward_tokens,
            forward_sum_sq_tokens=metrics.forward_sum_sq_tokens, train_threads=metrics.train_threads,
            mean_response_tokens=metrics.num_trained_tokens / metrics.num_sequences, generated_tokens=d_gen,
            rollout_occupancy=_occupancy(d_slot, d_wall, self.slots_per_worker),
            rollout_share=d_rollout / interval, live_versions=live, engine_versions=engines,
            cum_generated_tokens=self.generated_tokens, cum_busy_slot_s=self.busy_slot_s, cum_busy_s=self.busy_s,
            cum_worker_wall_s=self.worker_wall_s, cum_rollout_s=self.rollout_s, joined_s=joined_s,
        )
        self.steps.append(record)
        return record

    def summary(self) -> dict[str, Any]:
        """Run-level figures. Speed figures cover this attempt's steady state, from the end of its first step to the end
        of its last (``steady_*``); with one step there is none, and they cover that step from the attempt's start,
        pipeline fill included (``first_step_*``, ``SPEED_PREFIXES``). The counts are this attempt's, which for a
        fresh run are the run's; a resumed run's summary takes them from the trace of every attempt instead
        (``dora.runtime.driver.finish_job``)."""
        s = self.steps
        out: dict[str, Any] = {
            "mode": self.mode, "steps": s[-1].step if s else (self.resumed_from_step or 0),
            "total_steps": self.total_steps,
            "wall_s": self.end_s if self.end_s is not None else self.now_s,
            "warmup_steps": self.warmup_steps, "warmup_s": self.warmup_s, "weight_loads": self.weight_loads,
            "migrated_trajectories": self.migrated, "mixed_trajectories": self.mixed_trajectories,
            "unfinished_at_end": self.unfinished_at_end, "max_live_versions": self.max_live_versions,
            "rollout_workers": self.num_workers, "slots_per_worker": self.slots_per_worker,
            "resumed_from_step": self.resumed_from_step, "regenerated_trajectories": self.regenerated,
            "worker_restarts": self.worker_restarts, "recovery_s": list(self.recovery_s),
            "resumed_at_steps": [] if self.resumed_from_step is None else [self.resumed_from_step],
        }
        if not s:
            return out
        steady = s[1:] if len(s) > 1 else s
        t0 = s[0].end_s if len(s) > 1 else 0.0
        base = s[0] if len(s) > 1 else None
        span = max(s[-1].end_s - t0, 1e-9)
        prefix = "steady" if base else "first_step"
        out.update({
            speed_key(prefix, "step_time_s"): span / len(steady),
            # prompt + response tokens, as the planner counts them
            speed_key(prefix, "trained_tokens_per_s"): sum(r.forward_tokens for r in steady) / span,
            speed_key(prefix, "generated_tokens_per_s"):
                (s[-1].cum_generated_tokens - (base.cum_generated_tokens if base else 0)) / span,
            speed_key(prefix, "rollout_occupancy"): _occupancy(
                s[-1].cum_busy_slot_s - (base.cum_busy_slot_s if base else 0.0),
                s[-1].cum_worker_wall_s - (base.cum_worker_wall_s if base else 0.0), self.slots_per_worker),
            speed_key(prefix, "rollout_share"): (s[-1].cum_rollout_s - (base.cum_rollout_s if base else 0.0)) / span,
        })
        out.update(training_figures([asdict(r) for r in s]))
        return out


SPEED_PREFIXES = ("steady", "first_step")
"""The speed figures' key prefixes in a summary (``RunStats.summary``): ``steady`` from the end of an attempt's first
step to its last; ``first_step`` an attempt's only step from its start (the pipeline filling up, not a rate the run
keeps: the display labels it so)."""


def speed_key(prefix: str, figure: str) -> str:
    """A speed figure's summary key: ``steady_trained_tokens_per_s``, ``first_step_rollout_share``, ...; the step time
    is ``steady_step_time_s`` or ``first_step_time_s``."""
    return "first_step_time_s" if (prefix, figure) == ("first_step", "step_time_s") else f"{prefix}_{figure}"


def training_figures(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the trained batches were, from ``metrics.jsonl`` rows (one per step, in order): staleness, response
    length, reward, importance weights. A resumed run passes every step's row, so these cover the whole run."""
    tokens = [r["response_tokens"] for r in rows]
    seqs = [r["num_sequences"] for r in rows]
    k = max(1, len(rows) // 5)
    return {
        "mean_staleness": sum(r["mean_staleness"] * r["num_sequences"] for r in rows) / sum(seqs),
        "max_staleness": max(r["max_staleness"] for r in rows),
        "mean_trained_response_tokens": sum(tokens) / sum(seqs),
        "reward_curve": [round(r["reward_mean"], 4) for r in rows],
        "reward_first": sum(r["reward_mean"] for r in rows[:k]) / k,
        "reward_last": sum(r["reward_mean"] for r in rows[-k:]) / k,
        "is_weight_mean": sum(r["is_weight_mean"] * r["response_tokens"] for r in rows) / sum(tokens),
        "is_weight_max": max(r["is_weight_max"] for r in rows),
        "is_weight_clip_frac": sum(r["is_weight_clip_frac"] * r["response_tokens"] for r in rows) / sum(tokens),
    }
