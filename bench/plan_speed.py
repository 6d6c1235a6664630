"""Time `dora plan SPEC` end to end (a fresh process each run, as a user runs it) on every example spec.

Target: the 10,240-accelerator MoE spec plans in at most 10 s on a 2-core machine.
Usage: python bench/plan_speed.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{'spec':28} {'accelerators':>12} {'median s':>9} {'min s':>7} {'max s':>7}  chosen")
    for path in sorted((REPO / "specs").glob("*.yaml")):
        times, chosen = [], ""
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "dora.cli", "plan", str(path), "--json"], cwd=REPO,
                                  capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if proc.returncode != 0:
                raise SystemExit(f"dora plan {path.name} failed:\n{proc.stderr}")
            plan = json.loads(proc.stdout)
            chosen = f"{plan['mode']} k={plan['max_version_lag']}, {plan['predictions']['speedup_vs_sync']:.2f}x sync"
            accs = plan["rollout"]["accelerators"] + (0 if plan["colocated"] else plan["train"]["accelerators"])
        print(f"{path.stem:28} {accs:12d} {statistics.median(times):9.2f} {min(times):7.2f} {max(times):7.2f}  {chosen}")


if __name__ == "__main__":
    main()
