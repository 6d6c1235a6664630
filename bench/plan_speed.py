"""Time `dora plan SPEC` end to end (a fresh process each run, as a user runs it) on every example spec.

Target: the 10,240-accelerator MoE spec plans in at most 10 s on a 2-core machine.
``--both`` also times each spec from the Python sources (``DORA_PURE_PYTHON=1``; the install compiles the simulator,
``planner/_native.py``), the two runs interleaved so that both see the same minutes of this noisy machine.
Usage: python bench/plan_speed.py [--repeat N] [--both]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--both", action="store_true", help="also time the Python sources (DORA_PURE_PYTHON=1)")
    args = ap.parse_args()
    from planner import _native

    print(f"planner: {_native.STATUS}")
    variants = {"": {**os.environ}}
    if args.both:
        variants["python"] = {**os.environ, "DORA_PURE_PYTHON": "1"}
    print(f"{'spec':28} {'accelerators':>12} {'median s':>9} {'min s':>7} {'max s':>7}  chosen")
    for path in sorted((REPO / "specs").glob("*.yaml")):
        times: dict[str, list[float]] = {name: [] for name in variants}
        plans: dict[str, str] = {}
        for _ in range(args.repeat):
            for name, env in variants.items():
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "dora.cli", "plan", str(path), "--json"], cwd=REPO,
                                      capture_output=True, text=True, env=env)
                times[name].append(time.perf_counter() - t0)
                if proc.returncode != 0:
                    raise SystemExit(f"dora plan {path.name} failed:\n{proc.stderr}")
                plans[name] = proc.stdout
        if len(set(plans.values())) > 1:
            raise SystemExit(f"{path.name}: the compiled and the Python planner chose different plans")
        plan = json.loads(plans[""])
        pred = plan["predictions"]
        chosen = f"{plan['mode']} k={plan['max_version_lag']}, " + (
            f"{pred['speedup_vs_sync']:.2f}x sync" if pred["speedup_vs_sync_any_placement"] is None else
            f"{pred['speedup_vs_sync_any_placement']:.2f}x sync ({pred['speedup_vs_sync']:.2f}x on the pinned "
            "placement)")
        accs = plan["rollout"]["accelerators"] + (0 if plan["colocated"] else plan["train"]["accelerators"])
        for name, ts in times.items():
            label = f"{path.stem} ({name})" if name else path.stem
            extra = (f"  {statistics.median(ts) / statistics.median(times['']):.2f}x the compiled median"
                     if name else f"  {chosen}")
            print(f"{label:28} {accs:12d} {statistics.median(ts):9.2f} {min(ts):7.2f} {max(ts):7.2f}{extra}")


if __name__ == "__main__":
    main()
