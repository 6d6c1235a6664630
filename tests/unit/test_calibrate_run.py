"""`dora calibrate --from-run`: the in-situ fits recover the constants a synthetic run was generated with, and bad
run directories exit 2 with the reason."""

from __future__ import annotations

import functools
import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from dora.calibrate import ModelContext, Point, _rollout_model, _train_seconds, run_calibrate
from dora.calibrate_run import RunDataError, RunTimings, _union_s, fit_runs, fit_train_contention, read_run
from dora.planning import load_calibration
from planner.calibration import DEFAULT_CALIBRATION
from planner.sim.costmodel import cost_model_timing

LOCAL = "specs/local-tiny.yaml"
TRUTH = DEFAULT_CALIBRATION.with_overrides(
    cpu_memory_efficiency=0.3, cpu_compute_efficiency=0.1, cpu_step_overhead_s=0.0015,
    cpu_train_compute_efficiency=0.4, cpu_train_step_overhead_s=0.01, cpu_rollout_contention=1.3,
    cpu_train_contention=1.5, cpu_extra_version_step_s=0.0004, cpu_weight_publish_fixed_s=0.02,
    cpu_weight_reload_fixed_s=0.003, cpu_engine_contention=1.25)


@functools.cache
def _spec_runtime() -> dict:
    """runtime.json as `dora apply specs/local-tiny.yaml` writes it (what `--from-run` checks a run against)."""
    from dora.apply import ApplyOverrides, runtime_config_for
    from dora.spec import load_spec

    return json.loads(runtime_config_for(load_spec(LOCAL), ApplyOverrides()).to_json())


def _write_run(path: Path, ctx: ModelContext, *, overlapped: bool, seed: int, trainer_time: bool = False) -> None:
    """A run whose every duration follows TRUTH: training steps of 0.1 s every 0.3 s; engine steps in between
    (sync: only while no training step runs) or throughout (asynchronous). In sync a second engine decodes
    during the first ~half of each rollout, and both engines' steps take 1.25x meanwhile. With ``trainer_time``,
    each step records the trainer's own time too (``train_time_s``: its span less TRUTH's fixed overhead)."""
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
        if trainer_time:
            metrics[-1]["train_time_s"] = train_s - TRUTH.cpu_train_step_overhead_s
        trace.append({"t": t0 + 0.15 + train_s, "type": "train_step", "step": k + 1})
        trace.append({"t": t0 + 0.15 + train_s + timing.weight_publish_s, "type": "weights_published",
                      "version": k + 1})
        # the version is served weight_load_trainer_s after the load starts; the engine pauses only to install it
        steps.append(json.dumps([0, t0 + 0.001 + timing.weight_load_trainer_s - 2e-4, 2e-4, "load", 0, 0, 0, 0]))
        trace.append({"t": t0 + 0.001, "type": "weights_load_started", "rollout_group": 0, "version": k})
        trace.append({"t": t0 + 0.001 + timing.weight_load_trainer_s, "type": "weights_loaded", "rollout_group": 0,
                      "version": k})
        if overlapped:  # a poll that carried 16 requests: the controller's round trip, 2-6 ms
            steps.append(json.dumps([0, t0 + 0.2, 0.002 + 0.004 * ((k * 7) % 12) / 11, "poll", 16, 0, 0, 0]))
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
    (path / "runtime.json").write_text(json.dumps(_spec_runtime()))
    (path / "engine_steps.jsonl").write_text("\n".join(steps) + "\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "trace.jsonl").write_text("".join(json.dumps(e) + "\n" for e in trace))


def test_in_situ_fit_recovers_contention_versions_and_weight_times(ctx: ModelContext, tmp_path: Path) -> None:
    data = RunTimings()
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    read_run(tmp_path / "sync", data)
    read_run(tmp_path / "async", data)
    assert len(data.train_alone) == 10 and len(data.train_contended) == 10  # 12 each, less 2 of warm-up
    calib, fits = fit_runs(data, ctx, DEFAULT_CALIBRATION, "test")
    assert {f.kind for f in fits} == {"decode", "engines", "contention", "versions", "train", "weights", "round trip"}
    polls = [json.loads(line)[2] for line in (tmp_path / "async" / "engine_steps.jsonl").read_text().splitlines()
             if '"poll"' in line]
    assert len(polls) == 12 and calib.cpu_controller_round_trip_s == pytest.approx(sum(polls) / 12, rel=1e-5)
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


def test_early_steps_are_left_out_of_the_training_fit(ctx: ModelContext, tmp_path: Path) -> None:
    """An early step's span holds the trainer's waits for its late groups (``joined_s`` in metrics.jsonl): the fit
    takes the other steps only, and counts what it left out."""
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    whole = RunTimings()
    read_run(tmp_path / "sync", whole)
    metrics = tmp_path / "sync" / "metrics.jsonl"
    rows = _lines(metrics)
    for row in rows[5:8]:
        row["joined_s"] = (row["start_s"] + row["end_s"]) / 2
    _put(metrics, rows)
    early = RunTimings()
    read_run(tmp_path / "sync", early)
    assert early.early_left_out == 3 and len(early.train_alone) == len(whole.train_alone) - 3


def test_steps_with_the_trainers_own_time_fit_the_fixed_cost_from_it(ctx: ModelContext, tmp_path: Path) -> None:
    """Runs that record ``train_time_s`` put it beside each training step's span, and the train fit takes the fixed
    cost as span - trainer time (``dora.calibrate.fit_train_split``); a value that is not a positive number is an
    error naming the file, line and field."""
    data = RunTimings()
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1, trainer_time=True)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2, trainer_time=True)
    read_run(tmp_path / "sync", data)
    read_run(tmp_path / "async", data)
    assert all(p.x["compute_s"] == pytest.approx(p.seconds - 0.01) for p in data.train_alone)
    calib, fits = fit_runs(data, ctx, DEFAULT_CALIBRATION, "test")
    train = next(f for f in fits if f.kind == "train")
    assert train.constants["cpu_train_step_overhead_s"] == pytest.approx(0.01, rel=1e-6)
    assert calib.cpu_train_compute_efficiency == pytest.approx(TRUTH.cpu_train_compute_efficiency, rel=1e-4)
    assert train.max_abs_error < 1e-4
    metrics = tmp_path / "sync" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[3] = lines[3].replace('"train_time_s": ', '"train_time_s": -')
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(RunDataError, match=r"metrics.jsonl:4: train_time_s .* must be > 0"):
        read_run(tmp_path / "sync", RunTimings())


