"""The planner's prediction for exactly the configuration a local run executes (shared by the local benches)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any


def fresh_run_dir(path: str, console: Any, warmup_pool: Path | None = None) -> None:
    """Remove an earlier run's output directory: a bench measures whole runs, and `dora apply` would resume the
    checkpoint it finds there (measuring only the steps left) or stop on one of another configuration. With
    ``warmup_pool``, seed the run's warm-up cache from it (the files are named by a hash of what they hold, so a run
    uses only its own; the warm-up is not what a bench measures, and takes ~20 s a run)."""
    if Path(path).exists():
        console.print(f"  removing the earlier run in {path}/")
        shutil.rmtree(path)
    if warmup_pool is not None and warmup_pool.is_dir():
        cache = Path(path) / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        for f in warmup_pool.glob("warmup-*.pt"):
            shutil.copy2(f, cache / f.name)


def keep_warmup(path: str, warmup_pool: Path) -> None:
    """Add the warm-ups a run computed to ``warmup_pool`` (see ``fresh_run_dir``)."""
    warmup_pool.mkdir(parents=True, exist_ok=True)
    for f in (Path(path) / "cache").glob("warmup-*.pt"):
        if not (warmup_pool / f.name).exists():
            shutil.copy2(f, warmup_pool / f.name)


def predict_run(resolved: Any, rc: Any, calibration: Any, *, steps: int) -> Any:
    """Simulate the candidate `rc` (a ``RuntimeConfig``) runs: its mode, k, placement (rollout workers x slots,
    versions per engine, trainers), step count and seed, with ``calibration`` (``None``: the catalog constants).
    The search is pinned to that placement and the one candidate matching it is simulated (a
    ``planner.sim.SimResult``). Raises ``LookupError`` when the search has no such candidate (e.g. a slot count
    overridden beyond what memory allows)."""
    from dora.planning import search_inputs
    from planner.search import Pins, search
    from planner.search.core import Space, simulate_candidate, versions_per_engine

    pins = Pins(colocated=rc.colocated, rollout_accelerators=rc.rollout_accelerators,
                rollout_tp=rc.accelerators_per_rollout_worker, versions_per_engine=rc.versions_per_engine,
                train_accelerators=rc.train_accelerators)
    base = search_inputs(resolved) if calibration is None else search_inputs(resolved, calibration)
    inputs = dataclasses.replace(base, modes=(rc.mode,), steps=steps, seed=rc.seed, pins=pins)
    outcome = search(inputs)
    for cand in outcome.screened:
        if (cand.mode == rc.mode and cand.k == rc.max_version_lag and versions_per_engine(cand) == rc.versions_per_engine
                and cand.placement.rollout.slots >= rc.max_num_seqs):
            cand = dataclasses.replace(cand, placement=dataclasses.replace(
                cand.placement, rollout=dataclasses.replace(cand.placement.rollout, slots=rc.max_num_seqs)))
            return simulate_candidate(Space(inputs), cand, steps=steps)
    raise LookupError(f"no {rc.mode} k={rc.max_version_lag} candidate with {rc.versions_per_engine} version(s) per "
                      f"engine and >= {rc.max_num_seqs} slots on the run's placement")
