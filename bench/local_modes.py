"""sync vs one-step-off vs streaming on the local spec, same seeds, side by side (real runs on local Ray).

For each seed and mode this runs the whole job (``dora.runtime.driver.run_job``) on a fresh local Ray
instance and prints, per mode (mean over seeds, with the min-max spread when several seeds ran):
trained and generated tokens/s in steady state, rollout slot occupancy, step time and its rollout
share, mean staleness, mean trained response length (and its gap to sync's), reward first -> last,
the audit verdict, and the prediction for the same configuration.

Length bias: a streaming step trains whoever finished first, so its steps are shorter; compare
*trained tokens* per second, and check that the mean trained response length over the run stays
within 5% of sync's (every admitted trajectory is trained eventually, so it should).

The best sync: a spec that pins ``placement.colocated`` pins sync's placement too, and sync may be faster on the
other one. So when sync runs on such a spec, it also runs with the pin lifted (the planner's best placement for
sync), as the row ``sync (unpinned)`` (``--no-unpinned-sync``: not), and the targets compare streaming with the
faster of the two sync rows; the length gap is to the spec's sync.

The slots of the other modes: a spec that pins its mode and ``placement.rollout.max_num_seqs`` (local-tiny: streaming
on 40 slots, which keeps its staleness down and its slots busy) tuned the slots for that mode. The other modes run on
the engine's default slots, which suit them better: measured 2026-11-24 (seeds 0 and 1), one-step-off 24.7K trained
tok/s on 64 slots and 22.2K on 40, bounded-async 27.7K and 25.4K.

PREDICTED columns are what `dora plan` predicts for each mode's run: the planner's search pinned to the
run's placement, mode, k and versions per engine, and that candidate simulated for the run's steps and
seed (``bench/_predict.py``), with the catalog constants or ``--calibration``; the mean over the seeds, as the
measured columns.

    python bench/local_modes.py                          # the spec as written, seed 0
    python bench/local_modes.py --seeds 0 1 --steps 30   # shorter, two seeds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from _predict import fresh_run_dir, predict_run
from rich.console import Console

from dora.apply import ApplyOverrides, runtime_config_for
from dora.runtime.config import RuntimeConfig
from dora.runtime.display import sparkline
from dora.spec import SpecError, load_spec

UNPINNED_SYNC = "sync (unpinned)"
TARGET_OCCUPANCY = 0.90
TARGET_SPEEDUP = 1.3
LENGTH_TOLERANCE = 0.05


def predict(resolved: Any, rc: RuntimeConfig, calibration: Any = None) -> dict[str, float] | str:
    """The planner's prediction for exactly what ``rc`` runs (``_predict.predict_run``), or why there is none
    (trained tokens are prompt + response tokens on both sides)."""
    try:
        sim = predict_run(resolved, rc, calibration, steps=rc.steps)
        return {"trained_tokens_per_s": sim.tokens_per_s,
                "occupancy": sim.rollout_slot_occupancy, "step_time_s": sim.step_time_s}
    except Exception as exc:  # a prediction is informative only; never let it stop the measured bench
        return f"n/a ({type(exc).__name__}: {exc})"


def _slots_for(resolved: Any, mode: str) -> Any:
    """``resolved`` for a run of ``mode``: a ``placement.rollout.max_num_seqs`` pinned for a mode the spec pins is
    lifted for the other modes, which run on the engine's default slots (see the module doc)."""
    spec = resolved.spec
    placement = spec.placement
    if (placement == "auto" or placement.rollout.max_num_seqs is None or spec.staleness.mode in ("auto", mode)):
        return resolved
    rollout = placement.rollout.model_copy(update={"max_num_seqs": None})
    return replace(resolved, spec=spec.model_copy(update={"placement": placement.model_copy(update={"rollout": rollout})}))


