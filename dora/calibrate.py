"""`dora calibrate SPEC`: measure the engines a local spec runs, fit the cost model's constants, write the file.

Four micro-benchmarks on the real torch CPU engines, built exactly as the runtime builds them
(`dora.runtime.driver.controller_config`: same model shape, same vocabulary, one torch thread per engine, the
trainer's threads):

    decode   `TorchRolloutEngine.step()` with B resident sequences of context C (no EOS, so B stays fixed)
    prefill  the first step of the same engine: B prompts of C tokens (P = B*C tokens, S2 = B*C^2)
    train    `TorchTrainer.train_step` on packed GRPO batches of n sequences of (prompt + response) tokens
    publish  trainer export -> pickle round trip (what Ray's object store does) -> `model_from_weights`

Each point is fitted with the cost model's *own* formula, so that the planner reproduces the measurements
(`planner.rollout_cost`, `planner.train_cost`, `planner.sim.costmodel` on the `cpu` accelerator):

    decode   t(B, C) = max(bytes / (eta_mem BW), flops / (eta_c F)) + t_step
             grid over (eta_mem, eta_c) in [1e-3, 1], t_step in closed form, minimising sum ((t - y) / y)^2
    prefill  t(P, S2) = max(bytes / (eta_mem BW), flops / (eta_pre F)) + t_step    (1-D grid over eta_pre)
    train    t(T, S2) = C(T, S2) / eta_train + R(T) + t_train    (C: compute at eta = 1, R: optimizer, comm);
             weighted linear least squares in (1 / eta_train, t_train), weights 1 / y; where that gives
             eta_train > 1, eta_train = 1 and t_train is refitted alone (the weighted mean of y - C - R, >= 0)
    publish  t = gather + convert + transfer + reload(reload_fixed = 0) + reload_fixed
             ->   reload_fixed = median(y) - model
             (the terms of what the benchmark times: the trainer's export, one serialisation round trip of the whole
             state dict, the engine's model build. Left out: `cpu_weight_publish_fixed_s`, the checkpoint and
             object-store put of a real run's publish, which only `--from-run` fits and which keeps its value in
             the file; and `weight_sync_bucket_overhead_s`, a collective per bucket, which the benchmark does not
             make. On local-tiny the two were 15.6 ms and 2 ms against a ~2.8 ms publish: reload_fixed clamped to 0
             and the residual read 600%.)

`dora calibrate SPEC --from-run SYNC_RUN --from-run ASYNC_RUN` fits the same constants, plus the contention of
rollout and trainer on one host, to what real `dora apply` runs recorded instead (`dora.calibrate_run`): the
engines alone run ~1.3-1.9x faster than inside a run on 2 shared cores.
`dora calibrate SPEC --in-situ [--steps N] [--runs-dir DIR]` makes those runs first (``run_in_situ``: a sync run
with one engine, a sync run colocated with an engine per core, a streaming run, N steps each, 40 by default), then
fits to them: one command for the fit that predicts runs of this machine.

The file (sorted JSON, no timestamps) holds the fitted `Calibration` under "calibration" (what `dora plan
--calibration FILE` reads), every measured point, each fit's residuals, and the machine description.
Exit codes: 0 written; 2 invalid spec or a spec whose engines cannot be measured here; 1 any other failure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pickle
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dora.terminal import error, make_console, say
from planner.calibration import DEFAULT_CALIBRATION, Calibration

FORMAT = "dora-calibration/1"
EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


@dataclass(frozen=True, kw_only=True)
class Grid:
    """What to measure; `quick()` is a smaller grid for tests and smoke runs."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (8, 32, 64, 128)
    decode_steps: int = 12
    """Decode steps timed per (batch, context) cell and repeat (after the prefill step)."""
    repeats: int = 3
    """Repeats of every cell, interleaved over the cells (so a noisy neighbour hits all cells alike)."""
    train_batches: tuple[tuple[int, int], ...] = ((8, 8), (32, 8), (32, 32), (16, 128), (32, 96), (64, 64))
    """(sequences, response tokens) per training batch."""
    train_repeats: int = 4
    publish_repeats: int = 10

    @classmethod
    def quick(cls) -> Grid:
        return cls(decode_batches=(1, 8, 32), decode_contexts=(8, 64), decode_steps=6, repeats=2,
                   train_batches=((8, 8), (16, 32), (16, 64)), train_repeats=2, publish_repeats=4)


@dataclass(frozen=True, kw_only=True)
class Point:
    """One measured configuration: its inputs (`x`, named as the cost model's arguments) and seconds."""

    kind: str
    x: dict[str, float]
    seconds: float
    """Micro-benchmarks: median over repeats (decode: over all timed steps of all repeats). In situ
    (`dora.calibrate_run`): a decode cell's mean step; a training step's or publish's own duration."""
    seconds_min: float
    seconds_max: float
    """The spread the machine's noise put on this point. Micro-benchmarks: min / max of the per-repeat medians (a
    training point: of its repeats); in situ: min / max of a decode cell's steps (the duration itself for the other
    kinds)."""


@dataclass(frozen=True, kw_only=True)
class Fit:
    """Fitted constants of one micro-benchmark and the relative residuals (prediction / measurement - 1)."""

    kind: str
    constants: dict[str, float]
    residuals: tuple[float, ...]

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(r) for r in self.residuals) if self.residuals else 0.0

    @property
    def max_abs_error(self) -> float:
        return max((abs(r) for r in self.residuals), default=0.0)


# ----- measurement ----------------------------------------------------------------------------------------------
def _median_spread(per_repeat: list[list[float]]) -> tuple[float, float, float]:
    medians = [statistics.median(r) for r in per_repeat]
    return statistics.median(x for r in per_repeat for x in r), min(medians), max(medians)


