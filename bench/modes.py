"""Print simulated throughput of every scheduling mode on every example spec.

Placements are fixed illustrative layouts per example (half the accelerators roll out, half train;
the colocated sync variant uses all of them for both) until the planner search chooses them.
Usage: python bench/modes.py [--steps N] [--only NAME] [--timeline DIR]
"""

from __future__ import annotations

import argparse
import os
import time

from planner.architecture import get_preset
from planner.hardware import get_accelerator
from planner.policies import PolicyConfig
from planner.sim import simulate
from planner.sim.costmodel import cost_model_timing
from planner.workload import LengthDistribution, Workload

# name: preset, accelerators, rollout tp, rollout ep, slots, trainer (tp, pp, dp, ep), prompts, samples,
#       prompt median, response (median, p99, max), k
EXAMPLES = {
    "dense-8b-h800x64": ("qwen3-8b", 64, 2, 1, 256, (4, 1, 8, 1), 256, 16, 300, (1500, 12000, 16384), 2),
    "dense-32b-h800x128": ("qwen2.5-32b", 128, 4, 1, 256, (8, 2, 4, 1), 512, 16, 400, (3000, 24000, 30720), 3),
    "moe-235b-h800x512": ("qwen3-235b-a22b", 512, 16, 16, 384, (4, 4, 16, 8), 512, 16, 400, (4000, 28000, 32768), 2),
    "moe-560b-x4096": ("longcat-flash", 4096, 32, 32, 512, (8, 8, 32, 16), 2048, 16, 500, (4000, 40000, 65536), 3),
    "moe-scale-x10240": ("longcat-flash", 10240, 32, 32, 512, (8, 8, 80, 16), 4096, 16, 500, (4000, 40000, 65536), 3),
}
MODES = ("sync-colocated", "sync", "one-step-off", "bounded-async", "partial-rollout", "streaming")


def setup(name: str, mode: str, steps: int):
    preset, accs, r_tp, r_ep, slots, (t_tp, t_pp, t_dp, t_ep), prompts, spp, prompt, resp, k = EXAMPLES[name]
    arch, acc = get_preset(preset), get_accelerator("h800")
    colocated = mode == "sync-colocated"
    rollout_accs = accs if colocated else accs - t_tp * t_pp * t_dp
    groups = rollout_accs // r_tp
    if colocated:
        t_dp = accs // (t_tp * t_pp)
    timing = cost_model_timing(arch, rollout_acc=acc, train_acc=acc, rollout_tp=r_tp, rollout_ep=r_ep,
                               num_rollout_groups=groups, train_tp=t_tp, train_pp=t_pp, train_dp=t_dp,
                               train_ep=t_ep, colocated=colocated)
    base = "sync" if colocated else mode
    cfg = PolicyConfig(mode=base, max_version_lag=0 if base == "sync" else k, num_rollout_groups=groups,
                       slots_per_group=slots, prompts_per_step=prompts, samples_per_prompt=spp, total_steps=steps,
                       allow_version_mixing=mode == "partial-rollout", colocated=colocated)
    median, p99, cap = resp
    work = Workload(response_length=LengthDistribution.lognormal(median=median, p99=p99, max_tokens=cap),
                    prompt_tokens=prompt)
    return cfg, work, timing, r_tp, t_tp * t_pp * t_dp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", default=None)
    ap.add_argument("--timeline", default=None, help="write sync/streaming timeline HTML here (small specs)")
    args = ap.parse_args()
    for name in EXAMPLES:
        if args.only and args.only != name:
            continue
        print(f"\n== {name} ({args.steps} steps)")
        print(f"{'mode':16} {'step_s':>8} {'samples/s':>10} {'x sync':>7} {'bubble':>7} {'slots':>6} "
              f"{'stale':>6} {'live':>5} {'sync_s':>7} {'sim_s':>6}")
        sync_sps = None
        for mode in MODES:
            cfg, work, timing, apg, train_accs = setup(name, mode, args.steps)
            record = bool(args.timeline) and mode in ("sync", "streaming")
            t0 = time.perf_counter()
            r = simulate(cfg, work, timing, seed=0, record_events=record, accelerators_per_group=apg,
                         train_accelerators=train_accs)
            wall = time.perf_counter() - t0
            if mode == "sync":
                sync_sps = r.samples_per_s
            n = sum(c for _, c in r.staleness_histogram)
            stale = sum(s * c for s, c in r.staleness_histogram) / n
            ratio = r.samples_per_s / sync_sps if sync_sps else float("nan")
            print(f"{mode:16} {r.step_time_s:8.1f} {r.samples_per_s:10.1f} {ratio:7.2f} {r.bubble_fraction:7.3f} "
                  f"{r.rollout_slot_occupancy:6.3f} {stale:6.2f} {r.max_live_versions:5d} "
                  f"{timing.weight_load_trainer_s + timing.weight_publish_s:7.2f} {wall:6.2f}")
            if record:
                from planner.schedule import timeline_html

                os.makedirs(args.timeline, exist_ok=True)
                path = os.path.join(args.timeline, f"{name}-{mode}.html")
                with open(path, "w") as f:
                    f.write(timeline_html(list(r.events), title=f"{name} {mode}"))
                print(f"   timeline: {path}")


if __name__ == "__main__":
    main()