def _fmt(values: list[float], spec: str) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, spec)
    return f"{format(mean, spec)} [{format(min(values), spec)}-{format(max(values), spec)}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/local-tiny.yaml")
    ap.add_argument("--modes", nargs="+", default=["sync", "one-step-off", "streaming"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rollout-workers", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--prompts-per-step", type=int, default=None, help="override the spec (tuning)")
    ap.add_argument("--samples-per-prompt", type=int, default=None, help="override the spec (tuning)")
    ap.add_argument("--learning-rate", type=float, default=None, help="override the spec (tuning)")
    ap.add_argument("--out-dir", default="runs/bench-local-modes")
    ap.add_argument("--no-unpinned-sync", action="store_true",
                    help="on a spec that pins placement.colocated, run sync only on the pinned placement")
    ap.add_argument("--calibration", metavar="FILE", help="predict with this calibration file (`dora calibrate`; "
                    "default: the catalog constants)")
    args = ap.parse_args()
    if args.steps is not None and args.steps < 2:
        ap.error("--steps must be at least 2: the figures compared are steady-state ones, from the end of the first "
                 "step (a one-step run has only its first step, pipeline fill included)")
    console = Console(highlight=False, width=max(160, Console().width))
    try:
        resolved = load_spec(args.spec)
    except SpecError as exc:
        console.print(f"error: {exc}")
        return 2

    calibration = None
    if args.calibration:
        from dora.planning import catalog_for, load_calibration

        calibration = load_calibration(args.calibration, catalog_for(resolved))
    import ray

    from dora.runtime.driver import JobStopped, run_job

    runs: list[tuple[str, str, Any]] = [(mode, mode, _slots_for(resolved, mode)) for mode in args.modes]
    placement = resolved.spec.placement
    if "sync" in args.modes and placement != "auto" and placement.colocated is not None and not args.no_unpinned_sync:
        unpinned = resolved.spec.model_copy(update={"placement": placement.model_copy(update={"colocated": None})})
        runs.insert(args.modes.index("sync") + 1, (UNPINNED_SYNC, "sync", _slots_for(replace(resolved, spec=unpinned),
                                                                                       "sync")))
    results: dict[str, list[dict[str, Any]]] = {}
    predictions: dict[str, list[dict[str, float] | str]] = {}
    try:
        # Seeds outer, modes inner: the machine's speed drifts over minutes, so each seed's modes run back to
        # back. A fresh Ray instance per run, as `dora apply` starts one. With one shared instance and modes
        # outer, streaming (run last, after four runs) measured 6.7K trained tok/s, 1.24x sync; this way, in the
        # same hour, 8.9K, 1.87x (seeds 0 and 1, default spec).
        for seed in args.seeds:
            for row, mode, spec in runs:
                run_dir = f"{args.out_dir}/{row.replace(' (', '-').rstrip(')')}-s{seed}"
                over = ApplyOverrides(mode=mode, steps=args.steps, rollout_workers=args.rollout_workers,
                                      max_num_seqs=args.max_num_seqs, output_dir=run_dir)
                rc = runtime_config_for(spec, over)
                algorithm = rc.algorithm
                if args.learning_rate is not None:
                    algorithm = replace(algorithm, learning_rate=args.learning_rate)
                rc = replace(rc, seed=seed, algorithm=algorithm,
                             prompts_per_step=args.prompts_per_step or rc.prompts_per_step,
                             samples_per_prompt=args.samples_per_prompt or rc.samples_per_prompt)
                predictions.setdefault(row, []).append(predict(spec, rc, calibration))  # this run's seed
                where = "colocated" if rc.colocated else "disaggregated"
                console.print(f"[bold]{row}[/bold] seed {seed}: {where}, {rc.rollout_workers}x{rc.max_num_seqs} "
                              f"slots, {rc.prompts_per_step}x{rc.samples_per_prompt} per step, {rc.steps} steps ...")
                fresh_run_dir(rc.output_dir, console)
                ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False,
                         log_to_driver=False, configure_logging=False)  # its own, even beside a `ray start` cluster
                try:
                    result = run_job(rc, console=console, live=False, warmup_cache_dir=Path(args.out_dir) / "cache")
                except JobStopped as exc:
                    console.print(f"error: {row} seed {seed}: {exc}")
                    return 1
                finally:
                    ray.shutdown()
                results.setdefault(row, []).append({**result.summary, "audit_ok": result.ok})
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    _print_table(console, results, predictions)
    return 0


