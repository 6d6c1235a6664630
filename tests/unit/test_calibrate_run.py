"""`dora calibrate --from-run`: the in-situ fits recover the constants a synthetic run was generated with, and bad
run directories exit 2 with the reason."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dora.calibrate import ModelContext, Point, _rollout_model, _train_seconds, run_calibrate
from dora.calibrate_run import RunDataError, RunTimings, fit_runs, read_run
from dora.planning import load_calibration
from planner.calibration import DEFAULT_CALIBRATION
from planner.sim.costmodel import cost_model_timing

LOCAL = "specs/local-tiny.yaml"
TRUTH = DEFAULT_CALIBRATION.with_overrides(
    cpu_memory_efficiency=0.3, cpu_compute_efficiency=0.1, cpu_step_overhead_s=0.0015,
    cpu_train_compute_efficiency=0.4, cpu_train_step_overhead_s=0.01, cpu_rollout_contention=1.3,
    cpu_train_contention=1.5, cpu_extra_version_step_s=0.0004, cpu_weight_publish_fixed_s=0.02,
    cpu_weight_reload_fixed_s=0.003, cpu_engine_contention=1.25)


def _write_run(path: Path, ctx: ModelContext, *, overlapped: bool, seed: int) -> None:
    """A run whose every duration follows TRUTH: training steps of 0.1 s every 0.3 s; engine steps in between
    (sync: only while no training step runs) or throughout (asynchronous). In sync a second engine decodes
    during the first ~half of each rollout, and both engines' steps take 1.25x meanwhile."""
    rng = random.Random(seed)
    model = _rollout_model(ctx, TRUTH)
    timing = cost_model_timing(ctx.arch, rollout_acc=ctx.accelerator, train_acc=ctx.accelerator, rollout_tp=1,
                               num_rollout_groups=1, train_tp=1, train_pp=1, train_dp=1, dtype_bytes=ctx.dtype_bytes,
                               micro_batch_tokens=ctx.micro_batch_tokens, calib=TRUTH,
                               accelerators_per_node=ctx.accelerators_per_node)
    weight_read = model.nonexpert_weight_bytes_per_device / model.memory_rate_bytes_per_s
    path.mkdir()
    metrics, trace, steps = [], [], [json.dumps({"columns": ["worker", "start_s", "duration_s", "kind", "decode_rows",
                                                              "context_tokens", "versions", "prefill_tokens"]})]
    for k in range(12):
        t0 = 0.3 * k
        n = rng.choice((64, 96, 128))
        tokens = n * rng.choice((12, 18, 30))
        p = Point(kind="train", x={"tokens": tokens, "sum_sq_seq_len": tokens ** 2 / n, "num_seqs": n}, seconds=0,
                  seconds_min=0, seconds_max=0)
        train_s = _train_seconds(ctx, TRUTH, p) * (1.5 if overlapped else 1.0)
        metrics.append({"step": k + 1, "start_s": t0 + 0.15, "end_s": t0 + 0.15 + train_s, "forward_tokens": tokens,
                        "forward_sum_sq_tokens": tokens ** 2 / n, "num_sequences": n})
        trace.append({"t": t0 + 0.15 + train_s, "type": "train_step", "step": k + 1})
        trace.append({"t": t0 + 0.15 + train_s + timing.weight_publish_s, "type": "weights_published",
                      "version": k + 1})
        # the version is served weight_load_trainer_s after the load starts; the engine pauses only to install it
        steps.append(json.dumps([0, t0 + 0.001 + timing.weight_load_trainer_s - 2e-4, 2e-4, "load", 0, 0, 0, 0]))
        trace.append({"t": t0 + 0.001, "type": "weights_load_started", "rollout_group": 0, "version": k})
        trace.append({"t": t0 + 0.001 + timing.weight_load_trainer_s, "type": "weights_loaded", "rollout_group": 0,
                      "version": k})
        other_end = t0 + 0.01  # the second engine's steps end here
        for worker, stop in ((1, t0 + 0.08), (0, t0 + 0.3 if overlapped else t0 + 0.149)):
            if worker == 1 and overlapped:
                continue
            t = t0 + 0.01
            while True:
                b = rng.choice((1, 8, 16, 32, 64))
                c = b * rng.choice((8, 32, 64, 96))
                v = rng.choice((1, 1, 2, 3)) if overlapped else 1
                during = t0 + 0.15 <= t <= t0 + 0.15 + train_s
                dur = model.decode_step_s(b, c) + (v - 1) * (weight_read + 0.0004)
                dur *= 1.3 if during else 1.0
                dur *= 1.25 if worker == 1 or t < other_end else 1.0
                if t + dur > stop:
                    break
                steps.append(json.dumps([worker, round(t, 9), dur, "step", b, c, v, 0]))
                t += dur + 1e-6
            if worker == 1:
                other_end = t
    (path / "engine_steps.jsonl").write_text("\n".join(steps) + "\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "trace.jsonl").write_text("".join(json.dumps(e) + "\n" for e in trace))


def test_in_situ_fit_recovers_contention_versions_and_weight_times(ctx: ModelContext, tmp_path: Path) -> None:
    data = RunTimings()
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    read_run(tmp_path / "sync", data)
    read_run(tmp_path / "async", data)
    assert len(data.train_alone) == 12 and len(data.train_contended) == 12
    calib, fits = fit_runs(data, ctx, DEFAULT_CALIBRATION, "test")
    assert {f.kind for f in fits} == {"decode", "engines", "contention", "versions", "train", "weights"}
    assert calib.cpu_engine_contention == pytest.approx(1.25, rel=0.03)
    assert calib.cpu_rollout_contention == pytest.approx(1.3, rel=0.03)
    assert calib.cpu_train_contention == pytest.approx(1.5, rel=0.03)
    assert calib.cpu_extra_version_step_s == pytest.approx(0.0004, rel=0.1)
    assert calib.cpu_train_step_overhead_s == pytest.approx(0.01, rel=0.05)
    assert calib.cpu_weight_publish_fixed_s == pytest.approx(0.02, rel=0.01)
    assert calib.cpu_weight_reload_fixed_s == pytest.approx(0.003, rel=0.01)
    alone, truth = _rollout_model(ctx, calib), _rollout_model(ctx, TRUTH)
    for b, c in ((1, 8), (16, 400), (64, 3000)):
        assert alone.decode_step_s(b, c) == pytest.approx(truth.decode_step_s(b, c), rel=0.05)


def test_one_kind_of_run_is_not_enough(ctx: ModelContext, tmp_path: Path) -> None:
    data = RunTimings()
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    read_run(tmp_path / "sync", data)
    with pytest.raises(RunDataError, match="asynchronous run"):
        fit_runs(data, ctx, DEFAULT_CALIBRATION, "test")


def test_from_run_cli_writes_a_loadable_file_and_rejects_a_bad_directory(ctx: ModelContext, tmp_path: Path,
                                                                         capsys) -> None:
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    out = tmp_path / "cal.json"
    assert run_calibrate(LOCAL, str(out), from_runs=[str(tmp_path / "sync"), str(tmp_path / "async")]) == 0
    calib = load_calibration(str(out))
    assert calib.source.startswith("measured in situ") and calib.cpu_rollout_contention == pytest.approx(1.3, rel=0.03)
    assert run_calibrate(LOCAL, str(tmp_path / "x.json"), from_runs=[str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "engine_steps.jsonl" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()
