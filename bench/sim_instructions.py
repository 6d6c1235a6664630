"""Count the simulator's CPU instructions per simulated step under callgrind: a speed figure this noisy machine cannot blur.

Wall time here swings by a third for the same code within minutes (other tenants share the caches), so a change to
the simulator that saves 5% cannot be seen in `simulate_scale.py`'s seconds. Instruction counts are deterministic.
The candidate is the one `dora plan` chooses for the spec, simulated at the search's scale (or the full cluster with
--full). Each source tree (--tree, default this checkout) simulates it for --steps A and B steps in a child process
under `valgrind --tool=callgrind`; B - A steady-state steps cancel the interpreter's start, the imports and the
pipeline's fill, and the figure is (instructions at B - instructions at A) / (B - A). Results (events, trained
tokens/s) are printed too, to show whether two trees simulate the same schedule. The children run with
PYTHONHASHSEED=0: string hashing otherwise changes dict and set layouts, and the counts, from run to run.
Instructions are not time: cache misses are not counted (run `simulate_scale.py` beside it).
A tree built with mypyc (``planner._native``) runs compiled; ``--python`` also runs each tree from its Python sources
(``DORA_PURE_PYTHON=1``), on the next line.
Needs valgrind. A tree whose planner cannot unpickle this checkout's candidate (a changed class) fails.
Usage: python bench/sim_instructions.py [--spec moe-scale-x10240] [--placement any|colocated|disaggregated]
       [--steps 1 3] [--full] [--tree DIR ...] [--python]
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import pickle, sys
from planner.search.core import simulate_candidate
space, chosen, scaled = pickle.load(open(sys.argv[1], "rb"))
r = simulate_candidate(space, chosen, steps=int(sys.argv[2]), scale=scaled)
print("RESULT", r.num_sim_events, f"{r.tokens_per_s * scaled.factor:.1f}")
"""


def _run(tree: Path, job: Path, steps: int, pure: bool) -> tuple[int, str]:
    """(instructions, result line) of one child simulation under callgrind."""
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", CHILD, str(job),
         str(steps)],
        capture_output=True, text=True, cwd=tree, check=False,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"} | ({"DORA_PURE_PYTHON": "1"} if pure else {}))
    collected = re.search(r"Collected : (\d+)", proc.stderr)
    result = re.search(r"RESULT (.*)", proc.stdout)
    if proc.returncode != 0 or not collected or not result:
        raise SystemExit(f"{tree}: the simulation under callgrind failed:\n{proc.stderr[-2000:]}")
    return int(collected.group(1)), result.group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="moe-scale-x10240")
    ap.add_argument("--placement", choices=("any", "colocated", "disaggregated"), default="any",
                    help="plan only this kind of placement (the chosen plan's kind changes with the cost model)")
    ap.add_argument("--steps", type=int, nargs=2, default=(1, 3), metavar=("A", "B"))
    ap.add_argument("--full", action="store_true", help="every replica and the whole batch (slower under callgrind)")
    ap.add_argument("--tree", type=Path, action="append", help="a source tree to measure (repeatable); default: this one")
    ap.add_argument("--python", action="store_true", help="also run each tree from its Python sources")
    args = ap.parse_args()
    a, b = args.steps
    if not 0 < a < b:
        ap.error("--steps needs 0 < A < B")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    from dora.planning import search_inputs
    from dora.spec import load_spec
    from planner.search import search
    from planner.search.core import Scaled, Space, scale_for

    inputs = search_inputs(load_spec(str(REPO / "specs" / f"{args.spec}.yaml")))
    if args.placement != "any":
        inputs = dataclasses.replace(inputs, pins=dataclasses.replace(inputs.pins,
                                                                      colocated=args.placement == "colocated"))
    chosen = search(inputs).chosen.screened
    replicas = chosen.placement.replicas
    scaled = (Scaled(replicas=replicas, prompts_per_step=inputs.prompts_per_step, factor=1.0) if args.full
              else scale_for(inputs, replicas, b))
    trees = [t.resolve() for t in args.tree or [REPO]]
    print(f"{args.spec}: {chosen.label}; {scaled.replicas} replicas (1/{scaled.factor:.1f} scale), steps {a} and {b}")
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "candidate.pickle"
        job.write_bytes(pickle.dumps((Space(inputs), chosen, scaled)))
        for tree, pure in ((t, p) for t in trees for p in ((False, True) if args.python else (False,))):
            with ThreadPoolExecutor(2) as pool:  # the two children on the two cores
                (ia, _), (ib, result) = pool.map(lambda s, t=tree, p=pure: _run(t, job, s, p), (a, b))
            events, tokens_per_s = result.split()
            name = f"{tree} (Python sources)" if pure else str(tree)
            print(f"  {name:40} {(ib - ia) / (b - a) / 1e9:6.3f} G instructions per step "
                  f"(at {a} steps {ia / 1e9:.2f} G, at {b} {ib / 1e9:.2f} G); {int(events):,} events, "
                  f"trained tokens/s {float(tokens_per_s):,.0f}")


if __name__ == "__main__":
    main()
