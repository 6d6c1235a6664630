"""Streaming's packing of the version the trainer waits for next: half the consolidation batch vs the whole of it.

For each spec, the chosen streaming plan (the search restricted to streaming) is simulated with the policy as it is
(``StreamingPolicy._pack_cap``: the due version packed to half the batching knee) and with every older version packed
to the knee (the policy before that rule), over the search's first-stage horizon and over 24 steps, for three seeds.
Prints trained tokens/s of both and the per-seed gain range. Simulated, deterministic.
Usage: python bench/due_packing.py [spec ...]   (default: the GPU example specs)
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from dora.planning import search_inputs
from dora.spec import load_spec
from planner.policies.streaming import StreamingPolicy
from planner.search.core import Space, scale_for, search, sim_steps_for, simulate_candidate

REPO = Path(__file__).resolve().parent.parent
SPECS = ("dense-32b-h800x128", "dense-8b-h800x64", "moe-235b-h800x512", "moe-560b-x4096")
SEEDS = (0, 1, 2)


def _knee_only(self: StreamingPolicy, w: int) -> int:
    return self.pack_to


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", metavar="SPEC", help=f"example spec names (default: {' '.join(SPECS)})")
    args = ap.parse_args()
    as_is = StreamingPolicy._pack_cap
    for name in args.specs or SPECS:
        inputs = dataclasses.replace(search_inputs(load_spec(str(REPO / "specs" / f"{name}.yaml"))),
                                     modes=("streaming",))
        chosen = search(inputs).chosen.screened
        cells = []
        for steps in (sim_steps_for(inputs), 24):
            scaled = scale_for(inputs, chosen.placement.replicas, steps)
            runs = {}
            for label, cap in (("knee", _knee_only), ("half", as_is)):
                StreamingPolicy._pack_cap = cap
                try:
                    runs[label] = [simulate_candidate(Space(dataclasses.replace(inputs, seed=s)), chosen, steps=steps,
                                                      scale=scaled).tokens_per_s * scaled.factor for s in SEEDS]
                finally:
                    StreamingPolicy._pack_cap = as_is
            gains = [h / k - 1 for h, k in zip(runs["half"], runs["knee"], strict=True)]
            cells.append(f"{steps} steps: knee {sum(runs['knee']) / len(SEEDS):,.0f}, "
                         f"half {sum(runs['half']) / len(SEEDS):,.0f} ({min(gains):+.1%}..{max(gains):+.1%})")
        print(f"{name}: {chosen.label}\n  " + "\n  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
