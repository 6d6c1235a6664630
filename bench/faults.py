"""Inject faults into a real local-tiny run and print, per fault, the time to recover and trajectories lost.

    python bench/faults.py [--kills 5] [--steps 10] [--seed 7]

Two experiments on the shortened local-tiny spec (streaming, 2 rollout workers x 16 slots):
1. rollout worker kills: one in-process run; a worker process is killed (``ray.kill`` with restart,
   or ``SIGKILL`` of its PID) at random points. Two intervals, one after the other: restart_s = kill -> Ray has
   restarted the process (the killer blocks the controller meanwhile, so the controller sees each death once:
   ``dora.runtime.faults.WorkerKiller``); recovery_s = the controller noticed the death -> the worker serves again
   (weights reloaded, its requests regenerated). total_s, their sum, is what a kill costs.
2. kill -9 of the whole run: ``python -m dora.runtime.driver`` (what ``dora apply`` and the Ray job run,
   with its own local Ray each attempt) is SIGKILLed with its process group at random points and re-run;
   recovery_s = total_s = re-run -> first step trained after the checkpoint (includes Ray start and actor start).
Lost and duplicated trajectories are counted from the combined trace (``dora.runtime.faults.ledger``);
both must be 0, and the planner's checker must pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--keep", action="store_true", help="keep the runs' directory (its path is printed)")
    args = ap.parse_args()
    import ray
    from test_apply_local import _short_spec

    from dora.apply import ApplyOverrides, runtime_config_for
    from dora.runtime.controller import Controller
    from dora.runtime.driver import controller_config
    from dora.runtime.faults import WorkerKiller, kill_and_resume, ledger
    from dora.runtime.trace import read_jsonl
    from dora.spec import load_spec
    from planner.schedule import check_trace

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = Path(tempfile.mkdtemp(prefix="dora-faults-"))
    rng = random.Random(args.seed)
    rc = runtime_config_for(load_spec(str(_short_spec(tmp))), ApplyOverrides(
        mode="streaming", steps=args.steps, rollout_workers=2, max_num_seqs=16, output_dir=str(tmp / "workers")))
    rows = []
    # 1. rollout worker kills
    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        controller = Controller(controller_config(rc, cpus=os.cpu_count() or 2))
        killer = WorkerKiller(controller, [rng.randint(1, 8) for _ in range(args.kills)], rng)
        controller.on_progress = killer
        stats = controller.run()
    finally:
        ray.shutdown()
    trace = tmp / "workers" / "trace.jsonl"
    counts = ledger(trace)
    ok = check_trace(read_jsonl(trace), k=rc.max_version_lag, allow_version_mixing=False).ok
    for kill, seconds in zip(killer.kills, stats.recovery_s, strict=False):
        rows.append((f"worker {kill['worker']} {kill['method']}", f"{kill['in_flight']} held at kill",
                     kill["restart_s"], seconds))
    made = "" if len(killer.kills) == args.kills else f" of {args.kills} asked (the run ended first)"
    print(f"rollout worker kills: {len(killer.kills)}{made}, audit {'ok' if ok else 'FAILED'}, lost {counts['lost']}, "
          f"duplicated {counts['duplicated']}, regenerated {counts['regenerated']} (a request the worker finished "
          "before the kill took effect is delivered, not regenerated: 'held at kill' is the controller's count then)")
    # 2. kill -9 of the whole run, resumed by re-running the same command
    runtime = tmp / "runtime.json"
    runtime.write_text(dataclasses.replace(rc, output_dir=str(tmp / "killed")).to_json())
    code, faults, err = kill_and_resume(
        [sys.executable, "-m", "dora.runtime.driver", "--config", str(runtime), "--no-live"],
        trace=tmp / "killed" / "trace.jsonl", kills=args.kills, rng=rng, cwd=tmp, min_new_events=5,
        max_new_events=60, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, attempt_timeout_s=300)
    trace2 = tmp / "killed" / "trace.jsonl"
    counts2 = ledger(trace2)
    ok2 = code == 0 and check_trace(read_jsonl(trace2), k=rc.max_version_lag, allow_version_mixing=False).ok
    for f in faults:
        rows.append((f"kill -9 run (after step {f['last_step']})", f"{f['after_events']} finishes in", None,
                     f["recovery_s"]))
    made = "" if len(faults) == args.kills else f" of {args.kills} asked (the run ended first)"
    print(f"kill -9 of the run: {len(faults)}{made}, final exit {code}, audit {'ok' if ok2 else 'FAILED'}, "
          f"lost {counts2['lost']}, duplicated {counts2['duplicated']}, regenerated {counts2['regenerated']}")
    print(f"\n{'fault':<34} {'when':<18} {'restart_s':>9} {'recovery_s':>10} {'total_s':>8}  lost")
    for name, when, restart, recovery in rows:
        lost = counts["lost"] if name.startswith("worker") else counts2["lost"]
        total = None if recovery is None else round((restart or 0.0) + recovery, 3)
        print(f"{name:<34} {when:<18} {_seconds(restart):>9} {_seconds(recovery):>10} {_seconds(total):>8}  {lost}")
    if any(recovery is None for *_, recovery in rows):
        print("(- in recovery_s: the next kill came before the re-run trained a step, so none was measured; "
              "- in restart_s: a whole run has no restart apart from its re-run)")
    else:
        print("(- in restart_s: a whole run has no restart apart from its re-run)")
    print(json.dumps({"worker": counts, "process": counts2}, sort_keys=True))
    if code != 0:
        print(err[-2000:], file=sys.stderr)
    if args.keep:
        print(f"runs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok and ok2 and counts["lost"] == counts2["lost"] == 0 and not counts["duplicated"] \
        and not counts2["duplicated"] else 1


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


if __name__ == "__main__":
    sys.exit(main())
