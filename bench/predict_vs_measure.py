"""Predicted vs measured: the calibrated planner's prediction for the local spec, next to what `dora apply` measures.

For each mode (sync, one-step-off, streaming) this

1. predicts with the calibrated planner exactly the configuration the run executes (`_predict.predict_run`:
   the plan's placement for that mode (colocated or not, engines, slots, versions per engine, trainer), the
   same number of steps and seed);
2. runs `dora apply` (`dora.apply.run_apply`) with the same mode, steps, workers and slots;
3. prints predicted and measured steady step time, trained tokens/s (prompt + response tokens, the
   simulator's definition), bubble fraction and generated-response length, with relative errors, and the
   streaming/sync and one-step-off/sync speedups.

Measured bubble fraction uses the simulator's definition (`planner.sim.result`), over the whole run: 1 - (rollout
busy seconds + trainer busy seconds) / ((engines + trainers) x wall), or, colocated, 1 - (rollout busy seconds +
engines x trainer busy seconds) / (engines x wall); trainer busy = the controller-observed span of each training
call.

Targets (issue 9): median |step-time error| <= 15%; predicted streaming/sync speedup within 15% of measured.

    python bench/predict_vs_measure.py --calibration calibration.json          # 12 steps per mode (spec: 150)
    python bench/predict_vs_measure.py --steps 20 --repeats 2                  # spread over repeated runs
    python bench/predict_vs_measure.py --calibration catalog                   # the built-in constants
Without --calibration it first calibrates in situ, as `dora calibrate --in-situ` does: two sync runs (one engine;
colocated, one engine per core) and a streaming `dora apply` run, here with the spec's seed + 1, then fits to them, into
<out-dir>/calibration.json (the micro-benchmarks of plain `dora calibrate` time each engine alone, which on 2 shared
cores predicts ~1.6x too fast).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _predict import fresh_run_dir, keep_warmup, predict_run
from rich.console import Console

STEP_TARGET = 0.15
SPEEDUP_TARGET = 0.15


def predict(resolved: Any, calibration: Any, rc: Any, *, steps: int) -> dict[str, Any]:
    """The calibrated planner's figures for exactly the configuration `rc` runs (`_predict.predict_run`)."""
    sim = predict_run(resolved, rc, calibration, steps=steps)
    return {"k": rc.max_version_lag, "step_time_s": sim.step_time_s, "tokens_per_s": sim.tokens_per_s,
            "bubble_fraction": sim.bubble_fraction, "occupancy": sim.rollout_slot_occupancy,
            "train_busy": sim.train_busy_fraction, "response_tokens": resolved.response_lengths.mean_tokens()}


def measured(out_dir: Path, workers: int, colocated: bool) -> dict[str, float]:
    """Figures from a finished run's summary.json and metrics.jsonl (definitions as the simulator's: a colocated run's
    pool is its engines' cores, which the trainer takes whole while it runs)."""
    summary = json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))["summary"]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    steady = rows[1:] if len(rows) > 1 else rows
    span = rows[-1]["end_s"] - (rows[0]["end_s"] if len(rows) > 1 else 0.0)
    wall = rows[-1]["end_s"]
    train_busy = sum(r["end_s"] - r["start_s"] for r in rows)
    rollout_busy = rows[-1]["cum_busy_s"]
    if colocated:
        used, pool = rollout_busy + workers * train_busy, workers * wall
    else:
        used, pool = rollout_busy + train_busy, (workers + 1) * wall
    return {
        "step_time_s": summary["steady_step_time_s"],
        "tokens_per_s": sum(r["forward_tokens"] for r in steady) / span,
        "bubble_fraction": max(0.0, 1 - used / pool),
        "occupancy": summary["steady_rollout_occupancy"],
        "train_busy": train_busy / wall,
        "response_tokens": summary["mean_trained_response_tokens"],
        "audit_ok": 1.0 if json.loads((out_dir / "summary.json").read_text())["audit"]["ok"] else 0.0,
    }


