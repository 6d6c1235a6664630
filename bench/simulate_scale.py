"""Time the simulator on the 10,240-accelerator MoE example (cheap mode, no per-trajectory trace).

Usage: python bench/simulate_scale.py [--steps 10] [--mode streaming]
Prints wall time, simulated events, events/s and trajectories/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from modes import setup  # noqa: E402

from planner.sim import simulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mode", default="streaming")
    ap.add_argument("--spec", default="moe-scale-x10240")
    args = ap.parse_args()
    cfg, work, timing, apg, train_accs = setup(args.spec, args.mode, args.steps)
    t0 = time.perf_counter()
    r = simulate(cfg, work, timing, seed=0, record_events=False, accelerators_per_group=apg,
                 train_accelerators=train_accs)
    wall = time.perf_counter() - t0
    trajs = len(r.steps) * cfg.batch_samples + r.unfinished_at_end
    print(f"{args.spec} {args.mode}: {cfg.num_rollout_groups} replicas x {cfg.slots_per_group} slots, "
          f"{cfg.prompts_per_step}x{cfg.samples_per_prompt} per step, {args.steps} steps")
    print(f"wall {wall:.2f} s, {r.num_sim_events} events ({r.num_sim_events / wall:,.0f} events/s), "
          f"~{trajs / wall:,.0f} trajectories/s; simulated step time {r.step_time_s:.1f} s")


if __name__ == "__main__":
    main()