def measure_rollout(rollout_config: Any, weights: dict[str, Any], grid: Grid) -> tuple[list[Point], list[Point]]:
    """(decode points, prefill points) from the real engine: B requests with C-token prompts per cell."""
    import torch

    from dora.runtime.engines.base import GenerationRequest
    from dora.runtime.engines.torch_rollout import TorchRolloutEngine

    vocab = rollout_config.model.vocab_size
    cells = [(b, c) for b in grid.decode_batches for c in grid.decode_contexts]
    decode: dict[tuple[int, int], list[list[float]]] = {cell: [] for cell in cells}
    prefill: dict[tuple[int, int], list[list[float]]] = {cell: [] for cell in cells}
    for rep in range(grid.repeats):
        for b, c in cells:
            # eos_token_id=-1 is never sampled: every sequence stays resident, so the batch stays B.
            cfg = dataclasses.replace(rollout_config, eos_token_id=-1, max_num_seqs=b,
                                      max_model_len=c + grid.decode_steps + 2)
            engine = TorchRolloutEngine(cfg)
            engine.load_weights(0, weights)
            gen = torch.Generator().manual_seed(1000 * rep + b * 7 + c)
            for i in range(b):
                prompt = tuple(torch.randint(0, vocab, (c,), generator=gen).tolist())
                engine.add_request(GenerationRequest(request_id=str(i), prompt_ids=prompt, version=0,
                                                     max_new_tokens=10 * grid.decode_steps, temperature=1.0, seed=i))
            start = time.perf_counter()
            engine.step()  # admits and prefills every request (nothing decodes yet)
            prefill[(b, c)].append([time.perf_counter() - start])
            samples = []
            for _ in range(grid.decode_steps):
                start = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - start)
            decode[(b, c)].append(samples)
    dec, pre = [], []
    for b, c in cells:
        med, lo, hi = _median_spread(decode[(b, c)])
        # Step i attends to c + i cached positions per sequence; the mean over the timed steps.
        ctx = b * (c + (grid.decode_steps + 1) / 2)
        dec.append(Point(kind="decode", x={"batch_size": b, "total_context_tokens": ctx}, seconds=med,
                         seconds_min=lo, seconds_max=hi))
        med, lo, hi = _median_spread(prefill[(b, c)])
        pre.append(Point(kind="prefill", x={"num_tokens": b * c, "sum_sq_tokens": b * c * c}, seconds=med,
                         seconds_min=lo, seconds_max=hi))
    return dec, pre


