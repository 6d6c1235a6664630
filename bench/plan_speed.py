"""Time `dora plan SPEC` end to end (a fresh process each run, as a user runs it) on every example spec.

Target: the 10,240-accelerator MoE spec plans in at most 10 s on a 2-core machine.
``--both`` also times each spec from the Python sources (``DORA_PURE_PYTHON=1``; the install compiles the simulator,
``planner/_native.py``), the two runs interleaved so that both see the same minutes of this noisy machine.
``--tree DIR`` (repeatable) also times another source tree, e.g. a ``git worktree`` of an earlier commit built with
``python hatch_build.py``, alternated with this one in the same way; the plans must match, spec file name aside.
Usage: python bench/plan_speed.py [--repeat N] [--both] [--tree DIR ...] [--spec NAME ...]
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
    ap.add_argument("--tree", type=Path, action="append", default=[],
                    help="another source tree to time beside this one (repeatable)")
    ap.add_argument("--spec", action="append", default=[], help="only this example spec (its name; repeatable)")
    args = ap.parse_args()
    from planner import _native

    print(f"planner: {_native.STATUS}")
    trees = [REPO, *(t.resolve() for t in args.tree)]
    for tree in trees[1:]:
        if not (tree / "planner" / "__init__.py").is_file():
            raise SystemExit(f"--tree {tree}: no planner/ there")
    variants: dict[str, tuple[Path, dict[str, str]]] = {}
    for tree in trees:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        label = "" if tree == REPO else str(tree)
        variants[label] = (tree, env)
        if args.both:
            variants[f"{label} python".strip()] = (tree, {**env, "DORA_PURE_PYTHON": "1"})
    print(f"{'spec':28} {'accelerators':>12} {'median s':>9} {'min s':>7} {'max s':>7}  chosen")
    paths = sorted((REPO / "specs").glob("*.yaml"))
    if args.spec:
        unknown = sorted(set(args.spec) - {p.stem for p in paths})
        if unknown:
            raise SystemExit(f"--spec {', '.join(unknown)}: not an example spec ({', '.join(p.stem for p in paths)})")
        paths = [p for p in paths if p.stem in args.spec]
    for path in paths:
        times: dict[str, list[float]] = {name: [] for name in variants}
        plans: dict[str, str] = {}
        for _ in range(args.repeat):
            for name, (tree, env) in variants.items():
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "dora.cli", "plan", str(path), "--json"], cwd=tree,
                                      capture_output=True, text=True, env=env)
                times[name].append(time.perf_counter() - t0)
                if proc.returncode != 0:
                    raise SystemExit(f"dora plan {path.name} ({tree}) failed:\n{proc.stderr}")
                plans[name] = json.dumps({k: v for k, v in json.loads(proc.stdout).items() if k != "spec_file"})
        if len(set(plans.values())) > 1:
            raise SystemExit(f"{path.name}: the variants chose different plans ({', '.join(plans)})")
        plan = json.loads(plans[""])
        pred = plan["predictions"]
        chosen = f"{plan['mode']} k={plan['max_version_lag']}, " + (
            f"{pred['speedup_vs_sync']:.2f}x sync" if pred["speedup_vs_sync_any_placement"] is None else
            f"{pred['speedup_vs_sync_any_placement']:.2f}x sync ({pred['speedup_vs_sync']:.2f}x on the pinned "
            "placement)")
        accs = plan["rollout"]["accelerators"] + (0 if plan["colocated"] else plan["train"]["accelerators"])
        for name, ts in times.items():
            label = f"{path.stem} ({name})" if name else path.stem
            extra = (f"  {statistics.median(ts) / statistics.median(times['']):.2f}x this checkout's median"
                     if name else f"  {chosen}")
            print(f"{label:28} {accs:12d} {statistics.median(ts):9.2f} {min(ts):7.2f} {max(ts):7.2f}{extra}")


if __name__ == "__main__":
    main()
