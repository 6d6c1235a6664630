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

Engine steps are split by whether they overlap a training step, and by whether other engines' steps cover at
least half of their span (another engine decoding at the same time); training steps by whether engine steps
cover at least half of their span. Then, with the cost model's own formulas (`dora.calibrate`):

    decode       (eta_mem, eta_c, t_step) from single-version decode steps with no training step running and no
                 other engine decoding, as cells of (batch size, mean context rounded to 8 tokens) with
                 >= MIN_CELL_STEPS steps, each cell's mean duration (means, not medians: a run's throughput pays
                 for the slow steps too)
    engines      cpu_engine_contention = sum measured / sum predicted-alone over single-version decode steps with
                 no training step running while another engine decodes (only runs with several engines have
                 them, e.g. sync on 2 cores; without them the base value is kept and the fit says so)
    contention   cpu_rollout_contention = sum measured / sum predicted-alone over single-version decode steps
                 during a training step; cpu_train_contention = the same over training steps run while rollout
                 ran (alone = fitted on training steps with no rollout)
    versions     cpu_extra_version_step_s = sum over multi-version steps of (measured / contention - predicted
                 single-version) / sum (versions - 1), less the weight read the formula already charges
                 (steps that another engine's steps cover have the engine factor divided out too, here and in
                 the contention fit)
    train        (eta_train, t_train) from training steps with no rollout running; a step run on n torch
                 threads (a colocated sync trainer has every core) is modelled as data parallel over n cores
    weights      cpu_weight_publish_fixed_s from train-step end -> weights published (the trainer side: the
                 checkpoint, export and object-store put of a real step); cpu_weight_reload_fixed_s from the
                 loads of engines that ran no step meanwhile (trace: load started -> version served; the
                 weights are fetched and a model built beside the engine, which pauses only to install it:
                 the ``load`` rows of engine_steps.jsonl); means

A sync run gives the alone figures (rollout and training alternate), an asynchronous run the contended ones,
so pass one of each, e.g. `--from-run runs/sync --from-run runs/streaming`. Prefill is not refitted when the
runs have no prefill steps (prompts that fit the decode batch are ingested there): the base value is kept and
the fit says so.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dora.calibrate import Fit, ModelContext, Point, _rollout_model, _train_seconds, fit_decode, fit_train
from dora.spec.files import loads_json
from planner.calibration import Calibration

MIN_CELL_STEPS = 5
"""Engine steps a (batch, context) cell needs to become a decode point (its median is the point)."""
MIN_POINTS = 3
"""Fewest points (cells, training steps) a fit accepts."""
CONTEXT_BUCKET = 8
"""Mean context per row is rounded to this many tokens to form cells."""


