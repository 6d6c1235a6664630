"""`dora calibrate SPEC --from-run RUN ...`: fit the cost model to what real local runs measured.

The micro-benchmarks of `dora.calibrate` time each engine alone. In a run, the rollout worker, the trainer
and the controller share the host: on the 2-core development machine a decode step of a streaming run took
1.3-1.9x what the engine takes alone, and a training step 1.35x. This module reads the files a finished
`dora apply` leaves in its output directory and fits the same constants from them:

    engine_steps.jsonl  every engine step: start on the run clock, duration, StepShape (decode rows,
                        context tokens, versions, prefill tokens)
    metrics.jsonl       every training step: its span on the run clock, forward tokens, sum of squared
                        sequence lengths, sequences
    trace.jsonl         train-step ends, weight publications and loads
    runtime.json        what the run ran: its model, algorithm and engines must be the spec's (`check_run_spec`)

Every row is checked before anything is fitted: a missing field, a value of the wrong type, a non-finite
duration or span or one under a microsecond, a training step that starts before the one before it with no resume
recorded, a weight publication or load that does not take time: each is an error naming the file, the line and the
field. A last line cut short (a writer killed mid-line) is ignored with a note; a bad line anywhere else is an error.
An engine step, poll or training step timed over OUTLIER_FACTOR x the median of its kind in its run (a paused
process) is left out with a note, and a fit that still lands outside a constant's range is an error, not a file.

A resumed run (killed, then the same `dora apply` run again) keeps every attempt's rows in metrics.jsonl, each
attempt on its own clock from 0, and one trace with one continuous clock (a ``resumed`` event marks each seam),
while engine_steps.jsonl holds the last attempt's steps only. Only the last attempt is used: the training steps
after the last ``resumed`` event's step, the trace events after that event (their clock less the event's time),
and the engine steps; a note says so. Its summary.json must say that attempt finished (its engine steps are
written at the end of an attempt); otherwise the run is refused.

Engine steps are split by whether they overlap a training step, and by whether other engines' steps cover at
least half of their span (another engine decoding at the same time); training steps by whether engine steps
cover at least half of their span. Then, with the cost model's own formulas (`dora.calibrate`):

    decode       (eta_mem, eta_c, t_step) from single-version decode steps with no training step running and no
                 other engine decoding, as cells of (batch size, mean context rounded to 8 tokens) with
                 >= MIN_CELL_STEPS steps, each cell's mean duration (means, not medians: a run's throughput pays
                 for the slow steps too; the cell's fastest and slowest step are its spread)
    engines      cpu_engine_contention = sum measured / sum predicted-alone over single-version decode steps with
                 no training step running while another engine decodes (only runs with several engines have
                 them, e.g. sync on 2 cores; without them the base value is kept and the fit says so)
    contention   cpu_rollout_contention = sum measured / sum predicted-alone over single-version decode steps
                 during a training step; cpu_train_contention from the training steps that engines' steps cover
                 for at least half their span: a step runs c times slower while some engine decodes, so with f
                 the covered fraction of its span and a its time alone, the span is a / ((1 - f) + f/c), and c
                 makes the predicted spans sum to the measured ones (``fit_train_contention``; alone = fitted on
                 the training steps covered less)
    versions     cpu_extra_version_step_s = sum over multi-version steps of (measured / contention - predicted
                 single-version) / sum (versions - 1), less the weight read the formula already charges
                 (steps that another engine's steps cover have the engine factor divided out too, here and in
                 the contention fit)
    train        (eta_train, t_train) from training steps with no rollout running; a step run on n torch
                 threads (a colocated sync trainer has every core) is modelled as data parallel over n cores.
                 Steps that record the trainer's own time (``train_time_s``) give t_train as span - that time
                 (the Ray call, the batch, the checkpoint: nothing more threads speed up), eta_train from the
                 one-thread steps' trainer times, and cpu_train_parallel_efficiency from the n-thread ones
                 (``dora.calibrate.fit_train_split``); older runs fit (eta_train, t_train) on the spans.
                 The first WARMUP_TRAIN_STEPS training steps of each run's attempt are left out (here and in the
                 contention fit): they are the trainer's warm-up (a sync run of local-tiny: 111 and 97 ms against a
                 median step of 44), and leaving them out took the train fit's median residual on a sync and a
                 streaming run from 8.5% to 5.3%
    weights      cpu_weight_publish_fixed_s from train-step end -> weights published (the trainer side: the
                 checkpoint, export and object-store put of a real step); cpu_weight_reload_fixed_s from the
                 loads of engines that ran no step meanwhile (trace: load started -> version served; the
                 weights are fetched and a model built beside the engine, which pauses only to install it:
                 the ``load`` rows of engine_steps.jsonl); means. A constant whose intervals the traces do not
                 hold keeps its base value, and the command says so.

A sync run gives the alone figures (rollout and training alternate), an asynchronous run the contended ones,
so pass one of each, e.g. `--from-run runs/sync --from-run runs/streaming`; a colocated sync run besides (its trainer
has every core) gives cpu_train_parallel_efficiency. Prefill is not refitted when the
runs have no prefill steps (prompts that fit the decode batch are ingested there): the base value is kept and
the fit says so.

The machine: a run's summary.json records where its steps ran (``machine``: CPU model, cores, versions); the
calibration file names that machine, and the command warns when the runs ran on different machines or not on the host
it runs on. A run without the record (made by an older dora) leaves the file naming this host, with a note.

Which runs are accepted (`check_run_spec`): the fits evaluate the spec's model (architecture and dtype), its
training step's passes and optimizer steps (algorithm name, ppo_epochs, minibatches_per_step, whether kl_coef > 0),
its trainer micro-batch and its accelerator on the shapes each run recorded step by step (batch rows, context
tokens, versions, training tokens, sequences, trainer threads). A run whose values of those differ from the spec's is
refused, naming each differing field with both values. A run of another spec (another spec_hash or name) whose
values of those fields match is accepted, with a note: its mode, step count, batch sizes, lengths and seed enter the
fits only through the shapes its steps recorded.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dora.calibrate import (
    TRAIN_COMPUTE_KEY,
    Fit,
    ModelContext,
    Point,
    _rollout_model,
    _train_seconds,
    fit_decode,
    fit_train,
)
from dora.spec.files import loads_json
from planner.calibration import Calibration

MIN_CELL_STEPS = 5
"""Engine steps a (batch, context) cell needs to become a decode point (the mean of its steps' durations is the
point, their min and max its spread)."""
MIN_POINTS = 3
"""Fewest points (cells, training steps) a fit accepts."""
WARMUP_TRAIN_STEPS = 2
"""Training steps at the start of each attempt left out of the training fits (warm-up; see the module docstring)."""
CONTEXT_BUCKET = 8
"""Mean context per row is rounded to this many tokens to form cells."""
STEP_COLUMNS = ["worker", "start_s", "duration_s", "kind", "decode_rows", "context_tokens", "versions",
                "prefill_tokens"]
"""The header of engine_steps.jsonl (`dora.runtime.controller`), in row order."""
FIX = "The file is not as `dora apply` wrote it: re-run the job, or leave this run out"
MIN_DURATION_S = 1e-6
"""No engine step, poll or training step is timed shorter than a microsecond; a shorter one is a wrong clock or
unit, refused."""
OUTLIER_FACTOR = 100.0
"""An engine step, poll or training step over this many times the median of its kind in its run is left out of the
fits, with a note: a paused or swapped-out process, not the engine's cost (a single 2,000 s step among 1 ms ones put
cpu_rollout_contention at 1,146). The runs measured on the development machine peak at 54x (engine steps) and 10x
(polls)."""
MIN_FOR_MEDIAN = 10
"""Rows of a kind a run needs before its median judges outliers."""


class RunDataError(ValueError):
    """The runs cannot calibrate: missing or malformed files, a run of another model, or not enough alone /
    contended measurements."""


@dataclass(kw_only=True)
class RunTimings:
    """What the runs measured, split as the fits need it."""

    runs: list[str] = field(default_factory=list)
    decode_alone: dict[tuple[int, int], list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    """(batch, context bucket) -> [(context tokens, seconds)] of single-version steps with no training step and no
    other engine decoding."""
    decode_engines: list[tuple[int, float, float]] = field(default_factory=list)
    """(batch, context tokens, seconds) of single-version steps with no training step while another engine
    decodes."""
    decode_contended: list[tuple[int, float, bool, float]] = field(default_factory=list)
    """(batch, context tokens, another engine decoding, seconds) of single-version steps during a training
    step."""
    multi: list[tuple[int, float, int, bool, bool, float]] = field(default_factory=list)
    """(batch, context tokens, versions, during a training step, another engine decoding, seconds) of
    multi-version steps."""
    train_alone: list[Point] = field(default_factory=list)
    train_contended: list[Point] = field(default_factory=list)
    publish: list[Point] = field(default_factory=list)
    """Train-step end -> weights published (trainer side: checkpoint, export, object store)."""
    loads: list[float] = field(default_factory=list)
    """Seconds from a load's start to the version being served, on an engine that ran no step meanwhile."""
    round_trips: list[float] = field(default_factory=list)
    """Seconds of every ``poll`` row: from a poll's reply to the requests the next one carried being in the engine."""
    prefill_steps: int = 0
    notes: list[str] = field(default_factory=list)
    """What the command should tell the user about how the runs were read (a resumed run, an ignored cut line)."""
    resumed: list[str] = field(default_factory=list)
    """One short phrase per resumed run ('RUN: steps 88..120 after the resume at step 87'), for the file's source."""
    machines: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """run directory -> the machine its summary.json records (None: it records none, an older dora's run)."""
    warmup_left_out: int = 0
    """Training steps left out as warm-up (``WARMUP_TRAIN_STEPS`` per run)."""
    early_left_out: int = 0
    """Early steps left out of the training fits: their spans hold waits for late groups (``_TrainStep.early``)."""

    def decode_points(self) -> list[Point]:
        out = []
        for (b, _), cell in sorted(self.decode_alone.items()):
            if len(cell) < MIN_CELL_STEPS:
                continue
            secs = [s for _, s in cell]
            out.append(Point(kind="decode", x={"batch_size": b, "total_context_tokens": statistics.fmean(c for c, _ in cell)},
                             seconds=statistics.fmean(secs), seconds_min=min(secs), seconds_max=max(secs)))
        return out

    def add(self, other: RunTimings) -> None:
        """Append ``other``'s measurements (one run's, read whole before anything is added)."""
        self.runs += other.runs
        for cell, rows in other.decode_alone.items():
            self.decode_alone[cell].extend(rows)
        self.decode_engines += other.decode_engines
        self.decode_contended += other.decode_contended
        self.multi += other.multi
        self.train_alone += other.train_alone
        self.train_contended += other.train_contended
        self.publish += other.publish
        self.loads += other.loads
        self.round_trips += other.round_trips
        self.prefill_steps += other.prefill_steps
        self.notes += other.notes
        self.resumed += other.resumed
        self.machines.update(other.machines)
        self.warmup_left_out += other.warmup_left_out
        self.early_left_out += other.early_left_out


