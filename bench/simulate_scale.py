"""Time the simulator on the 10,240-accelerator MoE example (cheap mode, no per-trajectory trace).

The candidate is the one `dora plan` chooses for the spec (or, with --mode, the best simulated candidate of that
mode, so timings stay comparable when the chosen mode changes). Runs the full cluster (every replica, the whole batch)
for --steps steps, then the reduced-scale simulation the plan search uses for the same candidate, each --repeats
times in this process (this machine's speed varies +-20% from minute to minute: the spread is part of the figure),
and prints the wall time of each run, their median, simulated events, events/s and trajectories/s at the median,
and the simulated step time (it should agree between the scales).
It says whether the simulator ran compiled (mypyc, ``planner._native``) or from its Python sources; ``--both`` then
runs the same in a second process from the sources (``DORA_PURE_PYTHON=1``), and prints the speedup at each scale.
Usage: python bench/simulate_scale.py [--steps 10] [--spec moe-scale-x10240] [--placement any|colocated|disaggregated]
       [--mode streaming] [--repeats 3] [--both]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dora.planning import search_inputs
from dora.spec import load_spec
from planner import _native
from planner.search import search
from planner.search.core import Scaled, Space, scale_for, simulate_candidate

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--spec", default="moe-scale-x10240")
    ap.add_argument("--placement", choices=("any", "colocated", "disaggregated"), default="any",
                    help="plan only this kind of placement (the chosen plan's kind changes with the cost model)")
    ap.add_argument("--mode", default=None, help="time the best simulated candidate of this mode instead")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--both", action="store_true", help="also run from the Python sources, in a second process")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # medians for --both's parent
    args = ap.parse_args()
    inputs = search_inputs(load_spec(str(REPO / "specs" / f"{args.spec}.yaml")))
    if args.placement != "any":
        inputs = dataclasses.replace(inputs, pins=dataclasses.replace(inputs.pins,
                                                                      colocated=args.placement == "colocated"))
    outcome = search(inputs)
    if args.mode is None:
        chosen = outcome.chosen.screened
    else:
        of_mode = [f for f in outcome.finalists if f.screened.mode == args.mode]
        if not of_mode:
            ap.error(f"no simulated {args.mode} candidate for {args.spec}")
        chosen = max(of_mode, key=lambda f: f.trained_tokens_per_s).screened
    p = chosen.placement
    space = Space(inputs)
    full = Scaled(replicas=p.replicas, prompts_per_step=inputs.prompts_per_step, factor=1.0)
    print(f"{args.spec}: {chosen.label}; {p.replicas} replicas x {p.rollout.slots} slots, "
          f"{inputs.prompts_per_step}x{inputs.samples_per_prompt} per step, {args.steps} steps; simulator "
          f"{_native.STATUS}", flush=True)
    medians = {}
    for name, scaled in (("full scale", full), ("search scale", scale_for(inputs, p.replicas, args.steps))):
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = simulate_candidate(space, chosen, steps=args.steps, scale=scaled)
            walls.append(time.perf_counter() - t0)
        wall = medians[name] = statistics.median(walls)
        trajs = len(r.steps) * scaled.prompts_per_step * inputs.samples_per_prompt + r.unfinished_at_end
        print(f"  {name:12} ({scaled.replicas} replicas, 1/{scaled.factor:.1f}): wall median {wall:.2f} s "
              f"(runs {', '.join(f'{w:.2f}' for w in walls)}), {r.num_sim_events:,} events "
              f"({r.num_sim_events / wall:,.0f}/s), {trajs / wall:,.0f} trajectories/s; "
              f"simulated step {r.step_time_s:.1f} s, trained tokens/s {r.tokens_per_s * scaled.factor:,.0f}",
              flush=True)
    if args.json:
        print(json.dumps(medians))
    if args.both:
        argv = [a for a in sys.argv[1:] if a != "--both"] + ["--json"]
        print("the same from the Python sources (DORA_PURE_PYTHON=1):", flush=True)
        done = subprocess.run([sys.executable, __file__, *argv], env={**os.environ, "DORA_PURE_PYTHON": "1"},
                              capture_output=True, text=True, check=True)
        lines = done.stdout.splitlines()
        print("\n".join(lines[:-1]))
        python = json.loads(lines[-1])
        for name, wall in medians.items():
            print(f"  {name}: compiled {wall:.2f} s, Python {python[name]:.2f} s: {python[name] / wall:.2f}x")


if __name__ == "__main__":
    main()