def test_the_train_contention_is_charged_on_the_covered_part_of_a_step_only() -> None:
    """Steps covered by engine steps for part of their span, slowed 1.6x in that part (the simulator's model): the
    fit recovers 1.6, where the ratio of spans to alone times would read it low; the covered fraction is the union
    of the engine steps, not their sum (two engines decoding at once cover the time once)."""
    assert _union_s([(0.0, 1.0), (0.5, 1.5), (2.0, 2.5), (2.1, 2.2)]) == pytest.approx(2.0)
    points, alone = [], []
    for a, f in ((0.05, 1.0), (0.06, 0.8), (0.05, 0.6), (0.07, 0.5)):
        span = a / ((1 - f) + f / 1.6)
        points.append(Point(kind="train", x={"overlap": f}, seconds=span, seconds_min=span, seconds_max=span))
        alone.append(a)
    c, residuals = fit_train_contention(points, alone)
    assert c == pytest.approx(1.6, rel=1e-9) and max(abs(r) for r in residuals) < 1e-9
    # noisy steps: the predicted spans sum to the measured ones
    noisy = [Point(kind="train", x=p.x, seconds=p.seconds * m, seconds_min=0, seconds_max=0)
             for p, m in zip(points, (1.3, 0.9, 1.0, 0.95), strict=True)]
    c, residuals = fit_train_contention(noisy, alone)
    assert sum((1 + r) * p.seconds for r, p in zip(residuals, noisy, strict=True)) == pytest.approx(
        sum(p.seconds for p in noisy), rel=1e-9)
    assert sum(p.seconds for p in points) / sum(alone) < 1.5  # what the ratio of sums would have said
    c, _ = fit_train_contention(points[:1], [points[0].seconds * 1.2])  # faster than alone: no contention below 1
    assert c == 1.0


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
    assert calib.cpu_rollout_engine == "torch"  # the runs' engine, which a plan of a vLLM spec checks against
    assert run_calibrate(LOCAL, str(tmp_path / "x.json"), from_runs=[str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "engine_steps.jsonl" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def _said(message: str, err: str) -> bool:
    """``message`` is in ``err`` (rich wraps the console's lines anywhere a space is)."""
    return "".join(message.split()) in "".join(err.split())


def _lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _put(path: Path, values: list) -> None:
    path.write_text("".join(json.dumps(v) + "\n" for v in values))


def _resumed(src: Path, dst: Path, earlier: int) -> None:
    """``src`` (a whole run) as the last attempt of a run resumed after step ``earlier``: metrics.jsonl first holds the
    earlier attempt's steps on their own clock from 0, the trace runs on one clock with a ``resumed`` event at the seam,
    engine_steps.jsonl holds the last attempt's steps only, and summary.json is the last attempt's."""
    shutil.copytree(src, dst)
    metrics = _lines(src / "metrics.jsonl")
    _put(dst / "metrics.jsonl", [{**m, "step": k + 1} for k, m in enumerate(metrics[:earlier])]
         + [{**m, "step": m["step"] + earlier} for m in metrics])
    trace = _lines(src / "trace.jsonl")
    before = [e for e in trace if e.get("step", e.get("version", 0)) <= earlier
              and e["type"] in ("train_step", "weights_published")]
    seam = max(e["t"] for e in before) + 1e-3
    shifted = [{**e, "t": e["t"] + seam, **{k: e[k] + earlier for k in ("step", "version") if k in e}} for e in trace]
    _put(dst / "trace.jsonl", before + [{"t": seam, "type": "resumed", "step": earlier}] + shifted)
    (dst / "summary.json").write_text(json.dumps({"summary": {"resumed_from_step": earlier}}))


def test_a_resumed_run_is_read_as_its_last_attempt(ctx: ModelContext, tmp_path: Path) -> None:
    """metrics.jsonl's clock restarts at a resume and engine_steps.jsonl holds the last attempt only: the earlier
    attempt's steps were laid on the last attempt's engine steps (69 streaming steps classed 'no rollout running')."""
    _write_run(tmp_path / "whole", ctx, overlapped=True, seed=2)
    _resumed(tmp_path / "whole", tmp_path / "resumed", earlier=5)
    whole, resumed = RunTimings(), RunTimings()
    read_run(tmp_path / "whole", whole)
    read_run(tmp_path / "resumed", resumed)
    assert [(p.x, p.seconds) for p in resumed.train_contended] == [(p.x, p.seconds) for p in whole.train_contended]
    assert [(p.x, p.seconds) for p in resumed.train_alone] == [(p.x, p.seconds) for p in whole.train_alone]
    assert resumed.decode_contended == whole.decode_contended and resumed.multi == whole.multi
    assert resumed.loads == pytest.approx(whole.loads) and len(whole.loads) == 12
    assert [p.seconds for p in resumed.publish] == pytest.approx([p.seconds for p in whole.publish])
    assert [p.x["version"] for p in resumed.publish] == [p.x["version"] + 5 for p in whole.publish]
    assert any("was resumed at step 5; only its last attempt (steps 6..17) is used, its training steps from 8 on "
               "(the first 2 are the trainer's warm-up)" in n for n in resumed.notes)
    assert resumed.resumed == ["resumed: steps 6..17 after the resume at step 5"]


def test_a_resumed_run_whose_last_attempt_did_not_finish_is_refused(ctx: ModelContext, tmp_path: Path) -> None:
    """engine_steps.jsonl is written when an attempt ends: after a resumed attempt that was killed it is an earlier
    attempt's, and no clock lines it up with the last attempt's training steps."""
    _write_run(tmp_path / "whole", ctx, overlapped=True, seed=2)
    _resumed(tmp_path / "whole", tmp_path / "resumed", earlier=5)
    (tmp_path / "resumed" / "summary.json").write_text(json.dumps({"summary": {"resumed_from_step": None}}))
    with pytest.raises(RunDataError, match=r"last resumed after step 5 \(.*trace.jsonl:\d+\), but .*summary.json is of "
                                           r"an attempt that was not resumed: that attempt did not run to its end"):
        read_run(tmp_path / "resumed", RunTimings())
    (tmp_path / "resumed" / "summary.json").unlink()
    with pytest.raises(RunDataError, match="summary.json is missing"):
        read_run(tmp_path / "resumed", RunTimings())
    # a clock that restarts with no resume in the trace is refused too, not laid on the engine steps
    metrics = _lines(tmp_path / "whole" / "metrics.jsonl")
    _put(tmp_path / "whole" / "metrics.jsonl", metrics[:3] + [{**m, "step": m["step"] + 3} for m in metrics])
    with pytest.raises(RunDataError, match=r"metrics.jsonl:4: step 4 starts at .* before step 3 .*the clock "
                                           r"restarted.*records no resume"):
        read_run(tmp_path / "whole", RunTimings())


def test_a_run_of_another_model_is_refused_and_of_another_spec_of_the_same_model_used(
        ctx: ModelContext, tmp_path: Path, capsys) -> None:
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    runs = [str(tmp_path / "sync"), str(tmp_path / "async")]
    runtime = json.loads((tmp_path / "async" / "runtime.json").read_text())
    other = {**runtime, "spec_name": "tiny-variant", "spec_hash": "f" * 64, "mode": "sync", "steps": 7, "seed": 3,
             "model": {**runtime["model"], "name": "tiny-variant"}}  # an `architecture:` model takes its spec's name
    (tmp_path / "async" / "runtime.json").write_text(json.dumps(other))
    assert run_calibrate(LOCAL, str(tmp_path / "a.json"), from_runs=runs) == 0
    err = capsys.readouterr().err
    assert _said("was made from spec \"tiny-variant\" (spec_hash ffffffffffff), not specs/local-tiny.yaml", err)
    wider = {**other, "model": {**runtime["model"], "hidden_size": 128, "num_layers": 4}}
    (tmp_path / "async" / "runtime.json").write_text(json.dumps(wider))
    assert run_calibrate(LOCAL, str(tmp_path / "b.json"), from_runs=runs) == 2
    err = capsys.readouterr().err
    assert _said("the run trained another model than specs/local-tiny.yaml", err)
    assert _said("model.hidden_size: run 128, spec 64; model.num_layers: run 4, spec 2", err)
    assert "Traceback" not in err and not (tmp_path / "b.json").exists()
    epochs = {**other, "algorithm": {**runtime["algorithm"], "ppo_epochs": 2}}
    (tmp_path / "async" / "runtime.json").write_text(json.dumps(epochs))
    assert run_calibrate(LOCAL, str(tmp_path / "c.json"), from_runs=runs) == 2
    assert _said("algorithm.ppo_epochs: run 2, spec 1", capsys.readouterr().err)
    (tmp_path / "async" / "runtime.json").unlink()
    assert run_calibrate(LOCAL, str(tmp_path / "d.json"), from_runs=runs) == 2
    assert _said("async/runtime.json: No such file or directory", capsys.readouterr().err)


def _nan_durations(rows: list) -> list:
    return [rows[0]] + [[*r[:2], math.nan, *r[3:]] for r in rows[1:]]


def _with(file: str, change: Callable[[list], list]) -> Callable[[Path], None]:
    def apply(run: Path) -> None:
        _put(run / file, change(_lines(run / file)))
    return apply


def _first(kind: str, change: Callable[[dict], dict]) -> Callable[[list], list]:
    def apply(events: list) -> list:
        i = next(i for i, e in enumerate(events) if e["type"] == kind)
        return [*events[:i], change(events[i]), *events[i + 1:]]
    return apply


def _publish_at_step_end(events: list) -> list:
    ends = {e["step"]: e["t"] for e in events if e["type"] == "train_step"}
    return [{**e, "t": ends[e["version"]]} if e["type"] == "weights_published" else e for e in events]


BAD_RUNS = {
    # (what is wrong, the file, how): the message must name file:line and the field
    "no start_s": (_with("metrics.jsonl", lambda m: [*m[:-1], {k: v for k, v in m[-1].items() if k != "start_s"}]),
                   r"metrics.jsonl:12: start_s is missing from this training step"),
    "row of 3 values": (_with("engine_steps.jsonl", lambda r: [*r[:-1], [0, 1.0, 0.01]]),
                        r"engine_steps.jsonl:\d+: a row of 3 values, expected 8 \(worker, start_s, duration_s"),
    "null duration": (_with("engine_steps.jsonl", lambda r: [*r[:-1], [*r[-1][:2], None, *r[-1][3:]]]),
                      r"engine_steps.jsonl:\d+: duration_s is null, not a number"),
    "event without t": (_with("trace.jsonl", _first("weights_published", lambda e: {k: v for k, v in e.items()
                                                                                      if k != "t"})),
                        r"trace.jsonl:\d+: t is missing from this weights_published event"),
    "NaN durations": (_with("engine_steps.jsonl", _nan_durations),
                      r"engine_steps.jsonl:2: duration_s is nan, not a finite number"),
    "NaN end_s": (_with("metrics.jsonl", lambda m: [{**x, "end_s": math.nan} for x in m]),
                  r"metrics.jsonl:1: end_s is nan, not a finite number"),
    "zero durations": (_with("engine_steps.jsonl", lambda r: [r[0]] + [[*x[:2], 0.0, *x[3:]] for x in r[1:]]),
                       r"engine_steps.jsonl:2: duration_s is 0.0, but it must be > 0"),
    # 1e-300 squared underflows to 0: the fits' relative weights 1/y^2 divided by zero
    "sub-microsecond durations": (_with("engine_steps.jsonl", lambda r: [r[0]] + [[*x[:2], 1e-300, *x[3:]]
                                                                                   for x in r[1:]]),
                                  r"engine_steps.jsonl:2: duration_s is 1e-300 s, but nothing the run times takes"),
    "zero-length training steps": (_with("metrics.jsonl", lambda m: [{**x, "end_s": x["start_s"]} for x in m]),
                                   r"metrics.jsonl:1: end_s is .*, not a microsecond after start_s .*: a training "
                                   r"step takes time"),
    "sub-microsecond training steps": (_with("metrics.jsonl", lambda m: [{**x, "start_s": x["start_s"] * 1e-300,
                                                                          "end_s": x["end_s"] * 1e-300} for x in m]),
                                       r"metrics.jsonl:1: end_s is .*, not a microsecond after start_s"),
    "sub-microsecond trainer time": (_with("metrics.jsonl", lambda m: [{**x, "train_time_s": 1e-300} for x in m]),
                                     r"metrics.jsonl:1: train_time_s is 1e-300 s, but nothing the run times"),
    "publish at the step's end": (_with("trace.jsonl", _publish_at_step_end),
                                  r"trace.jsonl:2: t of this weights_published \(v1\) is .*, not after train_step 1 "
                                  r"ended \(line 1, .*a publish takes time"),
    "bad line in the middle": (lambda run: (run / "metrics.jsonl").write_text(
        "\n".join(x if i != 2 else x[:20] for i, x in enumerate((run / "metrics.jsonl").read_text().splitlines()))
        + "\n"), r"metrics.jsonl:3: not a JSON value \("),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_bad_values_name_the_file_line_and_field(case: str, ctx: ModelContext, tmp_path: Path) -> None:
    """Each of these was an 'internal error' (KeyError, unpacking, TypeError, ZeroDivisionError), wrong advice ('add an
    asynchronous run') or a silent fit with -100% residuals; a JSON error always said 'line 1'."""
    change, message = BAD_RUNS[case]
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    change(tmp_path / "async")
    data = RunTimings()
    with pytest.raises(RunDataError, match=message):
        read_run(tmp_path / "async", data)
    assert data.runs == [] and not data.train_contended  # nothing of a bad run is added


def test_a_bad_run_exits_2_with_its_reason(ctx: ModelContext, tmp_path: Path, capsys) -> None:
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    BAD_RUNS["publish at the step's end"][0](tmp_path / "async")
    out = tmp_path / "cal.json"
    assert run_calibrate(LOCAL, str(out), from_runs=[str(tmp_path / "sync"), str(tmp_path / "async")]) == 2
    err = capsys.readouterr().err
    assert _said("a publish takes time", err) and "internal error" not in err and "Traceback" not in err
    assert not out.exists()


def test_a_step_timed_far_over_its_kinds_median_is_left_out_with_a_note(ctx: ModelContext, tmp_path: Path) -> None:
    """One engine step of 2,000 s (a paused process) among ~1 ms ones put cpu_rollout_contention at 1,146: an
    internal error (out of the constant's range), and at 1,000 s a silent 574. Now the fits are those of the run
    without that row, and a training step timed so is left out too."""
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    for name in ("async", "async-paused", "async-without"):
        _write_run(tmp_path / name, ctx, overlapped=True, seed=2)
    rows = _lines(tmp_path / "async" / "engine_steps.jsonl")
    i = next(i for i, r in enumerate(rows) if i and r[3] == "step" and r[6] == 1)
    _put(tmp_path / "async-paused" / "engine_steps.jsonl", [*rows[:i], [*rows[i][:2], 2000.0, *rows[i][3:]],
                                                             *rows[i + 1:]])
    _put(tmp_path / "async-without" / "engine_steps.jsonl", [*rows[:i], *rows[i + 1:]])

    def fitted(run: str) -> tuple[dict, list[str]]:
        data = RunTimings()
        read_run(tmp_path / "sync", data)
        read_run(tmp_path / run, data)
        calib, _ = fit_runs(data, ctx, DEFAULT_CALIBRATION, "test")
        return calib.to_dict(), data.notes

    clean, _ = fitted("async")
    paused, notes = fitted("async-paused")
    without, _ = fitted("async-without")
    assert paused == without
    assert paused["cpu_rollout_contention"] == pytest.approx(clean["cpu_rollout_contention"], rel=0.01)
    assert any("left 1 of its engine steps and polls out of the fits, each over 100x the median of its kind "
               "(the longest 2000 s, a step): a paused" in n for n in notes), notes
    # a paused training step: out of the training fits, with a note
    metrics = _lines(tmp_path / "async-paused" / "metrics.jsonl")
    metrics[-1] = {**metrics[-1], "end_s": metrics[-1]["start_s"] + 2000.0}  # the last: steps do not overlap
    _put(tmp_path / "async-paused" / "metrics.jsonl", metrics)
    data = RunTimings()
    read_run(tmp_path / "async-paused", data)
    assert len(data.train_contended) == 12 - 2 - 1 and max(p.seconds for p in data.train_contended) < 1
    assert any("left 1 of its training steps out of the fits" in n and "a training step)" in n for n in data.notes)


def test_a_fit_out_of_a_constants_range_is_an_error_not_a_crash(ctx: ModelContext, tmp_path: Path, capsys,
                                                                 monkeypatch) -> None:
    """The decode steps beside training read 2,000x slower than alone (as if every one had been paused): the
    contention lands outside [1, 1000], and the command says so, writing nothing."""
    import dora.calibrate_run as calibrate_run

    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    read = calibrate_run.read_run

    def slowed(run: Path, into: RunTimings) -> None:
        read(run, into)
        into.decode_contended[:] = [(*row[:-1], row[-1] * 2000) for row in into.decode_contended]

    monkeypatch.setattr(calibrate_run, "read_run", slowed)
    out = tmp_path / "cal.json"
    assert run_calibrate(LOCAL, str(out), from_runs=[str(tmp_path / "sync"), str(tmp_path / "async")]) == 2
    err = capsys.readouterr().err
    assert _said("the fit to the runs' timings is out of range (Calibration.cpu_rollout_contention", err), err
    assert "internal error" not in err and "Traceback" not in err and not out.exists()


def test_a_last_line_cut_short_is_left_out_with_a_note(ctx: ModelContext, tmp_path: Path) -> None:
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    whole = RunTimings()
    read_run(tmp_path / "async", whole)
    trace = tmp_path / "async" / "trace.jsonl"
    text = trace.read_text()
    trace.write_text(text + '{"t": 9.5, "type": "weights_pub')  # a writer killed mid-line
    cut = RunTimings()
    read_run(tmp_path / "async", cut)
    assert cut.publish == whole.publish
    assert cut.notes == [f"{trace}:{text.count(chr(10)) + 1}: the last line is cut short (a writer stopped "
                         "mid-line); it is left out"]
    trace.write_text(text + '{"t": 9.5, "type": "weights_pub\n')  # a whole line, ended: not a cut write
    with pytest.raises(RunDataError, match=rf"trace.jsonl:{text.count(chr(10)) + 1}: not a JSON value"):
        read_run(tmp_path / "async", RunTimings())


def test_a_publish_interval_of_zero_does_not_divide_by_zero(ctx: ModelContext) -> None:
    from dora.calibrate_run import fit_weights

    zero = Point(kind="publish", x={"version": 1}, seconds=0.0, seconds_min=0.0, seconds_max=0.0)
    fit = fit_weights([zero, Point(kind="publish", x={"version": 2}, seconds=0.05, seconds_min=0.05,
                                   seconds_max=0.05)], [0.0, 0.02], ctx, DEFAULT_CALIBRATION)
    assert len(fit.residuals) == 2 and all(math.isfinite(r) for r in fit.residuals)


def test_a_decode_cells_spread_is_its_fastest_and_slowest_step() -> None:
    data = RunTimings()
    secs = [0.010, 0.011, 0.012, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018, 0.019, 0.030]
    data.decode_alone[(8, 4)].extend((256.0, s) for s in secs)
    (point,) = data.decode_points()
    assert (point.seconds_min, point.seconds_max) == (0.010, 0.030)
    assert point.seconds == pytest.approx(sum(secs) / len(secs))


def test_weight_constants_without_intervals_are_said_to_be_kept(ctx: ModelContext, tmp_path: Path, capsys) -> None:
    """Prefill and engines said 'not refitted (kept ...)'; the weight constants were kept silently."""
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    for run in ("sync", "async"):
        _with("trace.jsonl", lambda events: [e for e in events if e["type"] == "train_step"])(tmp_path / run)
    out = tmp_path / "cal.json"
    assert run_calibrate(LOCAL, str(out), from_runs=[str(tmp_path / "sync"), str(tmp_path / "async")]) == 0
    err = capsys.readouterr().err
    assert _said(f"weights not refitted: the runs' traces hold no train-step end followed by its weights' publication "
                 f"(kept cpu_weight_publish_fixed_s={DEFAULT_CALIBRATION.cpu_weight_publish_fixed_s})", err)
    assert _said(f"weights not refitted: the runs' traces hold no weight load on an engine that ran no step meanwhile "
                 f"(kept cpu_weight_reload_fixed_s={DEFAULT_CALIBRATION.cpu_weight_reload_fixed_s})", err)
    calib = load_calibration(str(out))
    assert calib.cpu_weight_publish_fixed_s == DEFAULT_CALIBRATION.cpu_weight_publish_fixed_s
    assert calib.cpu_weight_reload_fixed_s == DEFAULT_CALIBRATION.cpu_weight_reload_fixed_s


def test_runs_without_poll_rows_keep_the_round_trip_and_say_so(ctx: ModelContext, tmp_path: Path, capsys) -> None:
    """Runs written before the workers logged their polls: the round trip is not refitted, and the command says so."""
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    _with("engine_steps.jsonl", lambda rows: [r for r in rows if not (isinstance(r, list) and r[3] == "poll")])(
        tmp_path / "async")
    out = tmp_path / "cal.json"
    assert run_calibrate(LOCAL, str(out), from_runs=[str(tmp_path / "sync"), str(tmp_path / "async")]) == 0
    assert _said("round trip not refitted: the runs' engine_steps.jsonl hold no poll rows (a dora older than them "
                 f"wrote the runs) (kept cpu_controller_round_trip_s={DEFAULT_CALIBRATION.cpu_controller_round_trip_s})",
                 capsys.readouterr().err)
    assert load_calibration(str(out)).cpu_controller_round_trip_s == DEFAULT_CALIBRATION.cpu_controller_round_trip_s


def test_the_thread_efficiency_is_refitted_only_from_runs_that_tell_it(ctx: ModelContext, tmp_path: Path,
                                                                       capsys) -> None:
    """Runs without the trainer's own time, and runs that trained on one thread only, keep the catalog's parallel
    efficiency and the command says why; a sync run that trained on two threads refits it."""
    keep = DEFAULT_CALIBRATION.cpu_train_parallel_efficiency
    cases = (({}, "the runs' metrics.jsonl hold no train_time_s"), ({"trainer_time": True}, "no run trained on several "
             "threads with no rollout running"), ({"trainer_time": True, "threads": 2}, None))
    for i, (how, why) in enumerate(cases):
        runs = [tmp_path / f"sync{i}", tmp_path / f"async{i}"]
        _write_run(runs[0], ctx, overlapped=False, seed=1, trainer_time=bool(how.get("trainer_time")))
        _write_run(runs[1], ctx, overlapped=True, seed=2, trainer_time=bool(how.get("trainer_time")))
        if "threads" in how:  # every other step of the sync run trained on two threads, at 0.6x one thread's time
            _with("metrics.jsonl", lambda rows: [
                {**m, "train_threads": 2, "train_time_s": 0.6 * m["train_time_s"]} if m["step"] % 2 else m
                for m in rows])(runs[0])
        out = tmp_path / f"cal{i}.json"
        assert run_calibrate(LOCAL, str(out), from_runs=[str(r) for r in runs]) == 0
        err = capsys.readouterr().err
        fitted = load_calibration(str(out)).cpu_train_parallel_efficiency
        if why is None:
            assert not _said("threads not refitted", err) and fitted != keep
        else:
            assert _said(f"threads not refitted: a training step on n threads does the work of n x "
                         f"cpu_train_parallel_efficiency={keep} cores; {why}", err) and fitted == keep
    # a run of an older dora beside a newer one: the spans are fitted alone, and the command says which runs lack it
    _write_run(tmp_path / "old", ctx, overlapped=False, seed=3)
    runs = [str(tmp_path / "old"), str(tmp_path / "sync1"), str(tmp_path / "async1")]
    assert run_calibrate(LOCAL, str(tmp_path / "mixed.json"), from_runs=runs) == 0
    assert _said("some of the runs' metrics.jsonl hold no train_time_s", capsys.readouterr().err)


def test_a_run_given_twice_and_quick_with_from_run_are_refused(ctx: ModelContext, tmp_path: Path, capsys) -> None:
    _write_run(tmp_path / "sync", ctx, overlapped=False, seed=1)
    _write_run(tmp_path / "async", ctx, overlapped=True, seed=2)
    out = tmp_path / "cal.json"
    twice = [str(tmp_path / "sync"), str(tmp_path / "async"), str(tmp_path / "sync" / ".." / "sync")]
    assert run_calibrate(LOCAL, str(out), from_runs=twice) == 2
    err = capsys.readouterr().err
    assert _said(f"--from-run gives the run {tmp_path / 'sync'} twice", err) and _said("would count twice", err)
    assert run_calibrate(LOCAL, str(out), quick=True, from_runs=twice[:2]) == 2
    assert _said("--quick and --from-run do not go together", capsys.readouterr().err)
    assert not out.exists()


def test_each_attempt_s_first_two_training_steps_are_left_out_as_warm_up(ctx: ModelContext, tmp_path: Path,
                                                                          capsys) -> None:
    """The trainer's first two steps are its warm-up (103 and 87 ms against ~40 later on local-tiny): fitted with the
    rest, they pulled the train fit off and gave it the largest residuals."""
    runs = [tmp_path / "sync", tmp_path / "async"]
    _write_run(runs[0], ctx, overlapped=False, seed=1)
    _write_run(runs[1], ctx, overlapped=True, seed=2)
    for run in runs:  # steps 1 and 2 take 2.5x (the span of each step is well inside its 0.3 s period)
        _with("metrics.jsonl", lambda rows: [{**m, "end_s": m["start_s"] + 2.5 * (m["end_s"] - m["start_s"])}
                                             if m["step"] <= 2 else m for m in rows])(run)
    data = RunTimings()
    for run in runs:
        read_run(run, data)
    assert len(data.train_alone) == len(data.train_contended) == 10 and data.warmup_left_out == 4
    calib, fits = fit_runs(data, ctx, DEFAULT_CALIBRATION, "test")
    train = next(f for f in fits if f.kind == "train")
    assert train.max_abs_error < 1e-3
    assert calib.cpu_train_step_overhead_s == pytest.approx(0.01, rel=0.05)
    assert calib.cpu_train_contention == pytest.approx(1.5, rel=0.03)
    assert run_calibrate(LOCAL, str(tmp_path / "cal.json"), from_runs=[str(r) for r in runs]) == 0
    assert _said("train left out the first 2 training steps of each run (4 in all): the trainer's warm-up",
                 capsys.readouterr().err)
    # a resumed run: the first two of its last attempt (a new trainer, warm-up again), steps 6 and 7
    _resumed(runs[1], tmp_path / "resumed", earlier=5)
    resumed = RunTimings()
    read_run(tmp_path / "resumed", resumed)
    assert [p.seconds for p in resumed.train_contended] == [p.seconds for p in data.train_contended]


def _with_machine(run: Path, machine: dict | None) -> None:
    summary = {"resumed_from_step": None, **({"machine": machine} if machine is not None else {})}
    (run / "summary.json").write_text(json.dumps({"summary": summary}))


def test_the_file_names_the_machine_the_runs_recorded_and_warns_when_it_is_not_one_or_not_this_one(
        ctx: ModelContext, tmp_path: Path, capsys) -> None:
    """The file's source and machine named the host running `dora calibrate`, whatever machine had made the runs."""
    from dora.calibrate import machine_description

    here = machine_description()
    elsewhere = {**here, "cpu_model": "Big Iron 9000", "cpu_count": 96}
    runs = [tmp_path / "sync", tmp_path / "async"]
    _write_run(runs[0], ctx, overlapped=False, seed=1)
    _write_run(runs[1], ctx, overlapped=True, seed=2)
    out = tmp_path / "cal.json"

    def calibrate() -> tuple[dict, str]:
        assert run_calibrate(LOCAL, str(out), from_runs=[str(r) for r in runs]) == 0
        return json.loads(out.read_text()), capsys.readouterr().err

    for run in runs:
        _with_machine(run, elsewhere)
    doc, err = calibrate()
    assert doc["machine"] == elsewhere
    assert doc["calibration"]["source"].endswith("on Big Iron 9000, 96 cores (as the runs recorded)")
    assert _said(f"{runs[0]}, {runs[1]} ran on another machine than this host ({here['cpu_model']}, "
                 f"{here['cpu_count']} cores)", err)
    assert "different machines" not in err
    _with_machine(runs[1], here)
    doc, err = calibrate()
    assert doc["machine"] == elsewhere and _said(f"the runs ran on different machines ({runs[0]}: Big Iron 9000, 96 "
                                                 f"cores; {runs[1]}: {here['cpu_model']}", err)
    _with_machine(runs[0], here)
    doc, err = calibrate()
    assert doc["machine"] == here and "warning: the runs" not in err and "another machine" not in err
    _with_machine(runs[1], None)  # a run of an older dora
    doc, err = calibrate()
    assert doc["machine"] == here and _said(f"{runs[1]} records no machine", err)
    _with_machine(runs[0], None)
    doc, err = calibrate()
    assert doc["machine"] == here and doc["calibration"]["source"].endswith("(this host: the runs record no machine)")
    assert _said("the runs record no machine (made by a dora that did not record it in summary.json): the file names "
                 "this host", err)