def _mean_spread(values: list[float], fmt: str) -> str:
    m = statistics.fmean(values)
    if len(values) == 1:
        return format(m, fmt)
    return f"{format(m, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/local-tiny.yaml")
    ap.add_argument("--calibration", default=None,
                    help="calibration file, or `catalog` for the built-in constants (default: calibrate in situ "
                         "first, from a sync and a streaming run with another seed)")
    ap.add_argument("--calib-steps", type=int, default=40, help="steps of each in-situ calibration run")
    ap.add_argument("--modes", nargs="+", default=["sync", "one-step-off", "streaming"])
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the spec's 150, shortened)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode (same seed: measures run-to-run noise)")
    ap.add_argument("--out-dir", default="runs/bench-predict")
    args = ap.parse_args()
    if args.steps is not None and args.steps < 2:
        ap.error("--steps must be at least 2: the figures compared are steady-state ones, from the end of the first "
                 "step (a one-step run has only its first step, pipeline fill included)")
    console = Console(highlight=False, width=max(150, Console().width))

    from dora.apply import ApplyOverrides, run_apply, runtime_config_for
    from dora.planning import CalibrationFileError, catalog_for, load_calibration
    from dora.spec import SpecError, load_spec

    try:
        resolved = load_spec(args.spec)
    except SpecError as exc:
        console.print(f"error: {exc}")
        return 2
    pool = Path(args.out_dir) / "warmup-pool"  # one warm-up per distinct model and task, not one per run
    cal_path = args.calibration
    if cal_path is None:
        cal_path = f"{args.out_dir}/calibration.json"
        if _calibrate_in_situ(args.spec, resolved, cal_path, args.calib_steps, args.out_dir, console, pool) != 0:
            return 1
    try:
        calibration = load_calibration(None if cal_path == "catalog" else cal_path, catalog_for(resolved))
    except CalibrationFileError as exc:
        console.print(f"error: {exc}")
        return 2
    console.print(f"calibration: {calibration.source} ({calibration.fingerprint()})")

    pred: dict[str, list[dict[str, Any]]] = {}
    meas: dict[str, list[dict[str, float]]] = {}
    for rep in range(args.repeats):  # repeats outer: the machine's speed drifts over minutes
        for mode in args.modes:
            rc = runtime_config_for(resolved, ApplyOverrides(mode=mode, steps=args.steps))
            p = predict(resolved, calibration, rc, steps=args.steps)
            out = f"{args.out_dir}/{mode}-r{rep}"
            over = ApplyOverrides(mode=mode, steps=args.steps, max_num_seqs=rc.max_num_seqs,
                                  output_dir=out)
            console.print(f"[bold]{mode}[/bold] run {rep + 1}/{args.repeats}: k={rc.max_version_lag}, {rc.rollout_workers} engine(s) x "
                          f"{rc.max_num_seqs} slots ({rc.versions_per_engine} version(s)) + 1 trainer, {args.steps} steps -> {out}")
            fresh_run_dir(out, console, pool)
            rc_code = run_apply(args.spec, overrides=over, console=console, live=False)
            keep_warmup(out, pool)
            if rc_code != 0:
                console.print(f"  dora apply exited {rc_code}; skipping")
                continue
            pred.setdefault(mode, []).append(p)
            meas.setdefault(mode, []).append(measured(Path(out), workers=rc.rollout_workers, colocated=rc.colocated))
    _print(console, pred, meas)
    return 0


def _calibrate_in_situ(spec_path: str, resolved: Any, cal_path: str, steps: int, out_dir: str,
                       console: Console, pool: Path) -> int:
    """`dora calibrate --in-situ`'s runs (``dora.calibrate.run_in_situ``: sync with one engine, sync colocated with
    one engine per core, streaming) of the spec with its seed + 1, so that the measured runs are not the data the
    constants were fitted to; then `dora calibrate --from-run` all three."""
    from dora.calibrate import IN_SITU_RUNS, run_calibrate, run_in_situ

    runs_dir = Path(out_dir) / "calibrate"
    for name, _, _ in IN_SITU_RUNS:
        fresh_run_dir(str(runs_dir / name), console)
    runs = run_in_situ(spec_path, resolved, runs_dir, steps, console, seed_offset=1, warmup_pool=pool)
    if runs is None:
        return 1
    return run_calibrate(spec_path, cal_path, console, from_runs=runs)


def _print(console: Console, pred: dict[str, list[dict[str, Any]]], meas: dict[str, list[dict[str, float]]]) -> None:
    from rich.table import Table

    t = Table(title="predicted (calibrated planner) vs measured (dora apply); measured: mean [min-max] over runs")
    for col in ("mode", "k", "step s pred", "step s meas", "err", "tok/s pred", "tok/s meas", "err",
                "bubble pred", "bubble meas", "occupancy pred|meas", "trainer busy pred|meas", "resp len pred|meas",
                "audit"):
        t.add_column(col)
    step_errors = []
    for mode, ms in meas.items():
        p = pred[mode][0]
        step_m = [m["step_time_s"] for m in ms]
        tok_m = [m["tokens_per_s"] for m in ms]
        err_step = p["step_time_s"] / statistics.fmean(step_m) - 1
        err_tok = p["tokens_per_s"] / statistics.fmean(tok_m) - 1
        step_errors.append(abs(err_step))
        t.add_row(mode, str(p["k"]), f"{p['step_time_s']:.3f}", _mean_spread(step_m, ".3f"), f"{err_step:+.0%}",
                  f"{p['tokens_per_s']:.0f}", _mean_spread(tok_m, ".0f"), f"{err_tok:+.0%}",
                  f"{p['bubble_fraction']:.0%}", _mean_spread([m["bubble_fraction"] for m in ms], ".0%"),
                  f"{p['occupancy']:.0%} | {statistics.fmean(m['occupancy'] for m in ms):.0%}",
                  f"{p['train_busy']:.0%} | {statistics.fmean(m['train_busy'] for m in ms):.0%}",
                  f"{p['response_tokens']:.1f} | {statistics.fmean(m['response_tokens'] for m in ms):.1f}",
                  "ok" if all(m["audit_ok"] for m in ms) else "FAILED")
    console.print(t)
    if step_errors:
        med = statistics.median(step_errors)
        console.print(f"median |step-time error| {med:.1%} (target <= {STEP_TARGET:.0%}): "
                      f"{'PASS' if med <= STEP_TARGET else 'MISS'}")
    for mode in ("one-step-off", "streaming"):
        if mode in meas and "sync" in meas:
            sp_p = pred[mode][0]["tokens_per_s"] / pred["sync"][0]["tokens_per_s"]
            per_run = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(meas[mode], meas["sync"], strict=False)]
            sp_m = statistics.fmean(m["tokens_per_s"] for m in meas[mode]) / statistics.fmean(
                m["tokens_per_s"] for m in meas["sync"])
            err = sp_p / sp_m - 1
            verdict = ("PASS" if abs(err) <= SPEEDUP_TARGET else "MISS") if mode == "streaming" else "info"
            console.print(f"{mode}/sync speedup: predicted {sp_p:.2f}x, measured {sp_m:.2f}x "
                          f"(per run {', '.join(f'{x:.2f}' for x in per_run)}), error {err:+.1%}: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
