"""Every scheduling mode on every example spec, each on the placement the planner finds best for that mode.

For each spec and mode, the search runs restricted to that mode (colocated sync and streaming are reported apart from
disaggregated ones; partial-rollout is planned with version mixing allowed, which the example specs forbid, so its
row is marked). The sync rows lift the spec's placement pins, as the baseline `dora plan` leads with (a user who
chose sync would not keep a placement pinned for streaming); the other modes keep them. Prints simulated step time, trained tokens/s, speedup over the best sync plan, bubble fraction, rollout
slot occupancy and mean staleness, then the overlap ceilings: what a perfect schedule would reach under the cost model
on the spec's best disaggregated placement (training overlapped with rollout) and on its best colocated one (the two in
turn), ``SearchOutcome.ceiling_by_kind``; no schedule dora can plan beats the higher of the two. With --timeline DIR,
writes the simulated timelines of the best sync and the two streaming plans of each spec as self-contained HTML.

Usage: python bench/modes.py [--only NAME] [--timeline DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from dora.planning import search_inputs
from dora.spec import load_spec
from planner.schedule.export import timeline_html
from planner.search import search
from planner.search.core import Space, scale_for, sim_steps_for, simulate_candidate
from planner.search.inputs import Pins

REPO = Path(__file__).resolve().parent.parent
ROWS = (("sync (colocated)", "sync", True), ("sync", "sync", False), ("one-step-off", "one-step-off", False),
        ("bounded-async", "bounded-async", False), ("partial-rollout*", "partial-rollout", False),
        ("streaming", "streaming", False), ("streaming (colocated)", "streaming", True))


def _mean_staleness(sim) -> float:
    total = sum(n for _, n in sim.staleness_histogram)
    return sum(k * n for k, n in sim.staleness_histogram) / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="one example spec stem")
    ap.add_argument("--timeline", default=None, help="directory for sync/streaming timeline HTML")
    args = ap.parse_args()
    for path in sorted((REPO / "specs").glob("*.yaml")):
        if args.only and path.stem != args.only:
            continue
        resolved = load_spec(str(path))
        base = search_inputs(resolved)
        free = search_inputs(resolved, unpinned=True)  # the sync rows' (see the module doc)
        t0 = time.perf_counter()
        results = {}
        for label, mode, colocated in ROWS:
            row = free if mode == "sync" else base
            inputs = dataclasses.replace(row, modes=(mode,), pins=dataclasses.replace(row.pins, colocated=colocated),
                                         allow_version_mixing=base.allow_version_mixing or mode == "partial-rollout")
            try:
                results[label] = search(inputs)
            except Exception as exc:  # a mode with no feasible placement: show why instead of a row
                results[label] = exc
        best_sync = max(r.chosen.trained_tokens_per_s for lab, r in results.items()
                        if lab.startswith("sync") and not isinstance(r, Exception))
        print(f"\n{path.stem}  ({resolved.spec.total_accelerators} x {resolved.spec.cluster.accelerator}, "
              f"k={base.max_version_lag}, searched in {time.perf_counter() - t0:.1f} s)")
        print(f"  {'mode':21} {'step':>9} {'trained tok/s':>14} {'x best sync':>11} {'bubble':>7} {'occupancy':>9} "
              f"{'staleness':>9}  placement")
        for label, _, _ in ROWS:
            r = results[label]
            if isinstance(r, Exception):
                print(f"  {label:21} infeasible: {r}")
                continue
            c, sim = r.chosen, r.chosen.sim
            print(f"  {label:21} {sim.step_time_s:8.1f}s {c.trained_tokens_per_s:14,.0f} "
                  f"{c.trained_tokens_per_s / best_sync:10.2f}x {100 * sim.bubble_fraction:6.0f}% "
                  f"{100 * sim.rollout_slot_occupancy:8.0f}% {_mean_staleness(sim):9.2f}  {c.screened.placement.label}")
        print("  * partial-rollout mixes versions inside a trajectory: planned here with mixing allowed, "
              "which this spec forbids")
        ceilings: dict[str, tuple[float, str]] = {}
        pinned = resolved.spec.placement != "auto"
        for label, r in results.items():  # not the partial-rollout row's, planned with mixing the spec may forbid,
            if isinstance(r, Exception) or (label.startswith("partial-rollout") and not base.allow_version_mixing):
                continue
            if pinned and label.startswith("sync"):  # nor, where the spec pins the placement, the unpinned sync rows'
                continue
            for kind, rate, where in r.ceiling_by_kind:
                ceilings[kind] = max(ceilings.get(kind, (rate, where)), (rate, where))
        for kind, how, row in (("disaggregated", "training overlapped with rollout", "streaming"),
                               ("colocated", "rollout and training in turn on every device", "streaming (colocated)")):
            if kind in ceilings:
                rate, where = ceilings[kind]
                streaming = results[row]
                reach = ("" if isinstance(streaming, Exception) else
                         f"; {row} reaches {100 * streaming.chosen.trained_tokens_per_s / rate:.1f}%")
                print(f"  ceiling, {kind} ({how}; every slot busy up to the budget, the longest response within "
                      f"k+1 steps): {rate:,.0f} trained tok/s = "
                      f"{rate / best_sync:.2f}x best sync, on {where}{reach}")
        if args.timeline:
            out = Path(args.timeline)
            out.mkdir(parents=True, exist_ok=True)
            for label in ("sync (colocated)", "streaming", "streaming (colocated)"):
                r = results[label]
                if isinstance(r, Exception):
                    continue
                inputs = dataclasses.replace(base, pins=Pins())
                space = Space(inputs)
                steps = sim_steps_for(inputs)
                scaled = scale_for(inputs, r.chosen.screened.placement.replicas, steps)
                sim = simulate_candidate(space, r.chosen.screened, steps=steps, scale=scaled, record_events=True)
                name = out / f"{path.stem}-{label.replace(' (', '-').rstrip(')')}.html"
                name.write_text(timeline_html(list(sim.events or ()), title=f"{path.stem}: {label}"))
                print(f"  wrote {name}")


if __name__ == "__main__":
    main()