def _print_table(console: Console, results: dict[str, list[dict[str, Any]]],
                 predictions: dict[str, list[dict[str, float] | str]]) -> None:
    from rich.table import Table

    t = Table(title="local modes (measured; mean (min-max) over seeds)")
    for col in ("mode", "trained tok/s", "generated tok/s", "occupancy", "step s", "rollout share", "staleness",
                "resp len (vs sync)", "reward first->last", "audit", "PREDICTED tok/s | occ | step s (mean over seeds)"):
        t.add_column(col)
    sync = results.get("sync")
    sync_len = statistics.fmean(r["mean_trained_response_tokens"] for r in sync) if sync else None
    for mode, runs in results.items():
        def col(key: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [float(r[key]) for r in runs]

        length = statistics.fmean(col("mean_trained_response_tokens"))
        gap = f" ({length / sync_len - 1:+.1%})" if sync_len else ""
        preds = predictions.get(mode, [])
        failed = [p for p in preds if isinstance(p, str)]
        pred = {k: statistics.fmean(p[k] for p in preds if not isinstance(p, str))
                for k in ("trained_tokens_per_s", "occupancy", "step_time_s")} if preds and not failed else None
        pred_s = failed[0] if failed else "n/a" if pred is None else (
            f"{pred['trained_tokens_per_s']:.0f} | {pred['occupancy']:.0%} | {pred['step_time_s']:.2f}")
        t.add_row(mode, _fmt(col("steady_trained_tokens_per_s"), ".0f"), _fmt(col("steady_generated_tokens_per_s"), ".0f"),
                  _fmt(col("steady_rollout_occupancy"), ".0%"), _fmt(col("steady_step_time_s"), ".2f"),
                  _fmt(col("steady_rollout_share"), ".0%"), _fmt(col("mean_staleness"), ".2f"),
                  f"{length:.1f}{gap}", f"{_fmt(col('reward_first'), '.3f')} -> {_fmt(col('reward_last'), '.3f')}",
                  "ok" if all(r["audit_ok"] for r in runs) else "FAILED", pred_s)
    console.print(t)
    for mode, runs in results.items():
        curve = [statistics.fmean(c) for c in zip(*(r["reward_curve"] for r in runs), strict=False)]
        console.print(f"reward {mode:>15}: {sparkline(curve, width=80)}  "
                      f"{' '.join(f'{x:.2f}' for x in curve[:: max(1, len(curve) // 10)])}")
    if sync and "streaming" in results:
        st = results["streaming"]

        def trained(row: str) -> float:
            return statistics.fmean(r["steady_trained_tokens_per_s"] for r in results[row])

        best = max((row for row in ("sync", UNPINNED_SYNC) if row in results), key=trained)
        speedup = trained("streaming") / trained(best)
        occ = statistics.fmean(r["steady_rollout_occupancy"] for r in st)
        gap = statistics.fmean(r["mean_trained_response_tokens"] for r in st) / (sync_len or 1) - 1
        share = statistics.fmean(r["steady_rollout_share"] for r in sync)
        checks = [
            (f"streaming occupancy {occ:.1%} >= {TARGET_OCCUPANCY:.0%}", occ >= TARGET_OCCUPANCY),
            (f"streaming trained tok/s {speedup:.2f}x the best sync ({best}) >= {TARGET_SPEEDUP}x",
             speedup >= TARGET_SPEEDUP),
            (f"trained length gap {gap:+.1%} within {LENGTH_TOLERANCE:.0%}", abs(gap) <= LENGTH_TOLERANCE),
            (f"sync rollout share {share:.1%} >= 50%", share >= 0.5),
        ]
        for text, ok in checks:
            console.print(f"  [{'green' if ok else 'red'}]{'PASS' if ok else 'MISS'}[/] {text}")
        others = [row for row in results if row in ("one-step-off", "bounded-async", "partial-rollout")]
        if others:
            fastest = max(others, key=trained)
            console.print(f"  info streaming trained tok/s {trained('streaming') / trained(fastest):.2f}x the fastest "
                          f"other asynchronous mode ({fastest})")


if __name__ == "__main__":
    sys.exit(main())