# ----- reading and checking the files ---------------------------------------------------------------------------
def _is_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        problem = "not a directory" if run_dir.exists() else "no such directory"
        raise RunDataError(f"{run_dir}: {problem}; pass the output directory of a finished `dora apply` run (it writes "
                           "runtime.json, engine_steps.jsonl, metrics.jsonl and trace.jsonl)")


def _jsonl(path: Path, notes: list[str]) -> list[tuple[int, Any]]:
    """(line number, value) of every non-blank line. A last line cut short (no newline after it: a writer stopped
    mid-line) is left out with a note; any other line that is not JSON is an error naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RunDataError(f"{path}: {exc.strerror or exc}; pass the output directory of a finished `dora apply` "
                           "run (it writes engine_steps.jsonl, metrics.jsonl and trace.jsonl)") from None
    except UnicodeDecodeError as exc:
        raise RunDataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}). {FIX}") from None
    lines = text.split("\n")
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((lineno, loads_json(line)))
        except ValueError as exc:
            if lineno == last and not text.endswith("\n"):
                notes.append(f"{path}:{lineno}: the last line is cut short (a writer stopped mid-line); it is left "
                             "out")
                continue
            reason = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise RunDataError(f"{path}:{lineno}: not a JSON value ({reason}). {FIX}") from None
    return out


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(path: Path, lineno: int, name: str, problem: str) -> RunDataError:
    return RunDataError(f"{path}:{lineno}: {name} {problem}. {FIX}")


def _field(row: dict[str, Any], key: str, path: Path, lineno: int, what: str) -> Any:
    if key not in row:
        raise _bad(path, lineno, key, f"is missing from this {what}")
    return row[key]


def _number(value: Any, path: Path, lineno: int, name: str, *, positive: bool = False,
            duration: bool = False) -> float:
    """A finite number (> 0 with ``positive``; a time of at least ``MIN_DURATION_S`` with ``duration``), else an
    error naming ``path:lineno`` and the field."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(path, lineno, name, f"is {_show(value)}, not a number")
    if not math.isfinite(value):
        raise _bad(path, lineno, name, f"is {value}, not a finite number")
    if positive and value <= 0:
        raise _bad(path, lineno, name, f"is {_show(value)}, but it must be > 0")
    if duration and value < MIN_DURATION_S:
        raise _bad(path, lineno, name, f"is {_show(value)} s, but nothing the run times takes under a microsecond "
                                       "(a wrong clock or unit?)")
    return float(value)