def measure_train(trainer_config: Any, prompt_tokens: int, grid: Grid) -> list[Point]:
    """Packed GRPO steps of the real trainer at several (sequences, response tokens) sizes."""
    import torch

    from dora.runtime.engines.base import FinishedTrajectory, ScoredTrajectory
    from dora.runtime.engines.torch_trainer import TorchTrainer

    vocab = trainer_config.model.vocab_size
    points = []
    for n, resp in grid.train_batches:
        gen = torch.Generator().manual_seed(n * 1000 + resp)
        batch = []
        for i in range(n):
            prompt = tuple(torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist())
            response = tuple(torch.randint(0, vocab, (resp,), generator=gen).tolist())
            traj = FinishedTrajectory(request_id=str(i), prompt_ids=prompt, response_ids=response,
                                      behaviour_logprobs=tuple([-math.log(vocab)] * resp),
                                      version_spans=((0, resp),), finish_reason="stop")
            batch.append(ScoredTrajectory(trajectory=traj, reward=float(i % 3 == 0), group_id=str(i // 4)))
        trainer = TorchTrainer(trainer_config)
        trainer.train_step(batch)  # warm the allocator and autograd
        times = [trainer.train_step(batch).train_time_s for _ in range(grid.train_repeats)]
        seq = prompt_tokens + resp
        points.append(Point(kind="train", x={"tokens": n * seq, "sum_sq_seq_len": n * seq * seq, "num_seqs": n,
                                             "dp": trainer_config.num_threads},
                            seconds=statistics.median(times), seconds_min=min(times), seconds_max=max(times)))
    return points


def measure_publish(model_config: Any, trainer_config: Any, grid: Grid) -> list[Point]:
    """Trainer export + serialisation round trip + the engine's model build (one new version)."""
    from dora.runtime.engines.tiny_model import model_from_weights
    from dora.runtime.engines.torch_trainer import TorchTrainer

    trainer = TorchTrainer(trainer_config)
    times = []
    for _ in range(grid.publish_repeats + 1):
        start = time.perf_counter()
        _, weights = trainer.export_weights()
        received = pickle.loads(pickle.dumps(weights, protocol=5))
        model_from_weights(model_config, received)
        times.append(time.perf_counter() - start)
    times = times[1:]
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return [Point(kind="publish", x={"bytes": nbytes, "tensors": len(weights)}, seconds=statistics.median(times),
                  seconds_min=min(times), seconds_max=max(times))]


# ----- fitting on the cost model's own formulas -----------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelContext:
    """What the planner passes to the cost formulas for this spec (taken from `dora.planning.search_inputs`)."""

    arch: Any
    accelerator: Any
    dtype_bytes: float
    rollout_weight_bytes: float
    extra_forward_passes: int
    optimizer_steps: int
    micro_batch_tokens: int
    accelerators_per_node: int


def _rollout_model(ctx: ModelContext, calib: Calibration) -> Any:
    from planner.rollout_cost import make_rollout_cost_model

    return make_rollout_cost_model(ctx.arch, ctx.accelerator, tp=1, dtype_bytes=ctx.dtype_bytes,
                                   weight_dtype_bytes=ctx.rollout_weight_bytes, calib=calib,
                                   accelerators_per_node=ctx.accelerators_per_node)


def _rel_loss(pred: Sequence[float], meas: Sequence[float]) -> float:
    return sum(((p - y) / y) ** 2 for p, y in zip(pred, meas, strict=True))


def _geometric(lo: float, hi: float, n: int) -> list[float]:
    """n values from hi down to lo, evenly spaced in log (high first: ties go to the higher efficiency)."""
    return [hi * (lo / hi) ** (i / (n - 1)) for i in range(n)]


def _best_offset(roof: Sequence[float], meas: Sequence[float]) -> float:
    """t0 >= 0 minimising sum ((roof + t0 - y) / y)^2: t0 = sum((y - r) / y^2) / sum(1 / y^2)."""
    num = sum((y - r) / (y * y) for r, y in zip(roof, meas, strict=True))
    return max(0.0, num / sum(1 / (y * y) for y in meas))


def fit_decode(points: Sequence[Point], ctx: ModelContext, base: Calibration) -> Fit:
    """(cpu_memory_efficiency, cpu_compute_efficiency, cpu_step_overhead_s) for `decode_step_s`."""
    meas = [p.seconds for p in points]

    def roofs(eta_m: float, eta_c: float) -> list[float]:
        cal = base.with_overrides(cpu_memory_efficiency=eta_m, cpu_compute_efficiency=eta_c, cpu_step_overhead_s=0.0)
        model = _rollout_model(ctx, cal)
        return [model.decode_step_s(int(p.x["batch_size"]), p.x["total_context_tokens"]) for p in points]

    def search(mems: list[float], comps: list[float], best: tuple[float, float, float, float] | None):
        for eta_m in mems:
            for eta_c in comps:
                r = roofs(eta_m, eta_c)
                t0 = _best_offset(r, meas)
                loss = _rel_loss([x + t0 for x in r], meas)
                if best is None or loss < best[0] * (1 - 1e-9):
                    best = (loss, eta_m, eta_c, t0)
        return best

    best = search(_geometric(1e-3, 1.0, 31), _geometric(1e-3, 1.0, 31), None)
    for step in (1.1, 1.01):  # two refinements around the best cell: the grid's resolution ends near 1%
        _, m0, c0, _ = best
        refine = [step ** k for k in range(5, -6, -1)]
        best = search([min(1.0, m0 * f) for f in refine], [min(1.0, c0 * f) for f in refine], best)
    _, eta_m, eta_c, t0 = best
    pred = [x + t0 for x in roofs(eta_m, eta_c)]
    return Fit(kind="decode", constants={"cpu_memory_efficiency": eta_m, "cpu_compute_efficiency": eta_c,
                                         "cpu_step_overhead_s": t0},
               residuals=tuple(p / y - 1 for p, y in zip(pred, meas, strict=True)))


def fit_prefill(points: Sequence[Point], ctx: ModelContext, calib: Calibration) -> Fit:
    """cpu_prefill_compute_efficiency for `prefill_s`, with the decode fit's memory rate and step overhead."""
    meas = [p.seconds for p in points]

    def predict(eta: float) -> list[float]:
        model = _rollout_model(ctx, calib.with_overrides(cpu_prefill_compute_efficiency=eta))
        return [model.prefill_s(int(p.x["num_tokens"]), p.x["sum_sq_tokens"]) for p in points]

    grid = _geometric(1e-3, 1.0, 61)
    eta = min(grid, key=lambda e: _rel_loss(predict(e), meas))
    fine = [min(1.0, eta * 1.05 ** k) for k in range(4, -5, -1)]
    eta = min(fine, key=lambda e: _rel_loss(predict(e), meas))
    return Fit(kind="prefill", constants={"cpu_prefill_compute_efficiency": eta},
               residuals=tuple(p / y - 1 for p, y in zip(predict(eta), meas, strict=True)))


def _train_seconds(ctx: ModelContext, calib: Calibration, p: Point) -> float:
    from planner.train_cost import TrainCostModel

    model = TrainCostModel(arch=ctx.arch, acc=ctx.accelerator, tp=1, pp=1, dp=int(p.x.get("dp", 1)),
                           micro_batch_tokens=ctx.micro_batch_tokens, extra_forward_passes=ctx.extra_forward_passes,
                           optimizer_steps=ctx.optimizer_steps, dtype_bytes=ctx.dtype_bytes, calib=calib,
                           accelerators_per_node=ctx.accelerators_per_node)
    return model.train_step_s(int(p.x["tokens"]), p.x["sum_sq_seq_len"], int(p.x["num_seqs"]))


def _train_parts(ctx: ModelContext, calib: Calibration, points: Sequence[Point]) -> tuple[list[float], list[float]]:
    """(C, R) per point: the formula's compute term at eta = 1 and the rest, with zero overhead (the step is
    C/eta + R + t_train, evaluated at eta = 1 and eta = 1/2)."""
    at1 = [_train_seconds(ctx, calib.with_overrides(cpu_train_compute_efficiency=1.0,
                                                    cpu_train_step_overhead_s=0.0), p) for p in points]
    at2 = [_train_seconds(ctx, calib.with_overrides(cpu_train_compute_efficiency=0.5,
                                                    cpu_train_step_overhead_s=0.0), p) for p in points]
    comp = [b - a for a, b in zip(at1, at2, strict=True)]
    return comp, [a - c for a, c in zip(at1, comp, strict=True)]


def _slope(xs: Sequence[float], zs: Sequence[float], ys: Sequence[float]) -> float:
    """min over a of sum w (a*x - z)^2, with relative weights w = 1/y^2 (y: the measured seconds)."""
    return (sum(x * z / (y * y) for x, z, y in zip(xs, zs, ys, strict=True))
            / sum(x * x / (y * y) for x, y in zip(xs, ys, strict=True)))


TRAIN_COMPUTE_KEY = "compute_s"
"""In-situ training points (`dora.calibrate_run`) carry the trainer's own time for the step in ``x`` under this key
(``train_time_s`` of metrics.jsonl); their seconds are the step's span on the controller's clock."""


def fit_train_split(points: Sequence[Point], ctx: ModelContext, calib: Calibration) -> Fit:
    """The training fit for steps measured twice: their span (``seconds``) and the trainer's own time
    (``x[TRAIN_COMPUTE_KEY]``). Every step of a run trains about as many tokens, so a span alone cannot tell a fixed
    cost from a proportional one (a fit of both put everything in the proportional term), and the fixed part (the
    Ray call, the batch, the checkpoint the step saves) does not speed up on more threads. So:

    - cpu_train_step_overhead_s = the weighted mean of span - trainer time (>= 0);
    - cpu_train_compute_efficiency from the trainer times of one-thread steps: C/eta + R through the origin;
    - cpu_train_parallel_efficiency, when steps ran on n > 1 threads too: their trainer times against
      C/(eta n e) + R, through the origin in 1/e (at most 1). Without such steps it keeps ``calib``'s value, and
      without one-thread steps the efficiency is fitted on the n-thread steps with ``calib``'s e."""
    spans = [p.seconds for p in points]
    inner = [p.x[TRAIN_COMPUTE_KEY] for p in points]
    w = [1 / (y * y) for y in spans]
    overhead = max(0.0, sum(wi * (y - c) for wi, y, c in zip(w, spans, inner, strict=True)) / sum(w))
    one = [i for i, p in enumerate(points) if int(p.x.get("dp", 1)) == 1]
    many = [i for i, p in enumerate(points) if int(p.x.get("dp", 1)) > 1]
    constants: dict[str, float] = {"cpu_train_step_overhead_s": overhead}
    first = one or many  # n-thread steps only: eta under calib's e
    comp, rest = _train_parts(ctx, calib, [points[i] for i in first])
    a = max(1.0, _slope(comp, [inner[i] - r for i, r in zip(first, rest, strict=True)], [inner[i] for i in first]))
    constants["cpu_train_compute_efficiency"] = 1 / a
    if one and many:
        ideal = calib.with_overrides(cpu_train_parallel_efficiency=1.0)
        comp_n, rest_n = _train_parts(ctx, ideal, [points[i] for i in many])
        inv = _slope([a * c for c in comp_n], [inner[i] - r for i, r in zip(many, rest_n, strict=True)],
                     [inner[i] for i in many])
        constants["cpu_train_parallel_efficiency"] = min(1.0, 1 / inv) if inv > 0 else 1.0
    final = calib.with_overrides(**constants)
    pred = [_train_seconds(ctx, final, p) for p in points]
    return Fit(kind="train", constants=constants,
               residuals=tuple(q / y - 1 for q, y in zip(pred, spans, strict=True)))


def fit_train(points: Sequence[Point], ctx: ModelContext, calib: Calibration) -> Fit:
    """(cpu_train_compute_efficiency, cpu_train_step_overhead_s): the step is C/eta + R + t_train, linear in
    (1/eta, t_train); C and R come from evaluating the formula at eta = 1 and eta = 1/2 with zero overhead.
    Points that also carry the trainer's own time (in-situ steps) are fitted by ``fit_train_split``."""
    if points and all(TRAIN_COMPUTE_KEY in p.x for p in points):
        return fit_train_split(points, ctx, calib)
    meas = [p.seconds for p in points]
    comp, rest = _train_parts(ctx, calib, points)
    target = [y - r for y, r in zip(meas, rest, strict=True)]
    w = [1 / (y * y) for y in meas]  # relative error weights
    # Normal equations of min sum w (a*C + b - z)^2 over (a, b).
    scc = sum(wi * c * c for wi, c in zip(w, comp, strict=True))
    sc1 = sum(wi * c for wi, c in zip(w, comp, strict=True))
    s11 = sum(w)
    scz = sum(wi * c * z for wi, c, z in zip(w, comp, target, strict=True))
    s1z = sum(wi * z for wi, z in zip(w, target, strict=True))
    det = scc * s11 - sc1 * sc1
    a, b = ((scz * s11 - sc1 * s1z) / det, (scc * s1z - sc1 * scz) / det) if det > 0 else (0.0, -1.0)
    if b < 0 or a <= 0:  # overhead must be >= 0: refit the slope alone through t_train = 0
        b = 0.0
        a = scz / scc
    if a < 1.0:  # eta <= 1. The overhead fitted beside the steeper slope is not the best one at eta = 1: refit it
        a = 1.0  # under the same loss, min over b >= 0 of sum w (C + b - z)^2: the weighted mean of z - C
        b = max(0.0, sum(wi * (z - c) for wi, c, z in zip(w, comp, target, strict=True)) / s11)
    eta = 1 / a
    pred = [a * c + r + b for c, r in zip(comp, rest, strict=True)]
    return Fit(kind="train", constants={"cpu_train_compute_efficiency": eta, "cpu_train_step_overhead_s": b},
               residuals=tuple(p / y - 1 for p, y in zip(pred, meas, strict=True)))


def fit_publish(points: Sequence[Point], ctx: ModelContext, calib: Calibration) -> Fit:
    """cpu_weight_reload_fixed_s: what the measured publish costs beyond the transfer terms of the formula.

    `measure_publish` times the trainer's export, one serialisation round trip of the state dict and the engine's
    model build, so the prediction is the formula's terms for those: gather + convert (trainer side), transfer and
    reload (engine side). It leaves out what the benchmark does not do: `cpu_weight_publish_fixed_s`, what a real run's
    publish adds (checkpoint, object-store put; fitted in situ by `--from-run`, it keeps ``calib``'s value), and the
    per-bucket collective (`weight_sync_bucket_overhead_s`: the benchmark sends one object, with no collective)."""
    from planner.sim.costmodel import cost_model_timing

    def predicted(cal: Calibration) -> float:
        t = cost_model_timing(ctx.arch, rollout_acc=ctx.accelerator, train_acc=ctx.accelerator, rollout_tp=1,
                              num_rollout_groups=1, train_tp=1, train_pp=1, train_dp=1, dtype_bytes=ctx.dtype_bytes,
                              rollout_weight_bytes=ctx.rollout_weight_bytes,
                              micro_batch_tokens=ctx.micro_batch_tokens,
                              calib=cal.with_overrides(cpu_weight_publish_fixed_s=0.0,
                                                       weight_sync_bucket_overhead_s=0.0),
                              accelerators_per_node=ctx.accelerators_per_node)
        return t.weight_publish_s + t.weight_load_trainer_s

    base = predicted(calib.with_overrides(cpu_weight_reload_fixed_s=0.0))
    fixed = max(0.0, statistics.median(p.seconds for p in points) - base)
    final = predicted(calib.with_overrides(cpu_weight_reload_fixed_s=fixed))
    return Fit(kind="publish", constants={"cpu_weight_reload_fixed_s": fixed},
               residuals=tuple(final / p.seconds - 1 for p in points))


def fit_all(decode: Sequence[Point], prefill: Sequence[Point], train: Sequence[Point], publish: Sequence[Point],
            ctx: ModelContext, base: Calibration, source: str) -> tuple[Calibration, list[Fit]]:
    """Fit in dependency order (prefill reuses decode's memory rate and step overhead) into one Calibration."""
    fits = [fit_decode(decode, ctx, base)]
    calib = base.with_overrides(**fits[0].constants)
    for fitter, points in ((fit_prefill, prefill), (fit_train, train), (fit_publish, publish)):
        fit = fitter(points, ctx, calib)
        calib = calib.with_overrides(**fit.constants)
        fits.append(fit)
    # Rounded as the file stores them, so the file loads back to exactly this Calibration (same fingerprint).
    fitted = {k: float(f"{v:.6g}") for f in fits for k, v in f.constants.items()}
    return base.with_overrides(source=source, **fitted), fits


# ----- the command ----------------------------------------------------------------------------------------------
def machine_description() -> dict[str, Any]:
    """CPU model, core count, OS and library versions: what the calibration is valid for."""
    import torch

    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": model, "cpu_count": os.cpu_count() or 1, "machine": platform.machine(),
            "system": platform.system(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads_per_actor": 1}


MACHINE_KEYS = ("cpu_model", "cpu_count", "machine", "system")
"""What makes timings another machine's (the library versions, which also differ between runs, are only recorded)."""


def _machine_label(machine: dict[str, Any]) -> str:
    return f"{machine.get('cpu_model', 'unknown CPU')}, {machine.get('cpu_count', '?')} cores"


def runs_machine(machines: dict[str, dict[str, Any] | None],
                 here: dict[str, Any]) -> tuple[dict[str, Any], bool, list[str], list[str]]:
    """The machine a `--from-run` calibration is of: (the first run's record, or ``here`` when no run has one;
    whether it is a run's record; notes; warnings). ``machines``: each run's record (None: an older dora's run,
    which records none). It warns when the runs ran on different machines, or on another than this host."""
    def key(m: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(m.get(k) for k in MACHINE_KEYS)

    recorded = {run: m for run, m in machines.items() if m is not None}
    unrecorded = [run for run, m in machines.items() if m is None]
    older = "made by a dora that did not record it in summary.json"
    if not recorded:
        return here, False, [f"the runs record no machine ({older}): the file names this host ({_machine_label(here)}),"
                             " where they are taken to have run"], []
    first, machine = next(iter(recorded.items()))
    notes = [f"{', '.join(unrecorded)} record{'s' if len(unrecorded) == 1 else ''} no machine ({older}): taken to have "
             f"run where {first} did ({_machine_label(machine)})"] if unrecorded else []
    warnings = []
    if len({key(m) for m in recorded.values()}) > 1:
        warnings.append("the runs ran on different machines (" + "; ".join(f"{run}: {_machine_label(m)}" for run, m
                                                                           in recorded.items())
                        + "): their timings are fitted together and the file names the first's; to fix: calibrate "
                          "from runs made on one machine")
    elsewhere = [run for run, m in recorded.items() if key(m) != key(here)]
    if elsewhere:
        warnings.append(f"{', '.join(elsewhere)} ran on another machine than this host ({_machine_label(here)}): the "
                        "file names the runs' machine; its constants describe that machine, not this one")
    return machine, True, notes, warnings


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round(v) for v in value]
    return value


def calibration_document(calib: Calibration, fits: Sequence[Fit], points: Sequence[Point],
                         machine: dict[str, Any], spec_name: str, spec_hash: str) -> str:
    """The file's text: sorted keys, 6 significant digits, no timestamps (same inputs -> same bytes)."""
    doc = {
        "format": FORMAT,
        "spec": {"name": spec_name, "hash": spec_hash},
        "machine": machine,
        "measurements": [dataclasses.asdict(p) for p in points],
        "fits": [{"kind": f.kind, "constants": f.constants, "residuals": list(f.residuals),
                  "median_abs_error": f.median_abs_error, "max_abs_error": f.max_abs_error} for f in fits],
    }
    doc = {**_round(doc), "calibration": calib.to_dict()}  # exact: the fitted values are already rounded
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def run_calibrate(spec_path: str, out_path: str, console: Any = None, *, quick: bool = False,
                  grid: Grid | None = None, from_runs: Sequence[str] = (), in_situ: bool = False,
                  steps: int | None = None, runs_dir: str | None = None) -> int:
    """Implementation of `dora calibrate SPEC --out FILE [--quick | --from-run RUN ... | --in-situ]`: returns the
    exit code, never raises on bad input. ``in_situ``: run the spec here first, ``steps`` steps a run
    (``run_in_situ``, into ``runs_dir``), and fit to those runs."""
    from dora.apply import ApplyOverrides, runtime_config_for
    from dora.planning import search_inputs
    from dora.runtime.config import RuntimeConfigError
    from dora.runtime.driver import controller_config
    from dora.spec import SpecError, load_spec

    console = console or make_console(stderr=True, highlight=False)
    if from_runs and (quick or grid is not None):
        error(console, "--quick and --from-run do not go together: --quick runs a smaller grid of micro-benchmarks, "
                       "--from-run fits to finished runs instead of running any; give one or the other")
        return EXIT_INVALID
    if in_situ and (from_runs or quick or grid is not None):
        error(console, f"--in-situ and {'--from-run' if from_runs else '--quick'} do not go together: --in-situ runs "
                       "the spec here and fits to those runs; give one or the other")
        return EXIT_INVALID
    if not in_situ and (steps is not None or runs_dir is not None):
        flag = "--steps" if steps is not None else "--runs-dir"
        error(console, f"{flag} is for --in-situ (the steps of its runs, where it writes them): add --in-situ, or "
                       "leave the flag out")
        return EXIT_INVALID
    steps = IN_SITU_STEPS if steps is None else steps
    if steps < IN_SITU_MIN_STEPS:
        error(console, f"--steps {steps}: an in-situ run needs at least {IN_SITU_MIN_STEPS} steps (the fits leave out "
                       f"each run's first training steps, the trainer's warm-up); the default is {IN_SITU_STEPS}")
        return EXIT_INVALID
    try:
        resolved = load_spec(spec_path)
    except SpecError as exc:
        from dora.cli import print_spec_error

        print_spec_error(exc)
        return EXIT_INVALID
    spec = resolved.spec
    if spec.cluster.accelerator != "cpu" or spec.runtime.backend != "local":
        error(console, f"{spec_path}: `dora calibrate` measures the local torch engines; this spec runs on "
                       f"{spec.cluster.accelerator!r} with backend {spec.runtime.backend!r}. Calibrate on a local CPU "
                       "spec (e.g. specs/local-tiny.yaml)")
        return EXIT_INVALID
    unwritable = _unwritable(out_path)
    if unwritable:  # before minutes of measuring
        problem, fix = unwritable
        error(console, f"cannot write {out_path}: {problem}\n  to fix: {fix}")
        return EXIT_INVALID
    try:
        rc = runtime_config_for(resolved, ApplyOverrides())
        cc = controller_config(rc)
    except (ValueError, RuntimeConfigError) as exc:
        error(console, f"{spec_path}: cannot build the local engines: {exc}")
        return EXIT_INVALID
    import torch

    from dora.runtime.engines.tiny_model import TinyTransformer, export_weights

    inputs = search_inputs(resolved, DEFAULT_CALIBRATION)
    ctx = ModelContext(arch=inputs.arch, accelerator=inputs.accelerator, dtype_bytes=inputs.dtype_bytes,
                       rollout_weight_bytes=inputs.rollout_weight_bytes,
                       extra_forward_passes=inputs.extra_forward_passes, optimizer_steps=inputs.optimizer_steps,
                       micro_batch_tokens=max(8192, inputs.max_context_tokens),
                       accelerators_per_node=inputs.accelerators_per_node)
    if in_situ:
        where = Path(runs_dir or f"runs/{spec.name}-calibration")
        if (there := [str(where / name) for name, _, _ in IN_SITU_RUNS if (where / name).exists()]):
            error(console, f"{there[0]} exists: --in-situ writes fresh runs, and `dora apply` would resume that one\n"
                           f"  to fix: remove {where}/, or give another --runs-dir")
            return EXIT_INVALID
        made = run_in_situ(spec_path, resolved, where, steps, console)
        if made is None:
            return EXIT_FAILED
        return _calibrate_from_runs(spec_path, out_path, console, resolved, ctx, made, json.loads(rc.to_json()),
                                    copies=made)
    if from_runs:
        return _calibrate_from_runs(spec_path, out_path, console, resolved, ctx, from_runs, json.loads(rc.to_json()))
    if spec.runtime.rollout_engine != "torch":  # the micro-benchmarks time TorchRolloutEngine's steps
        error(console, f"{spec_path}: `dora calibrate` without --from-run times the torch rollout engine's steps, and "
                       f"this spec rolls out with {spec.runtime.rollout_engine}\n  to fix: fit to runs of this spec "
                       "instead: `dora calibrate SPEC --in-situ` runs it here and fits to those runs")
        return EXIT_INVALID
    grid = grid or (Grid.quick() if quick else Grid())
    threads = torch.get_num_threads()
    torch.set_num_threads(cc.rollout.num_threads)  # the runtime's actors run one torch thread each
    try:
        weights = export_weights(TinyTransformer(cc.rollout.model, seed=spec.runtime.seed))
        say(console, f"dora calibrate {spec_path}: decode {len(grid.decode_batches)}x{len(grid.decode_contexts)} "
                     f"cells x {grid.repeats} repeats ...")
        decode, prefill = measure_rollout(cc.rollout, weights, grid)
        console.print(f"  training steps: {len(grid.train_batches)} batch sizes ...", highlight=False)
        train = measure_train(cc.trainer, round(inputs.prompt_lengths.mean_tokens()), grid)
        publish = measure_publish(cc.rollout.model, cc.trainer, grid)
    finally:
        torch.set_num_threads(threads)
    machine = machine_description()
    source = (f"measured: torch CPU engines of {spec.name} ({len(decode)} decode, {len(prefill)} prefill, "
              f"{len(train)} train, {len(publish)} publish points{', quick grid' if quick else ''}) on "
              f"{machine['cpu_model']}, {machine['cpu_count']} cores, 1 torch thread per engine")
    calib, fits = fit_all(decode, prefill, train, publish, ctx, DEFAULT_CALIBRATION, source)
    calib = calib.with_overrides(cpu_rollout_engine="torch")  # the micro-benchmarks time dora's torch engine
    text = calibration_document(calib, fits, [*decode, *prefill, *train, *publish], machine, spec.name,
                                resolved.spec_hash)
    code = _write(console, spec_path, out_path, text, calib, fits)
    if code == EXIT_OK:
        say(console, "note: these micro-benchmarks time each engine alone on an idle machine; a real run shares the "
                     "cores (rollout and trainer slow each other, publishes and loads cost more): `dora calibrate "
                     "SPEC --in-situ` (or `--from-run RUN_DIR ...`) fits those from runs and predicts them better")
    return code


IN_SITU_STEPS = 40
"""Steps of each `--in-situ` run (about 15-25 s each for local-tiny here, warm-up and start-up aside)."""
IN_SITU_MIN_STEPS = 10
"""Fewest steps an `--in-situ` run may take: the fits leave out each run's first 2 training steps (the trainer's
warm-up), a step or two fills the pipeline, and the contention fit needs 3 training steps that overlap rollout (a
6-step streaming run of a small batch had 1 or 2)."""
IN_SITU_RUNS = (("sync", "sync", False), ("sync-colocated", "sync", True), ("streaming", "streaming", False))
"""The runs of `dora calibrate --in-situ`: (output directory's name, mode, whether colocated with one engine per core).
The sync run with the spec's engines (one on a disaggregated local spec) fits the decode constants at every batch
size and the trainer alone; the colocated one decodes on every core side by side (``cpu_engine_contention``) and
trains on every core (``cpu_train_parallel_efficiency``); the streaming run overlaps rollout and training (the
contention of one with the other, the loads, the controller's round trip)."""


def run_in_situ(spec_path: str, resolved: Any, runs_dir: Path, steps: int, console: Any, *, seed_offset: int = 0,
                warmup_pool: Path | None = None) -> list[str] | None:
    """Run the spec here as ``IN_SITU_RUNS`` say, ``steps`` steps each, into ``runs_dir``: the run directories, or
    None when a run failed (its error printed). The colocated run plans a copy of the spec with ``placement.colocated:
    true``, written beside the runs; ``seed_offset`` > 0 runs copies with the spec's seed plus it (a bench that then
    measures runs of the spec's own seed). The trainer's warm-up is computed once and shared through
    ``warmup_pool`` (default: runs_dir/warmup-pool), as its cache file is named by what it holds."""
    import shutil

    from ruamel.yaml import YAML

    from dora.apply import ApplyOverrides, run_apply

    runs_dir.mkdir(parents=True, exist_ok=True)
    pool = warmup_pool or runs_dir / "warmup-pool"
    pool.mkdir(parents=True, exist_ok=True)
    yaml = YAML()  # round trip: the copies keep the spec's comments and order
    data = yaml.load(Path(spec_path).read_text(encoding="utf-8"))
    plain = Path(spec_path)
    if seed_offset:
        data.setdefault("runtime", {})["seed"] = resolved.spec.runtime.seed + seed_offset
        plain = runs_dir / "calibration-spec.yaml"
        with plain.open("w", encoding="utf-8") as out_file:
            yaml.dump(data, out_file)
    if not isinstance(data.get("placement"), dict):  # absent, or "auto"
        data["placement"] = {}
    data["placement"]["colocated"] = True
    colocated = runs_dir / "calibration-spec-colocated.yaml"
    with colocated.open("w", encoding="utf-8") as out_file:
        yaml.dump(data, out_file)
    cores = resolved.spec.cluster.accelerators_per_node * resolved.spec.cluster.nodes
    runs: list[str] = []
    for name, mode, coloc in IN_SITU_RUNS:
        out = runs_dir / name
        say(console, f"in-situ calibration run {len(runs) + 1}/{len(IN_SITU_RUNS)}: {mode}"
                     f"{f', colocated, {cores} engines' if coloc else ''}, {steps} steps -> {out}/")
        cache = out / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        for f in pool.glob("warmup-*.pt"):
            shutil.copy2(f, cache / f.name)
        overrides = ApplyOverrides(mode=mode, steps=steps, output_dir=str(out),
                                   rollout_workers=cores if coloc else (1 if mode == "sync" else None))
        code = run_apply(str(colocated if coloc else plain), overrides=overrides, console=console, live=False)
        for f in cache.glob("warmup-*.pt"):
            if not (pool / f.name).exists():
                shutil.copy2(f, pool / f.name)
        if code != 0:
            error(console, f"in-situ calibration run {out}/ failed (exit {code}); nothing was fitted")
            return None
        runs.append(str(out))
    return runs


def _calibrate_from_runs(spec_path: str, out_path: str, console: Any, resolved: Any, ctx: ModelContext,
                         from_runs: Sequence[str], expected: dict[str, Any], copies: Sequence[str] = ()) -> int:
    """`--from-run`: fit the constants to real runs of this spec (`dora.calibrate_run`); ``expected``: the spec's
    runtime config, as `dora apply` writes it to runtime.json (a run of another model is refused). ``copies``: runs
    of copies of the spec that `--in-situ` made, whose note that they are of another spec would say nothing."""
    from dora.calibrate_run import (
        WARMUP_TRAIN_STEPS,
        RunDataError,
        RunTimings,
        check_run_spec,
        fit_runs,
        points_of,
        read_run,
    )

    seen: dict[str, str] = {}
    for run in from_runs:
        same = seen.get(os.path.realpath(run))
        if same is not None:
            named = f"twice (as {same} and {run})" if same != run else "twice"
            error(console, f"--from-run gives the run {os.path.realpath(run)} {named}: its steps would count twice; "
                           "give each run once")
            return EXIT_INVALID
        seen[os.path.realpath(run)] = run
    data = RunTimings()
    notes: list[str] = []
    try:
        for run in from_runs:
            note = check_run_spec(Path(run), expected, spec_path)
            read_run(Path(run), data)
            notes += [note] if note and run not in copies else []
        machine, recorded, machine_notes, machine_warnings = runs_machine(data.machines, machine_description())
        engine_steps = (sum(len(c) for c in data.decode_alone.values()) + len(data.decode_engines)
                        + len(data.decode_contended) + len(data.multi))
        resumed = f" ({'; '.join(data.resumed)})" if data.resumed else ""
        source = (f"measured in situ: {engine_steps} engine steps and "
                  f"{len(data.train_alone) + len(data.train_contended)} training steps of {len(from_runs)} "
                  f"`dora apply` run(s) of {resolved.spec.name}{resumed} on {_machine_label(machine)}"
                  + (" (as the runs recorded)" if recorded else " (this host: the runs record no machine)"))
        from dora.planning import catalog_for

        calib, fits = fit_runs(data, ctx, catalog_for(resolved), source)  # what no run measures keeps the catalog's
        calib = calib.with_overrides(cpu_rollout_engine=resolved.spec.runtime.rollout_engine)  # the runs' engine
    except RunDataError as exc:
        error(console, str(exc) + (f"\n  with --in-situ: its runs were too short for the fit; give more --steps "
                                   f"(the default is {IN_SITU_STEPS})" if copies else ""))
        return EXIT_INVALID
    for note in [*notes, *data.notes, *machine_notes]:
        say(console, f"note: {note}")
    for warning in machine_warnings:
        error(console, warning, label="warning")
    say(console, f"  machine  {_machine_label(machine)}, "
                 + ("as the runs' summary.json records it" if recorded else "this host (the runs record none)"))
    if data.warmup_left_out:
        say(console, f"  train    left out the first {WARMUP_TRAIN_STEPS} training steps of each run ("
                     f"{data.warmup_left_out} in all): the trainer's warm-up, slower than the steps after it")
    if data.early_left_out:
        say(console, f"  train    left out {data.early_left_out} early step(s): their spans hold the trainer's waits "
                     "for groups that finished after the step started")
    if not data.prefill_steps:
        say(console, "  prefill  not refitted: the runs ingested every prompt through the decode batch "
                     f"(kept cpu_prefill_compute_efficiency={calib.cpu_prefill_compute_efficiency})")
    if not any(f.kind == "engines" for f in fits):
        say(console, "  engines  not refitted: no run had two engines decoding at once "
                     f"(kept cpu_engine_contention={calib.cpu_engine_contention})")
    train = next(f for f in fits if f.kind == "train")
    if "cpu_train_parallel_efficiency" not in train.constants:
        timed = [TRAIN_COMPUTE_KEY in p.x for p in data.train_alone]
        why = ("no run trained on several threads with no rollout running (a colocated sync run does: `dora apply SPEC "
               "--mode sync` on a spec with placement.colocated: true)" if all(timed) else
               f"{'some of ' if any(timed) else ''}the runs' metrics.jsonl hold no train_time_s (a dora older than "
               "them wrote the runs), so a step's threads cannot be told from its fixed cost")
        say(console, "  threads  not refitted: a training step on n threads does the work of n x "
                     f"cpu_train_parallel_efficiency={calib.cpu_train_parallel_efficiency} cores; {why}")
    if not data.round_trips:
        say(console, "  round trip  not refitted: the runs' engine_steps.jsonl hold no poll rows (a dora older than "
                     f"them wrote the runs) (kept cpu_controller_round_trip_s={calib.cpu_controller_round_trip_s})")
    if not data.publish:
        say(console, "  weights  not refitted: the runs' traces hold no train-step end followed by its weights' "
                     f"publication (kept cpu_weight_publish_fixed_s={calib.cpu_weight_publish_fixed_s})")
    if not data.loads:
        say(console, "  weights  not refitted: the runs' traces hold no weight load on an engine that ran no step "
                     f"meanwhile (kept cpu_weight_reload_fixed_s={calib.cpu_weight_reload_fixed_s})")
    text = calibration_document(calib, fits, points_of(data), machine, resolved.spec.name, resolved.spec_hash)
    return _write(console, spec_path, out_path, text, calib, fits)


def _unwritable(out_path: str) -> tuple[str, str] | None:
    """Why ``out_path`` cannot receive the calibration file and what to do, or ``None``.

    Tried for real before minutes of measuring (``os.access`` says yes to root, and on /proc or a read-only mount):
    the temporary file ``_write`` writes first is created and removed again -- or, when ``_write`` will create
    directories, a temporary directory in the nearest existing one -- and the names to create are checked against
    the filesystem's limit. Leaves nothing behind."""
    if not out_path.strip():
        return "the path is empty", "give --out a file path in a writable directory"
    out = Path(out_path)
    if os.path.isdir(out):
        return "it is a directory", "give --out a file path in a writable directory"
    if os.path.exists(out) and not os.path.isfile(out):
        return "it is not a regular file", "give --out a file path in a writable directory"
    parent, to_create = out.parent, [] if os.path.lexists(out) else [out.name]
    while not os.path.lexists(parent) and parent != parent.parent:
        to_create.append(parent.name)  # _write creates the missing directories below the nearest existing one
        parent = parent.parent
    if not os.path.isdir(parent):
        return f"{parent} is not a directory", "give --out a file path in a writable directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable", "give --out a file path in a writable directory"
    limit = _name_max(parent)
    for name in to_create:
        size = len(os.fsencode(name))
        if size > limit:
            shown = name if len(name) <= 40 else name[:37] + "..."
            return (f"the name {shown!r} is {size} bytes long; this filesystem allows at most {limit}",
                    "give --out a shorter file name")
    try:
        if parent == out.parent:
            os.unlink(_create_temporary(parent))
        else:
            os.rmdir(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=parent))
    except OSError as exc:
        return (f"cannot create a file in {parent}: {exc.strerror or exc}",
                "give --out a file path in a writable directory")
    return None


TEMPORARY_PREFIX = ".dora-calibration-"
"""The file ``_write`` writes before renaming it onto --out: a short random name, whatever the length of --out's."""


def _name_max(directory: Path) -> int:
    """The longest file name, in bytes, the filesystem holding ``directory`` allows."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _create_temporary(directory: Path) -> str:
    """Create an empty, new temporary file in ``directory`` (permissions as a plain open() would give) and return
    its path."""
    path = os.path.join(directory, f"{TEMPORARY_PREFIX}{secrets.token_hex(4)}.tmp")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return path


def _write(console: Any, spec_path: str, out_path: str, text: str, calib: Calibration, fits: Sequence[Fit]) -> int:
    out = Path(out_path)
    tmp: str | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _create_temporary(out.parent)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, out)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        error(console, f"cannot write {out_path}: {exc.strerror or exc}")
        return EXIT_FAILED
    _print_fits(console, fits)
    say(console, f"wrote {out_path} (calibration {calib.fingerprint()}); use it with "
                 f"`dora plan {spec_path} --calibration {out_path}`")
    return EXIT_OK


def _print_fits(console: Any, fits: Sequence[Fit]) -> None:
    for f in fits:
        consts = ", ".join(f"{k}={v:.4g}" for k, v in sorted(f.constants.items()))
        console.print(f"  {f.kind:8s} {consts}   residuals: median |e| {100 * f.median_abs_error:.1f}%, "
                      f"max |e| {100 * f.max_abs_error:.1f}% over {len(f.residuals)} points", highlight=False)
    for w in fit_warnings(fits):
        error(console, w, label="warning")


POOR_FIT = 0.2
"""A median relative residual above this: the formula does not describe these measurements well."""
MIN_FIT_POINTS = 3


def fit_warnings(fits: Sequence[Fit]) -> list[str]:
    """What makes a fit's constants doubtful: too few points, a poor fit, or a constant held at the edge of what the
    fit allows (an efficiency at 1 or at the grid's floor, an overhead clamped to 0) -- the value then says more about
    the measurements' noise or a missing term than about the machine."""
    out = []
    for f in fits:
        if len(f.residuals) < MIN_FIT_POINTS:
            out.append(f"{f.kind}: fitted from {len(f.residuals)} point(s); its constants are rough (run more steps or "
                       "the full grid)")
        if f.median_abs_error > POOR_FIT:
            out.append(f"{f.kind}: median residual {100 * f.median_abs_error:.0f}%: the cost formula describes these "
                       "measurements poorly; predictions from this file carry that error")
        for name, value in sorted(f.constants.items()):
            if "efficiency" in name and (value >= 0.999 or value <= 1.001e-3):
                out.append(f"{f.kind}: {name}={value:.4g} sits at the edge of its fitted range (1e-3..1): the "
                           "measurements do not pin it down")
            elif name.endswith("_s") and value == 0.0:
                out.append(f"{f.kind}: {name} was clamped to 0 (the fit wanted it negative): the formula's other terms "
                           "already over-predict these measurements")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dora calibrate` (shared by the CLI and `python -m dora.calibrate`)."""
    parser.add_argument("spec", help="a local CPU spec (runtime.backend: local), e.g. specs/local-tiny.yaml")
    from dora.terminal import named

    parser.add_argument("--out", default="calibration.json", type=named("a file to write, or leave the flag out"),
                        help="calibration file to write (default: calibration.json)")
    parser.add_argument("--quick", action="store_true", help="a smaller grid (seconds instead of ~a minute)")
    parser.add_argument("--from-run", action="append", default=[], metavar="RUN_DIR", type=named("a run directory"),
                        help="fit to a finished `dora apply` run's output directory instead of micro-benchmarks "
                             "(repeat it: one sync run and one asynchronous run; see dora/calibrate_run.py)")
    parser.add_argument("--in-situ", action="store_true",
                        help="run the spec here three times (sync with one engine, sync colocated with an engine per "
                             "core, streaming; --steps each) and fit to those runs: what predicts runs of this "
                             "machine (the micro-benchmarks time each engine alone)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps of each --in-situ run (default {IN_SITU_STEPS})")
    parser.add_argument("--runs-dir", default=None, type=named("a directory to write the runs to"),
                        help="where --in-situ writes its runs (default runs/<spec name>-calibration)")


def main(argv: Sequence[str] | None = None, run: Callable[..., int] = run_calibrate) -> int:
    ap = argparse.ArgumentParser(prog="dora calibrate", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    return run(args.spec, args.out, quick=args.quick, from_runs=args.from_run, in_situ=args.in_situ, steps=args.steps,
               runs_dir=args.runs_dir)


if __name__ == "__main__":
    sys.exit(main())