class RunDataError(ValueError):
    """The runs cannot calibrate: missing files, or not enough alone / contended measurements."""


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
    prefill_steps: int = 0

    def decode_points(self) -> list[Point]:
        out = []
        for (b, _), cell in sorted(self.decode_alone.items()):
            if len(cell) < MIN_CELL_STEPS:
                continue
            secs = sorted(s for _, s in cell)
            out.append(Point(kind="decode", x={"batch_size": b, "total_context_tokens": statistics.fmean(c for c, _ in cell)},
                             seconds=statistics.fmean(secs), seconds_min=secs[len(secs) // 10],
                             seconds_max=secs[(9 * len(secs)) // 10]))
        return out


def _jsonl(path: Path) -> list[Any]:
    try:
        return [loads_json(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise RunDataError(f"{path}: {exc.strerror or exc}; pass the output directory of a finished `dora apply` "
                           "run (it writes engine_steps.jsonl, metrics.jsonl and trace.jsonl)") from None
    except ValueError as exc:
        raise RunDataError(f"{path}: not JSON lines ({exc})") from None


def read_run(run_dir: Path, into: RunTimings) -> None:
    """Add one run directory's measurements to ``into``."""
    steps = _jsonl(run_dir / "engine_steps.jsonl")
    metrics = _jsonl(run_dir / "metrics.jsonl")
    trace = _jsonl(run_dir / "trace.jsonl")
    if not steps or "columns" not in steps[0]:
        raise RunDataError(f"{run_dir / 'engine_steps.jsonl'}: no header line; was it written by `dora apply`?")
    cols = steps[0]["columns"]
    need = ["worker", "start_s", "duration_s", "kind", "decode_rows", "context_tokens", "versions", "prefill_tokens"]
    if cols != need:
        raise RunDataError(f"{run_dir / 'engine_steps.jsonl'}: columns {cols}, expected {need}")
    missing = [m.get("step", "?") for m in metrics if "forward_sum_sq_tokens" not in m]
    if missing:
        raise RunDataError(f"{run_dir / 'metrics.jsonl'}: steps {missing[:3]} lack forward_sum_sq_tokens (written "
                           "by an older dora); re-run the job")
    into.runs.append(str(run_dir))
    spans = sorted((m["start_s"], m["end_s"]) for m in metrics)
    starts = [s for s, _ in spans]
    busy_in: dict[int, float] = defaultdict(float)
    """training step index -> engine-step seconds inside its span."""

    def training_at(t0: float, t1: float) -> int | None:
        i = bisect.bisect_right(starts, t1) - 1
        return i if i >= 0 and spans[i][1] > t0 else None

    engine_spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    """worker -> its steps' (start, end), in start order (an engine runs one step at a time)."""
    for worker, start, dur, kind, *_ in steps[1:]:
        if kind != "load":
            engine_spans[worker].append((start, start + dur))
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

    for worker, start, dur, kind, rows, ctx, versions, prefill in steps[1:]:
        if kind == "load":
            continue
        i = training_at(start, start + dur)
        if i is not None:
            busy_in[i] += min(start + dur, spans[i][1]) - max(start, spans[i][0])
        if prefill:
            into.prefill_steps += 1
            continue
        if rows == 0:
            continue
        shared = len(engine_spans) > 1 and others_busy(worker, start, start + dur) >= 0.5 * dur
        if versions > 1:
            into.multi.append((rows, ctx, versions, i is not None, shared, dur))
        elif i is not None:
            into.decode_contended.append((rows, ctx, shared, dur))
        elif shared:
            into.decode_engines.append((rows, ctx, dur))
        else:
            into.decode_alone[(rows, round(ctx / rows / CONTEXT_BUCKET))].append((ctx, dur))
    for m in metrics:
        i = bisect.bisect_left(starts, m["start_s"])
        span = m["end_s"] - m["start_s"]
        point = Point(kind="train", x={"tokens": m["forward_tokens"], "sum_sq_seq_len": m["forward_sum_sq_tokens"],
                                       "num_seqs": m["num_sequences"], "dp": m.get("train_threads", 1)},
                      seconds=span, seconds_min=span, seconds_max=span)
        (into.train_contended if busy_in.get(i, 0.0) >= 0.5 * span else into.train_alone).append(point)
    load_started: dict[tuple[int, int], float] = {}
    for e in trace:
        kind = e.get("type")
        if kind == "weights_load_started":
            load_started[(e["rollout_group"], e["version"])] = e["t"]
        elif kind == "weights_loaded" and (e["rollout_group"], e["version"]) in load_started:
            t0, worker = load_started.pop((e["rollout_group"], e["version"])), e["rollout_group"]
            st = engine_starts.get(worker, [])
            if bisect.bisect_right(st, e["t"]) == bisect.bisect_left(st, t0):  # no step started meanwhile
                into.loads.append(e["t"] - t0)
    ends = {e["step"]: e["t"] for e in trace if e.get("type") == "train_step"}
    for e in trace:
        if e.get("type") == "weights_published" and e["version"] in ends:
            secs = e["t"] - ends[e["version"]]
            into.publish.append(Point(kind="publish", x={"version": e["version"]}, seconds=secs, seconds_min=secs,
                                      seconds_max=secs))


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
    calib = base.with_overrides(**_rounded(fits[0].constants))
    alone = _rollout_model(ctx, calib)
    engine_f = calib.cpu_engine_contention or 1.0
    if len(data.decode_engines) >= MIN_POINTS:
        predicted = [alone.decode_step_s(b, c) for b, c, _ in data.decode_engines]
        engine_f = max(1.0, sum(s for *_, s in data.decode_engines) / sum(predicted))
        fits.append(Fit(kind="engines", constants={"cpu_engine_contention": engine_f},
                        residuals=tuple(s / p / engine_f - 1
                                        for (*_, s), p in zip(data.decode_engines, predicted, strict=True))))
        calib = calib.with_overrides(**_rounded(fits[-1].constants))
        engine_f = calib.cpu_engine_contention or 1.0
    contended = [s / (engine_f if shared else 1.0) for _, _, shared, s in data.decode_contended]
    predicted = [alone.decode_step_s(b, c) for b, c, _, _ in data.decode_contended]
    rollout_f = max(1.0, sum(contended) / sum(predicted))
    ratios = [s / p for s, p in zip(contended, predicted, strict=True)]
    train_fit = fit_train(data.train_alone, ctx, calib)
    calib = calib.with_overrides(**_rounded(train_fit.constants))
    train_pred = [_train_seconds(ctx, calib, p) for p in data.train_contended]
    train_f = max(1.0, sum(p.seconds for p in data.train_contended) / sum(train_pred))
    train_ratios = [p.seconds / q for p, q in zip(data.train_contended, train_pred, strict=True)]
    fits.append(Fit(kind="contention", constants={"cpu_rollout_contention": rollout_f, "cpu_train_contention": train_f},
                    residuals=tuple([r / rollout_f - 1 for r in ratios] + [r / train_f - 1 for r in train_ratios])))
    calib = calib.with_overrides(**_rounded(fits[-1].constants))
    if data.multi:
        weight_read = alone.nonexpert_weight_bytes_per_device / alone.memory_rate_bytes_per_s
        excess = [s / (rollout_f if during else 1.0) / (engine_f if shared else 1.0) - alone.decode_step_s(b, c)
                  for b, c, v, during, shared, s in data.multi]
        extra = max(0.0, sum(excess) / sum(v - 1 for _, _, v, *_ in data.multi) - weight_read)
        extras = [e / (v - 1) - weight_read for e, (_, _, v, *_) in zip(excess, data.multi, strict=True)]
        fits.append(Fit(kind="versions", constants={"cpu_extra_version_step_s": extra},
                        residuals=tuple((e - extra) / (alone.decode_step_s(b, c) + extra)
                                        for e, (b, c, *_) in zip(extras, data.multi, strict=True))))
        calib = calib.with_overrides(**_rounded(fits[-1].constants))
    fits.append(train_fit)
    if data.publish and data.loads:
        fits.append(fit_weights(data.publish, data.loads, ctx, calib))
        calib = calib.with_overrides(**_rounded(fits[-1].constants))
    fitted = {k: float(f"{v:.6g}") for f in fits for k, v in f.constants.items()}
    return base.with_overrides(source=source, **fitted), fits


def fit_weights(publish: Sequence[Point], loads: Sequence[float], ctx: ModelContext, calib: Calibration) -> Fit:
    """(cpu_weight_publish_fixed_s, cpu_weight_reload_fixed_s): the measured medians beyond the formula's
    trainer-side (gather, convert) and engine-side (transfer, buckets, per-tensor reload) terms."""
    from planner.sim.costmodel import cost_model_timing

    def timing(cal: Calibration) -> Any:
        return cost_model_timing(ctx.arch, rollout_acc=ctx.accelerator, train_acc=ctx.accelerator, rollout_tp=1,
                                 num_rollout_groups=1, train_tp=1, train_pp=1, train_dp=1, dtype_bytes=ctx.dtype_bytes,
                                 rollout_weight_bytes=ctx.rollout_weight_bytes,
                                 micro_batch_tokens=ctx.micro_batch_tokens, calib=cal,
                                 accelerators_per_node=ctx.accelerators_per_node)

    zero = timing(calib.with_overrides(cpu_weight_publish_fixed_s=0.0, cpu_weight_reload_fixed_s=0.0))
    pub = max(0.0, statistics.fmean(p.seconds for p in publish) - zero.weight_publish_s)
    load = max(0.0, statistics.fmean(loads) - zero.weight_load_trainer_s)
    final = timing(calib.with_overrides(cpu_weight_publish_fixed_s=pub, cpu_weight_reload_fixed_s=load))
    return Fit(kind="weights", constants={"cpu_weight_publish_fixed_s": pub, "cpu_weight_reload_fixed_s": load},
               residuals=tuple([final.weight_publish_s / p.seconds - 1 for p in publish]
                               + [final.weight_load_trainer_s / y - 1 for y in loads if y > 0]))


def _rounded(constants: dict[str, float]) -> dict[str, float]:
    return {k: float(f"{v:.6g}") for k, v in constants.items()}


def points_of(data: RunTimings) -> list[Point]:
    """The measurements the calibration file records: decode cells, training steps (alone, then contended),
    publishes."""
    contended = [Point(kind="train_contended", x=p.x, seconds=p.seconds, seconds_min=p.seconds_min,
                       seconds_max=p.seconds_max) for p in data.train_contended]
    return [*data.decode_points(), *data.train_alone, *contended, *data.publish]