def _integer(value: Any, path: Path, lineno: int, name: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(path, lineno, name, f"is {_show(value)}, not an integer")
    if value < minimum:
        raise _bad(path, lineno, name, f"is {value}, but it must be >= {minimum}")
    return value


@dataclass(frozen=True, kw_only=True)
class _EngineStep:
    worker: int
    start: float
    dur: float
    kind: str
    rows: int
    ctx: int
    versions: int
    prefill: int


def _engine_steps(path: Path, notes: list[str]) -> list[_EngineStep]:
    lines = _jsonl(path, notes)
    if not lines or not isinstance(lines[0][1], dict) or "columns" not in lines[0][1]:
        raise RunDataError(f"{path}: no header line; was it written by `dora apply`?")
    cols = lines[0][1]["columns"]
    if cols != STEP_COLUMNS:
        raise RunDataError(f"{path}: columns {cols}, expected {STEP_COLUMNS}")
    out = []
    for lineno, row in lines[1:]:
        if not isinstance(row, list) or len(row) != len(STEP_COLUMNS):
            got = f"a row of {len(row)} values" if isinstance(row, list) else f"{_show(row)}, not a row"
            raise RunDataError(f"{path}:{lineno}: {got}, expected {len(STEP_COLUMNS)} ({', '.join(STEP_COLUMNS)}). "
                               f"{FIX}")
        worker, start, dur, kind, rows, ctx, versions, prefill = row
        if kind not in ("step", "load", "poll"):
            raise _bad(path, lineno, "kind", f"is {_show(kind)}, but it must be \"step\", \"load\" or \"poll\"")
        step = _EngineStep(worker=_integer(worker, path, lineno, "worker"),
                           start=_number(start, path, lineno, "start_s"),
                           dur=_number(dur, path, lineno, "duration_s", positive=True, duration=True), kind=kind,
                           rows=_integer(rows, path, lineno, "decode_rows"),
                           ctx=_integer(ctx, path, lineno, "context_tokens"),
                           versions=_integer(versions, path, lineno, "versions"),
                           prefill=_integer(prefill, path, lineno, "prefill_tokens"))
        if kind == "step" and step.rows and not step.versions:
            raise _bad(path, lineno, "versions", f"is 0 on a step of {step.rows} decode rows, but it must be >= 1")
        out.append(step)
    if not out:
        raise RunDataError(f"{path}: no engine step after the header; pass the output directory of a `dora apply` "
                           "run that ran to its end")
    return out


@dataclass(frozen=True, kw_only=True)
class _TrainStep:
    lineno: int
    step: int
    start: float
    end: float
    tokens: int
    sum_sq: float
    seqs: int
    threads: int
    compute: float | None
    """The trainer's own time for the step (``train_time_s``; None in runs of an older dora)."""
    early: bool = False
    """An early step (``joined_s``): its span holds the trainer's waits for groups that finished after it started."""


def _train_steps(path: Path, notes: list[str]) -> list[_TrainStep]:
    out = []
    for lineno, m in _jsonl(path, notes):
        if not isinstance(m, dict):
            raise RunDataError(f"{path}:{lineno}: {_show(m)} is not a training step's object. {FIX}")
        step = _integer(_field(m, "step", path, lineno, "training step"), path, lineno, "step", minimum=1)
        if "forward_sum_sq_tokens" not in m:
            raise RunDataError(f"{path}:{lineno}: step {step} lacks forward_sum_sq_tokens (written by an older dora); "
                               "re-run the job")
        start = _number(_field(m, "start_s", path, lineno, "training step"), path, lineno, "start_s")
        end = _number(_field(m, "end_s", path, lineno, "training step"), path, lineno, "end_s")
        if end - start < MIN_DURATION_S:
            raise _bad(path, lineno, "end_s", f"is {_show(end)}, not a microsecond after start_s {_show(start)}: a "
                                              "training step takes time")
        out.append(_TrainStep(
            lineno=lineno, step=step, start=start, end=end,
            tokens=_integer(_field(m, "forward_tokens", path, lineno, "training step"), path, lineno,
                            "forward_tokens", minimum=1),
            sum_sq=_number(m["forward_sum_sq_tokens"], path, lineno, "forward_sum_sq_tokens", positive=True),
            seqs=_integer(_field(m, "num_sequences", path, lineno, "training step"), path, lineno, "num_sequences",
                          minimum=1),
            threads=_integer(m.get("train_threads", 1), path, lineno, "train_threads", minimum=1),
            compute=(None if m.get("train_time_s") is None
                     else _number(m["train_time_s"], path, lineno, "train_time_s", positive=True, duration=True)),
            early=m.get("joined_s") is not None))
    if not out:
        raise RunDataError(f"{path}: no training step; pass the output directory of a `dora apply` run that ran to "
                           "its end")
    return out


_EVENT_FIELDS = {"resumed": ("step",), "train_step": ("step",), "weights_published": ("version",),
                 "weights_load_started": ("rollout_group", "version"), "weights_loaded": ("rollout_group", "version")}
"""The trace events the fits read, and their integer fields (each also has its time ``t``)."""


@dataclass(frozen=True, kw_only=True)
class _Event:
    lineno: int
    type: str
    t: float
    ints: dict[str, int]


def _trace(path: Path, notes: list[str]) -> list[_Event]:
    lines = _jsonl(path, notes)
    if not lines:
        raise RunDataError(f"{path}: no events; pass the output directory of a `dora apply` run that ran to its end")
    out = []
    for lineno, e in lines:
        if not isinstance(e, dict):
            raise RunDataError(f"{path}:{lineno}: {_show(e)} is not a trace event's object. {FIX}")
        kind = e.get("type")
        if not isinstance(kind, str) or kind not in _EVENT_FIELDS:
            continue
        t = _number(_field(e, "t", path, lineno, f"{kind} event"), path, lineno, "t")
        ints = {k: _integer(_field(e, k, path, lineno, f"{kind} event"), path, lineno, k) for k in _EVENT_FIELDS[kind]}
        out.append(_Event(lineno=lineno, type=kind, t=t, ints=ints))
    return out


def _summary_machine(path: Path) -> dict[str, Any] | None:
    """The machine a run's summary.json records (where the attempt it is of ran), or None when it records none."""
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # missing or unreadable: no record (_last_attempt refuses it where the run needs it)
    summary = data.get("summary") if isinstance(data, dict) else None
    machine = summary.get("machine") if isinstance(summary, dict) else None
    return machine if isinstance(machine, dict) else None


def _summary_resumed_from(path: Path) -> tuple[bool, Any, str]:
    """Of a run's summary.json: (whether it could be read, its ``resumed_from_step`` or None, a phrase saying which
    attempt it is of)."""
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except OSError:
        return False, None, f"{path} is missing"
    except (ValueError, UnicodeDecodeError):
        return False, None, f"{path} is not readable JSON"
    summary = data.get("summary") if isinstance(data, dict) else None
    said = summary.get("resumed_from_step") if isinstance(summary, dict) else None
    if type(said) is int:
        return True, said, f"{path} is of the attempt resumed after step {said}"
    return True, None, f"{path} is of an attempt that was not resumed"


def _last_attempt(run_dir: Path, train: list[_TrainStep], events: list[_Event], paths: dict[str, Path],
                  notes: list[str], resumed: list[str]) -> tuple[list[_TrainStep], list[_Event], float]:
    """The training steps and trace events of the run's last attempt, and the trace clock where it began (0 for a run
    never resumed); see the module docstring."""
    metrics_path, trace_path = paths["metrics"], paths["trace"]
    seams = [e for e in events if e.type == "resumed"]
    readable, said, says = _summary_resumed_from(run_dir / "summary.json")
    offset = 0.0
    if seams:
        seam = seams[-1]
        n = seam.ints["step"]
        if said != n:
            raise RunDataError(
                f"{run_dir}: the run was last resumed after step {n} ({trace_path}:{seam.lineno}), but {says}: that "
                f"attempt did not run to its end, and {paths['steps']} is not its (an attempt writes its engine steps "
                "when it ends). Run the same `dora apply` command again to finish it, or leave this run out")
        earlier = len([s for s in train if s.step <= n])
        train = [s for s in train if s.step > n]
        if not train:
            raise RunDataError(f"{metrics_path}: no training step after step {n}, where the run was last resumed "
                               f"({trace_path}:{seam.lineno}). {FIX}")
        events = [e for e in events if e.lineno > seam.lineno]
        offset = seam.t
        at = " and ".join(str(e.ints["step"]) for e in seams)
        fitted = (f"its training steps from {train[WARMUP_TRAIN_STEPS].step} on (the first {WARMUP_TRAIN_STEPS} are "
                  "the trainer's warm-up)" if len(train) > WARMUP_TRAIN_STEPS else
                  f"none of its {len(train)} training step(s) in the training fit (the first {WARMUP_TRAIN_STEPS} of "
                  "an attempt are the trainer's warm-up), only its engine steps")
        notes.append(f"run {run_dir} was resumed at step{'s' if len(seams) > 1 else ''} {at}; only its last attempt "
                     f"(steps {n + 1}..{train[-1].step}) is used, {fitted}: each attempt restarts the clock of "
                     f"metrics.jsonl, and engine_steps.jsonl holds the last attempt's engine steps only "
                     f"({earlier} earlier training step(s) left out)")
        resumed.append(f"{run_dir.name}: steps {n + 1}..{train[-1].step} after the resume at step {n}")
    elif readable and said is not None:
        raise RunDataError(f"{run_dir}: {says}, but {trace_path} records no resume. {FIX}")
    prev: _TrainStep | None = None
    for s in train:
        if prev is not None:
            if s.step <= prev.step:
                raise _bad(metrics_path, s.lineno, "step", f"is {s.step}, after step {prev.step} (line {prev.lineno}): "
                                                           "the steps must increase")
            if s.start < prev.start:
                raise RunDataError(
                    f"{metrics_path}:{s.lineno}: step {s.step} starts at {_show(s.start)} s, before step {prev.step} "
                    f"(line {prev.lineno}, {_show(prev.start)} s): the clock restarted, as a resumed attempt's does, "
                    f"but {trace_path} records no resume between them. {FIX}")
            if s.start < prev.end:
                raise _bad(metrics_path, s.lineno, "start_s",
                           f"is {_show(s.start)}, before step {prev.step} ended (line {prev.lineno}, end_s "
                           f"{_show(prev.end)}): one trainer runs one step at a time")
        prev = s
    return train, events, offset


def _outliers(rows: list[tuple[str, float]], path: Path, what: str, notes: list[str]) -> set[int]:
    """Indices of the ``(kind, seconds)`` rows over ``OUTLIER_FACTOR`` times the median of their kind (kinds with
    at least ``MIN_FOR_MEDIAN`` rows), with a note naming the longest."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    for kind, secs in rows:
        by_kind[kind].append(secs)
    limit = {k: OUTLIER_FACTOR * statistics.median(v) for k, v in by_kind.items() if len(v) >= MIN_FOR_MEDIAN}
    out = {j for j, (kind, secs) in enumerate(rows) if kind in limit and secs > limit[kind]}
    if out:
        worst = max(out, key=lambda j: rows[j][1])
        notes.append(f"{path}: left {len(out)} of its {what} out of the fits, each over {OUTLIER_FACTOR:g}x the "
                     f"median of its kind (the longest {rows[worst][1]:.6g} s, a {rows[worst][0]}): a paused or "
                     "swapped-out process, not the engine's cost")
    return out


def read_run(run_dir: Path, into: RunTimings) -> None:
    """Add one run directory's measurements to ``into``: every file is read and checked first, so a bad one
    (RunDataError, naming the file, line and field) adds nothing."""
    _is_run_dir(run_dir)
    part = RunTimings()
    paths = {"steps": run_dir / "engine_steps.jsonl", "metrics": run_dir / "metrics.jsonl",
             "trace": run_dir / "trace.jsonl"}
    steps = _engine_steps(paths["steps"], part.notes)
    # an engine step timed over OUTLIER_FACTOR x its kind's median did not run that long: left out everywhere (as an
    # interval beside training or another engine too)
    paused = _outliers([(st.kind, st.dur) for st in steps], paths["steps"], "engine steps and polls", part.notes)
    steps = [st for j, st in enumerate(steps) if j not in paused]
    train = _train_steps(paths["metrics"], part.notes)
    events = _trace(paths["trace"], part.notes)
    train, events, offset = _last_attempt(run_dir, train, events, paths, part.notes, part.resumed)
    part.runs.append(str(run_dir))
    part.machines[str(run_dir)] = _summary_machine(run_dir / "summary.json")
    spans = [(s.start, s.end) for s in train]  # in start order, not overlapping (checked)
    starts = [s for s, _ in spans]
    busy_in: dict[int, list[tuple[float, float]]] = defaultdict(list)
    """training step index -> the parts of its span in which an engine ran a step (one per engine step)."""

    def training_at(t0: float, t1: float) -> int | None:
        i = bisect.bisect_right(starts, t1) - 1
        return i if i >= 0 and spans[i][1] > t0 else None

    engine_spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    """worker -> its steps' (start, end), in start order (an engine runs one step at a time)."""
    for st in steps:
        if st.kind == "step":
            engine_spans[st.worker].append((st.start, st.start + st.dur))
        elif st.kind == "poll":
            part.round_trips.append(st.dur)
    for worker_spans in engine_spans.values():
        worker_spans.sort()
    engine_starts = {w: [s for s, _ in sp] for w, sp in engine_spans.items()}

    def others_busy(worker: int, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] during which other engines ran a step (summed over engines)."""
        busy = 0.0
        for w, sp in engine_spans.items():
            if w == worker:
                continue
            j = bisect.bisect_left(engine_starts[w], t1) - 1
            while j >= 0 and sp[j][1] > t0:
                busy += min(t1, sp[j][1]) - max(t0, sp[j][0])
                j -= 1
        return busy

    for st in steps:
        if st.kind != "step":
            continue
        start, dur, rows, ctx = st.start, st.dur, st.rows, st.ctx
        i = training_at(start, start + dur)
        if i is not None:
            busy_in[i].append((max(start, spans[i][0]), min(start + dur, spans[i][1])))
        if st.prefill:
            part.prefill_steps += 1
            continue
        if rows == 0:
            continue
        shared = len(engine_spans) > 1 and others_busy(st.worker, start, start + dur) >= 0.5 * dur
        if st.versions > 1:
            part.multi.append((rows, ctx, st.versions, i is not None, shared, dur))
        elif i is not None:
            part.decode_contended.append((rows, ctx, shared, dur))
        elif shared:
            part.decode_engines.append((rows, ctx, dur))
        else:
            part.decode_alone[(rows, round(ctx / rows / CONTEXT_BUCKET))].append((ctx, dur))
    # a training step timed that long is left out of the fits only: its span still tells the engine steps beside it
    slow = _outliers([("training step", s.end - s.start) for s in train], paths["metrics"], "training steps",
                     part.notes)
    for i, s in enumerate(train):
        if i < WARMUP_TRAIN_STEPS:  # still spans above: the engine steps it overlaps ran beside training all the same
            part.warmup_left_out += 1
            continue
        if i in slow:
            continue
        if s.early:
            part.early_left_out += 1
            continue
        span = s.end - s.start
        x = {"tokens": s.tokens, "sum_sq_seq_len": s.sum_sq, "num_seqs": s.seqs, "dp": s.threads}
        if s.compute is not None:
            x[TRAIN_COMPUTE_KEY] = s.compute
        overlap = min(1.0, _union_s(busy_in.get(i, [])) / span)
        if overlap >= 0.5:
            x[OVERLAP_KEY] = overlap
        point = Point(kind="train", x=x, seconds=span, seconds_min=span, seconds_max=span)
        (part.train_contended if overlap >= 0.5 else part.train_alone).append(point)
    trace_path = paths["trace"]
    load_started: dict[tuple[int, int], _Event] = {}
    for e in events:
        if e.type == "weights_load_started":
            load_started[(e.ints["rollout_group"], e.ints["version"])] = e
        elif e.type == "weights_loaded" and (e.ints["rollout_group"], e.ints["version"]) in load_started:
            begun, worker = load_started.pop((e.ints["rollout_group"], e.ints["version"])), e.ints["rollout_group"]
            if e.t <= begun.t:
                raise _bad(trace_path, e.lineno, "t", f"of this weights_loaded (v{e.ints['version']}, rollout group "
                                                      f"{worker}) is {_show(e.t)}, not after its load started (line "
                                                      f"{begun.lineno}, t {_show(begun.t)}): a load takes time")
            st_ = engine_starts.get(worker, [])
            if bisect.bisect_right(st_, e.t - offset) == bisect.bisect_left(st_, begun.t - offset):  # no step meanwhile
                part.loads.append(e.t - begun.t)
    ends = {e.ints["step"]: e for e in events if e.type == "train_step"}
    for e in events:
        if e.type == "weights_published" and e.ints["version"] in ends:
            end = ends[e.ints["version"]]
            secs = e.t - end.t
            if secs <= 0:
                raise _bad(trace_path, e.lineno, "t", f"of this weights_published (v{e.ints['version']}) is "
                                                      f"{_show(e.t)}, not after train_step {end.ints['step']} ended "
                                                      f"(line {end.lineno}, t {_show(end.t)}): a publish takes time")
            part.publish.append(Point(kind="publish", x={"version": e.ints["version"]}, seconds=secs,
                                      seconds_min=secs, seconds_max=secs))
    into.add(part)


SPEC_FIELDS = ("model", "algorithm.name", "algorithm.ppo_epochs", "algorithm.minibatches_per_step", "algorithm.kl_coef",
               "train_micro_batch_tokens", "accelerator", "rollout_engine", "trainer")
"""The runtime-config fields whose values the fits take from the spec, not from the run (see the module docstring);
``algorithm.kl_coef`` only as to whether it is > 0 (a reference-model forward)."""


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k in sorted(value):
            out.update(_flatten(value[k], f"{prefix}.{k}"))
        return out
    return {prefix: value}


def check_run_spec(run_dir: Path, expected: dict[str, Any], spec_label: str) -> str | None:
    """Refuse (RunDataError) a run whose runtime.json differs from ``expected`` (the spec's runtime config, as
    `dora apply` would write it) in a field of ``SPEC_FIELDS``, naming each with both values; a note when the run is
    of another spec that matches in all of them, else None."""
    _is_run_dir(run_dir)
    path = run_dir / "runtime.json"
    try:
        run = loads_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RunDataError(f"{path}: {exc.strerror or exc}; a `dora apply` output directory holds the runtime config "
                           "it ran (pass the output directory of a `dora apply` run)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RunDataError(f"{path}: not readable JSON ({exc}). {FIX}") from None
    if not isinstance(run, dict):
        raise RunDataError(f"{path}: {_show(run)} is not a runtime config object. {FIX}")
    absent = object()
    run_flat: dict[str, Any] = {}
    spec_flat: dict[str, Any] = {}
    for name in SPEC_FIELDS:
        here, there = run, expected
        for part in name.split("."):
            here = here.get(part, absent) if isinstance(here, dict) else absent
            there = there.get(part, absent) if isinstance(there, dict) else absent
        run_flat.update(_flatten(here, name))
        spec_flat.update(_flatten(there, name))

    def show(v: Any) -> str:
        return "(absent)" if v is absent else _show(v)

    def differs(name: str) -> bool:
        a, b = run_flat.get(name, absent), spec_flat.get(name, absent)
        if name == "algorithm.kl_coef" and all(isinstance(v, int | float) for v in (a, b)):
            return (a > 0) != (b > 0)
        return bool(a != b)

    # model.name is a label (an `architecture:` model is named after its spec or config directory): the fits use the
    # architecture and dtype only
    diffs = [f"{name}: run {show(run_flat.get(name, absent))}, spec {show(spec_flat.get(name, absent))}"
             for name in sorted(set(run_flat) | set(spec_flat)) if name != "model.name" and differs(name)]
    model = [d for d in diffs if d.startswith("model.")]
    if model:
        raise RunDataError(f"{path}: the run trained another model than {spec_label}: {'; '.join(model)}. The fits "
                           "evaluate the spec's model on the run's timings, so they must match: calibrate with the "
                           "spec the run was made from, or `dora apply` this spec and pass that run")
    if diffs:
        raise RunDataError(f"{path}: the run's training step or engines differ from {spec_label}'s: "
                           f"{'; '.join(diffs)}. The fits evaluate the spec's training step and engines on the run's timings, so they must "
                           "match: calibrate with the spec the run was made from, or `dora apply` this spec and pass "
                           "that run")
    if run.get("spec_hash") != expected.get("spec_hash") or run.get("spec_name") != expected.get("spec_name"):
        return (f"run {run_dir} was made from spec {_show(run.get('spec_name'))} (spec_hash "
                f"{str(run.get('spec_hash'))[:12]}), not {spec_label} ({str(expected.get('spec_hash'))[:12]}); it is "
                "used: its model, training step and engines are the spec's, and the fits take batch sizes, contexts, "
                "versions and training tokens from what each of its steps recorded")
    return None


OVERLAP_KEY = "overlap"
"""A contended training step's point holds in ``x`` the fraction of its span in which some engine ran a step."""


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals``."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def fit_train_contention(points: Sequence[Point], predicted: Sequence[float]) -> tuple[float, list[float]]:
    """(cpu_train_contention, residuals): a training step runs c times slower while some engine decodes (the
    simulator's model), so a step of alone time a that overlapped rollout for a fraction f of its span has the span
    a / ((1 - f) + f / c). c (at least 1) makes the predicted spans sum to the measured ones, as a run's throughput
    pays for the slow steps too (with every f = 1: sum measured / sum alone); bisection, the sum rises with c."""
    fs = [p.x.get(OVERLAP_KEY, 1.0) for p in points]
    measured = sum(p.seconds for p in points)

    def spans(c: float) -> list[float]:
        return [a / ((1 - f) + f / c) for a, f in zip(predicted, fs, strict=True)]

    lo, hi = 1.0, 2.0
    if sum(spans(lo)) >= measured:
        hi = lo
    else:
        while sum(spans(hi)) < measured and hi < 1e6:
            lo, hi = hi, hi * 2
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(spans(mid)) < measured else (lo, mid)
    return hi, [q / p.seconds - 1 for q, p in zip(spans(hi), points, strict=True)]


def _require(points: Sequence[Any], what: str, hint: str) -> None:
    if len(points) < MIN_POINTS:
        raise RunDataError(f"the runs hold {len(points)} {what} (need >= {MIN_POINTS}); {hint}")


def fit_runs(data: RunTimings, ctx: ModelContext, base: Calibration, source: str) -> tuple[Calibration, list[Fit]]:
    """Fit every in-situ constant (see the module docstring) onto ``base``; the calibration and its fits."""
    decode = data.decode_points()
    sync_run = ("add a sync run, whose rollout runs while the trainer idles: `dora apply SPEC --mode sync --steps 20 "
                "--output-dir runs/sync`, then `--from-run runs/sync` beside the others")
    async_run = ("add an asynchronous run: `dora apply SPEC --mode streaming --steps 20 --output-dir runs/stream`, then "
                 "`--from-run runs/stream` beside the others")
    _require(decode, f"decode cells of >= {MIN_CELL_STEPS} single-version steps with no training step running and "
             "no other engine decoding", sync_run)
    _require(data.decode_contended, "single-version decode steps during a training step", async_run)
    _require(data.train_alone, "training steps with no rollout running", sync_run)
    _require(data.train_contended, "training steps run while rollout ran", async_run)
    fits = [fit_decode(decode, ctx, base)]
    calib = _with(base, _rounded(fits[0].constants))
    alone = _rollout_model(ctx, calib)
    engine_f = calib.cpu_engine_contention or 1.0
    if len(data.decode_engines) >= MIN_POINTS:
        predicted = [alone.decode_step_s(b, c) for b, c, _ in data.decode_engines]
        engine_f = max(1.0, sum(s for *_, s in data.decode_engines) / sum(predicted))
        fits.append(Fit(kind="engines", constants={"cpu_engine_contention": engine_f},
                        residuals=tuple(s / p / engine_f - 1
                                        for (*_, s), p in zip(data.decode_engines, predicted, strict=True))))
        calib = _with(calib, _rounded(fits[-1].constants))
        engine_f = calib.cpu_engine_contention or 1.0
    contended = [s / (engine_f if shared else 1.0) for _, _, shared, s in data.decode_contended]
    predicted = [alone.decode_step_s(b, c) for b, c, _, _ in data.decode_contended]
    rollout_f = max(1.0, sum(contended) / sum(predicted))
    ratios = [s / p for s, p in zip(contended, predicted, strict=True)]
    train_fit = fit_train(data.train_alone, ctx, calib)
    calib = _with(calib, _rounded(train_fit.constants))
    train_f, train_residuals = fit_train_contention(data.train_contended,
                                                    [_train_seconds(ctx, calib, p) for p in data.train_contended])
    fits.append(Fit(kind="contention", constants={"cpu_rollout_contention": rollout_f, "cpu_train_contention": train_f},
                    residuals=tuple([r / rollout_f - 1 for r in ratios] + train_residuals)))
    calib = _with(calib, _rounded(fits[-1].constants))
    if data.multi:
        weight_read = alone.nonexpert_weight_bytes_per_device / alone.memory_rate_bytes_per_s
        excess = [s / (rollout_f if during else 1.0) / (engine_f if shared else 1.0) - alone.decode_step_s(b, c)
                  for b, c, v, during, shared, s in data.multi]
        extra = max(0.0, sum(excess) / sum(v - 1 for _, _, v, *_ in data.multi) - weight_read)
        extras = [e / (v - 1) - weight_read for e, (_, _, v, *_) in zip(excess, data.multi, strict=True)]
        fits.append(Fit(kind="versions", constants={"cpu_extra_version_step_s": extra},
                        residuals=tuple((e - extra) / (alone.decode_step_s(b, c) + extra)
                                        for e, (b, c, *_) in zip(extras, data.multi, strict=True))))
        calib = _with(calib, _rounded(fits[-1].constants))
    fits.append(train_fit)
    if data.publish or data.loads:  # a constant whose intervals no trace holds keeps its base value (the CLI says so)
        fits.append(fit_weights(data.publish, data.loads, ctx, calib))
        calib = _with(calib, _rounded(fits[-1].constants))
    if data.round_trips:  # runs written before the worker logged its polls have none: the base value stays
        fits.append(fit_round_trip(data.round_trips))
    fitted = {k: float(f"{v:.6g}") for f in fits for k, v in f.constants.items()}
    return _with(base, fitted).with_overrides(source=source), fits


def _with(calib: Calibration, constants: dict[str, float]) -> Calibration:
    """``calib`` with the fitted ``constants``; a value out of its range is the runs' fault (implausible timings),
    said as such, not a crash."""
    try:
        return calib.with_overrides(**constants)
    except ValueError as exc:
        raise RunDataError(f"the fit to the runs' timings is out of range ({exc}): they cannot come from this spec's "
                           "engines (a run of another machine or model, or a process paused for long stretches?); "
                           "re-run the jobs, or leave the odd run out") from None


ROUND_TRIP_CHUNK = 50
"""Consecutive polls per residual of the round-trip fit."""


def fit_round_trip(round_trips: Sequence[float]) -> Fit:
    """cpu_controller_round_trip_s: the mean of every ``poll`` row (the idle slot time a refill costs is proportional
    to it, and the simulator charges every refill the same). The residuals are the means of ``ROUND_TRIP_CHUNK``
    consecutive polls against it: one poll's round trip varies 2-3x with what the controller is doing meanwhile, the
    mean over a few dozen much less."""
    mean = statistics.fmean(round_trips)
    chunks = [round_trips[i:i + ROUND_TRIP_CHUNK] for i in range(0, len(round_trips), ROUND_TRIP_CHUNK)]
    if len(chunks) > 1 and len(chunks[-1]) < ROUND_TRIP_CHUNK:
        chunks.pop()  # a short remainder: its mean is noisier than the others'
    return Fit(kind="round trip", constants={"cpu_controller_round_trip_s": mean},
               residuals=tuple(mean / statistics.fmean(c) - 1 for c in chunks))


def fit_weights(publish: Sequence[Point], loads: Sequence[float], ctx: ModelContext, calib: Calibration) -> Fit:
    """(cpu_weight_publish_fixed_s, cpu_weight_reload_fixed_s): the measured means beyond the formula's trainer-side
    (gather, convert) and engine-side (transfer, buckets, per-tensor reload) terms. A constant with no measurement
    (``publish`` or ``loads`` empty) is not fitted: it is absent from the fit's constants and keeps ``calib``'s value."""
    from planner.sim.costmodel import cost_model_timing

    def timing(cal: Calibration) -> Any:
        return cost_model_timing(ctx.arch, rollout_acc=ctx.accelerator, train_acc=ctx.accelerator, rollout_tp=1,
                                 num_rollout_groups=1, train_tp=1, train_pp=1, train_dp=1, dtype_bytes=ctx.dtype_bytes,
                                 rollout_weight_bytes=ctx.rollout_weight_bytes,
                                 micro_batch_tokens=ctx.micro_batch_tokens, calib=cal,
                                 accelerators_per_node=ctx.accelerators_per_node)

    zero = timing(calib.with_overrides(cpu_weight_publish_fixed_s=0.0, cpu_weight_reload_fixed_s=0.0))
    constants: dict[str, float] = {}
    if publish:
        constants["cpu_weight_publish_fixed_s"] = max(0.0, statistics.fmean(p.seconds for p in publish)
                                                      - zero.weight_publish_s)
    if loads:
        constants["cpu_weight_reload_fixed_s"] = max(0.0, statistics.fmean(loads) - zero.weight_load_trainer_s)
    final = timing(calib.with_overrides(**constants))
    # read_run refuses intervals that take no time; the guards keep a caller's zero from dividing
    return Fit(kind="weights", constants=constants,
               residuals=tuple([final.weight_publish_s / p.seconds - 1 for p in publish if p.seconds > 0]
                               + [final.weight_load_trainer_s / y - 1 for y in loads if y > 0]))


def _rounded(constants: dict[str, float]) -> dict[str, float]:
    return {k: float(f"{v:.6g}") for k, v in constants.items()}


def points_of(data: RunTimings) -> list[Point]:
    """The measurements the calibration file records: decode cells, training steps (alone, then contended),
    publishes."""
    contended = [Point(kind="train_contended", x=p.x, seconds=p.seconds, seconds_min=p.seconds_min,
                       seconds_max=p.seconds_max) for p in data.train_contended]
    return [*data.decode_points(), *data.train_alone, *contended, *data.publish]
