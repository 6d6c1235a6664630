"""Streaming's packing of the version the trainer waits for next: to the consolidation batch (the policy) vs half of it.

For each spec, the chosen streaming plan (the search restricted to streaming) is simulated with the policy as it is
(``StreamingPolicy._pack_cap``: every older version packed to the batching knee) and with the version the trainer
must finish next (``next_step - k - 1``) packed to half the knee, for three seeds, over the search's first-stage
horizon and over 24 steps (or the ``--steps`` given). Prints trained tokens/s of both and the per-seed gain range of
the half rule. Simulated, deterministic.
Runs the planner from its Python sources (``DORA_PURE_PYTHON=1``, set here before the planner is imported): the
compiled policy calls its own ``_pack_cap`` directly, so swapping the method on the class would change nothing, and
both rules would print the same figures.
Usage: python bench/due_packing.py [spec ...] [--steps N ...]   (default: the GPU example specs)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

os.environ["DORA_PURE_PYTHON"] = "1"

import planner._native  # noqa: E402
from dora.planning import search_inputs  # noqa: E402
from dora.spec import load_spec  # noqa: E402
from planner.policies.streaming import StreamingPolicy  # noqa: E402
from planner.search.core import Space, scale_for, search, sim_steps_for, simulate_candidate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SPECS = ("dense-32b-h800x128", "dense-8b-h800x64", "moe-235b-h800x512", "moe-560b-x4096")
SEEDS = (0, 1, 2)


def _half_for_due(self: StreamingPolicy, w: int) -> int:
    """The due version's tails decode at most 1.5x slower than alone, instead of 2x at the knee."""
    return max(1, self.pack_to // 2) if w <= self.next_step - self.k - 1 else self.pack_to


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", metavar="SPEC", help=f"example spec names (default: {' '.join(SPECS)})")
    ap.add_argument("--steps", type=int, nargs="+", default=None,
                    help="horizons to simulate (default: the search's first-stage horizon and 24)")
    args = ap.parse_args()
    if not planner._native.STATUS.startswith("python"):
        raise SystemExit(f"the planner runs compiled ({planner._native.STATUS}): the swap would not reach it")
    as_is = StreamingPolicy._pack_cap
    for name in args.specs or SPECS:
        inputs = dataclasses.replace(search_inputs(load_spec(str(REPO / "specs" / f"{name}.yaml"))),
                                     modes=("streaming",))
        chosen = search(inputs).chosen.screened
        cells = []
        for steps in args.steps or (sim_steps_for(inputs), 24):
            scaled = scale_for(inputs, chosen.placement.replicas, steps)
            runs = {}
            for label, cap in (("knee", as_is), ("half", _half_for_due)):
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
