"""Published asynchronous-RL speedups next to dora's predictions for the same settings.

Each setting is a spec under `bench/papers/` (they pass `dora validate`; each file's header says what is taken from
the source and what is assumed). For each one this plans the spec as written (`dora.planning.make_plan`: the
paper's asynchronous mode, or `auto`), plans it again restricted to synchronous training, and prints

    published   the speedup over synchronous the source reports, with the citation
    vs best     dora's predicted trained tokens/s of the chosen plan / the best synchronous plan (any placement)
    vs coloc    ... / the best *colocated* synchronous plan (verl's and AReaL's baseline: rollout and training
                time-share every GPU)
    gap         vs-baseline / published - 1, against the baseline the source compared with
    step s      where the source publishes step times: its sync step against dora's sync step on the source's
                baseline placement, and its asynchronous step against dora's chosen plan (which splits the gap
                into the baseline's error and the asynchronous plan's)

Predictions use the calibration given with --calibration (default: catalog defaults; there is no GPU measurement
in this project), so the gaps are the planner's uncalibrated error on these settings, not a fit.

    python bench/papers.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

PAPERS_DIR = Path(__file__).parent / "papers"


@dataclass(frozen=True, kw_only=True)
class Published:
    spec: str
    """File under bench/papers/."""
    speedup: float
    """Reported speedup over synchronous training (end-to-end wall time or throughput)."""
    baseline: str
    """'coloc': the source's sync baseline is colocated; 'best': any synchronous placement."""
    citation: str
    sync_step_s: float | None = None
    """The source's synchronous step time (its baseline placement), when it publishes one."""
    async_step_s: float | None = None
    """The source's asynchronous step time, when it publishes one."""


PUBLISHED = (
    Published(spec="dora-qwen2.5-32b-h800x64.yaml", speedup=2.12, baseline="best",
              citation="DORA, arXiv 2604.26256: up to 2.12x end-to-end throughput over synchronous training on "
                       "open-source benchmarks (the abstract's per-size split is not stated; same figure on both rows)"),
    Published(spec="dora-qwen2.5-32b-h800x128.yaml", speedup=2.12, baseline="best",
              citation="DORA, arXiv 2604.26256 (as above)"),
    Published(spec="verl-one-step-off-qwen2.5-7b-h20x16.yaml", speedup=749 / 520, baseline="coloc",
              citation="verl recipe/one_step_off_policy/README.md: FSDP2 step 749 s colocated sync -> 520 s "
                       "one-step-off (1.44x per step; total time +23%)", sync_step_s=749, async_step_s=520),
    Published(spec="verl-fully-async-qwen2.5-7b-h20x128.yaml", speedup=2.35, baseline="coloc",
              citation="verl recipe/fully_async_policy/README.md: 128 H20, 64:64 fully async vs 128 colocated "
                       "sync, 2.35x total time at 400 steps (2.67x at 100); step 356.30 s sync (gen 177.85, "
                       "old_log_prob 53.92, update_actor 113.81) -> 150.63 s async", sync_step_s=356.30,
              async_step_s=150.63),
    Published(spec="areal-qwen2.5-7b-h800x128.yaml", speedup=2.77, baseline="coloc",
              citation="AReaL, arXiv 2505.24298 (v4 abstract): up to 2.77x over synchronous systems on the same "
                       "GPUs"),
)


@dataclass(frozen=True, kw_only=True)
class Row:
    published: Published
    chosen: str
    vs_best: float
    vs_coloc: float | None
    step_s: float
    sync_step_s: float
    baseline_step_s: float
    """dora's sync step on the source's baseline placement (colocated, or the best sync)."""
    rollout_share: float

    @property
    def gap(self) -> float:
        pred = self.vs_coloc if (self.published.baseline == "coloc" and self.vs_coloc) else self.vs_best
        return pred / self.published.speedup - 1


def evaluate(p: Published, calibration: object) -> Row:
    from dora.planning import make_plan, search_inputs
    from dora.spec import load_spec
    from planner.search import search

    resolved = load_spec(str(PAPERS_DIR / p.spec))
    planned = make_plan(resolved, calibration)  # type: ignore[arg-type]
    inputs = dataclasses.replace(search_inputs(resolved, calibration), modes=("sync",))  # type: ignore[arg-type]
    sync = search(inputs)
    best = sync.chosen
    coloc = [s for s in sync.finalists if s.screened.placement.colocated]
    baseline = max(coloc, key=lambda s: s.trained_tokens_per_s) if coloc and p.baseline == "coloc" else best
    chosen = planned.outcome.chosen
    tps = chosen.trained_tokens_per_s
    c = chosen.screened
    return Row(published=p, chosen=f"{c.mode} k={c.k} {'coloc' if c.placement.colocated else 'disagg'} "
                                   f"R{c.placement.rollout_accelerators}/T{c.placement.train.accelerators}",
               vs_best=tps / best.trained_tokens_per_s,
               vs_coloc=tps / max(s.trained_tokens_per_s for s in coloc) if coloc else None,
               step_s=chosen.sim.step_time_s, sync_step_s=best.sim.step_time_s,
               baseline_step_s=baseline.sim.step_time_s,
               rollout_share=max(0.0, 1 - best.sim.train_busy_fraction))


def _versus(source: float | None, dora: float) -> str:
    """'source / dora (dora's error)', or '-' where the source publishes no figure."""
    return "-" if source is None else f"{source:.0f} / {dora:.0f} ({dora / source - 1:+.0%})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=None, help="calibration file (default: catalog defaults)")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from dora.planning import CalibrationFileError, load_calibration

    console = Console(highlight=False, width=200)
    try:
        calibration = load_calibration(args.calibration)
    except CalibrationFileError as exc:
        console.print(f"error: {exc}")
        return 2
    console.print(f"calibration: {calibration.source} ({calibration.fingerprint()})")
    t = Table(title="published speedup over synchronous vs dora's prediction")
    for col in ("setting", "published", "dora chosen plan", "step s (sync)", "sync rollout share", "vs best sync",
                "vs coloc sync", "gap", "sync step s: source / dora", "async step s: source / dora"):
        t.add_column(col)
    rows = []
    for p in PUBLISHED:
        row = evaluate(p, calibration)
        rows.append(row)
        t.add_row(p.spec.removesuffix(".yaml"), f"{p.speedup:.2f}x ({p.baseline})", row.chosen,
                  f"{row.step_s:.0f} ({row.sync_step_s:.0f})", f"{row.rollout_share:.0%}", f"{row.vs_best:.2f}x",
                  "-" if row.vs_coloc is None else f"{row.vs_coloc:.2f}x", f"{row.gap:+.0%}",
                  _versus(p.sync_step_s, row.baseline_step_s), _versus(p.async_step_s, row.step_s))
    console.print(t)
    for p in PUBLISHED:
        console.print(f"  {p.spec}: {p.citation}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
