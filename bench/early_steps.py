"""Early steps (``PolicyConfig.early_steps``): the planner with and without them, side by side, on every example spec.

An early step starts while the oldest version's last groups still generate, trains the finished groups, and takes
the rest as they finish (one optimizer step at its end); without, the trainer waits for the whole batch. For each
spec this runs the search both ways and prints the chosen plan, its trained tokens/s and its speedup over the best
sync plan (sync never starts early: it is the same baseline both ways), then simulates the plan chosen with early steps
on its own placement without them, for 24 steps on the whole cluster and three seeds: what the early start is worth
on one placement, apart from the choice of placement it leads to. Simulated, deterministic.
Usage: python bench/early_steps.py [spec ...]   (default: every example spec)
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from dora.planning import search_inputs
from dora.spec import load_spec
from planner.search.core import Space, search, simulate_candidate

REPO = Path(__file__).resolve().parent.parent
SPECS = ("local-tiny", "dense-8b-h800x64", "dense-32b-h800x128", "moe-235b-h800x512", "moe-560b-x4096",
         "moe-scale-x10240")
SEEDS = (0, 1, 2)
STEPS = 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", metavar="SPEC", help=f"example spec names (default: {' '.join(SPECS)})")
    args = ap.parse_args()
    for name in args.specs or SPECS:
        inputs = search_inputs(load_spec(str(REPO / "specs" / f"{name}.yaml")))
        print(f"{name}:")
        chosen = {}
        for early in (False, True):
            out = search(dataclasses.replace(inputs, early_steps=early))
            c, sync = out.chosen, out.best_sync
            speedup = f", {c.trained_tokens_per_s / sync.trained_tokens_per_s:.2f}x the best sync plan" if sync else ""
            print(f"  early steps {'on ' if early else 'off'}: {c.screened.label}  {c.trained_tokens_per_s:,.0f} "
                  f"trained tok/s over {c.sim_steps} steps{speedup}", flush=True)
            chosen[early] = c.screened
        on = chosen[True]
        rates = {}
        for early in (False, True):
            rates[early] = [simulate_candidate(Space(dataclasses.replace(inputs, seed=s, early_steps=early)), on,
                                               steps=STEPS).tokens_per_s for s in SEEDS]
        gains = [a / b - 1 for a, b in zip(rates[True], rates[False], strict=True)]
        print(f"  the early-step plan's placement, {STEPS} steps, seeds {SEEDS[0]}-{SEEDS[-1]}: without "
              f"{sum(rates[False]) / len(SEEDS):,.0f}, with {sum(rates[True]) / len(SEEDS):,.0f} "
              f"({min(gains):+.1%}..{max(gains):+.1%})", flush=True)


if __name__ == "__main__":
    main()
