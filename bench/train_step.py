"""Time of one CPU ``TorchTrainer.train_step`` on batches shaped like specs/local-tiny.yaml's.

The trainer is built from the spec exactly as ``dora apply`` builds it (``driver.controller_config``: model, pack
length, optimiser, loss, thread count). Each batch is ``prompts_per_step x samples_per_prompt`` count-task
trajectories: one length per prompt drawn from the spec's response-length distribution (the task enforces it, so a
group's samples share it), the correct answer with each token wrong with probability ``--error-rate`` (so rewards
and advantages vary within groups), behaviour log-probs the trainer's own plus Gaussian noise (importance weights
near 1, some past the TIS cap), and staleness of 0-3 versions.

Prints ms per ``train_step`` -- median over ``--steps`` steps (after ``--warmup``), cycling over ``--batches``
distinct batches -- for each of ``--repeats`` repeats, then the median and [min-max] of the repeats' medians.
``--profile`` prints torch.profiler's table (self CPU time by op) and cProfile's top functions instead.

    python bench/train_step.py
    PYTHONPATH=/tmp/trainer-old python bench/train_step.py     # another checkout's trainer, same batches
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import random
import statistics
import time

import torch

import dora
from dora.apply import ApplyOverrides, runtime_config_for
from dora.runtime.driver import controller_config
from dora.runtime.engines.base import FinishedTrajectory, ScoredTrajectory
from dora.runtime.engines.torch_trainer import TorchTrainer, pack, token_logprobs
from dora.runtime.tasks import make_prompts, score
from dora.spec import load_spec


def make_batch(trainer: TorchTrainer, cc, rng: random.Random, *, error_rate: float, version: int,
               noise: float) -> list[ScoredTrajectory]:
    prompts = make_prompts(cc.task, cc.response_lengths, rng, cc.policy.prompts_per_step)
    vocab = trainer.config.model.vocab_size
    pairs, meta = [], []
    for p in prompts:
        for s in range(cc.policy.samples_per_prompt):
            response = tuple(rng.randrange(vocab) if rng.random() < error_rate else t for t in p.target_ids)
            pairs.append((p.prompt_ids, response))
            meta.append((p, s))
    with torch.no_grad():
        own = token_logprobs(trainer.model, pack(pairs, trainer.config.pack_len)).tolist()
    batch, at = [], 0
    for (prompt_ids, response), (p, s) in zip(pairs, meta, strict=True):
        behaviour = tuple(lp + rng.gauss(0.0, noise) for lp in own[at : at + len(response)])
        at += len(response)
        traj = FinishedTrajectory(
            request_id=f"{p.prompt_id}-{s}", prompt_ids=prompt_ids, response_ids=response,
            behaviour_logprobs=behaviour, version_spans=((max(0, version - rng.randrange(4)), len(response)),),
            finish_reason="stop",
        )
        batch.append(ScoredTrajectory(trajectory=traj, reward=score(p, response), group_id=p.prompt_id))
    return batch


def time_steps(trainer: TorchTrainer, batches: list[list[ScoredTrajectory]], steps: int, warmup: int) -> list[float]:
    """ms per ``train_step`` (wall clock around the call), ``warmup`` steps dropped."""
    samples = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        trainer.train_step(batches[i % len(batches)])
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    return samples


def profile(trainer: TorchTrainer, batches: list[list[ScoredTrajectory]], steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for b in batches[:3]:
        trainer.train_step(b)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            trainer.train_step(batches[i % len(batches)])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    print(f"(per step: divide by {steps})")
    pr = cProfile.Profile()
    pr.enable()
    for i in range(steps):
        trainer.train_step(batches[i % len(batches)])
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/local-tiny.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=10, help="distinct batches, cycled over")
    ap.add_argument("--error-rate", type=float, default=0.05)
    ap.add_argument("--noise", type=float, default=0.3, help="std of log mu - log pi (nats)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the trainer (default: the plan's; a colocated plan gives it every core)")
    args = ap.parse_args()

    cc = controller_config(runtime_config_for(load_spec(args.spec), ApplyOverrides()))
    if args.threads is not None:
        cc = dataclasses.replace(cc, trainer=dataclasses.replace(cc.trainer, num_threads=args.threads))
    trainer = TorchTrainer(cc.trainer)  # sets torch's thread count to the plan's (or --threads)
    rng = random.Random(args.seed)
    batches = [make_batch(trainer, cc, rng, error_rate=args.error_rate, version=5, noise=args.noise)
               for _ in range(args.batches)]
    lengths = [len(s.trajectory.response_ids) for b in batches for s in b]
    print(f"dora from {dora.__file__}; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"batch: {len(batches[0])} trajectories; response tokens median {statistics.median(lengths):.0f}, "
          f"mean {statistics.fmean(lengths):.1f}, max {max(lengths)}; pack_len {cc.trainer.pack_len}")
    if args.profile:
        profile(trainer, batches, args.steps)
        return
    medians = []
    for r in range(args.repeats):
        samples = time_steps(trainer, batches, args.steps, args.warmup)
        q = statistics.quantiles(samples, n=10)
        medians.append(statistics.median(samples))
        print(f"  repeat {r}: median {medians[-1]:6.1f} ms, p10 {q[0]:6.1f}, p90 {q[-1]:6.1f}", flush=True)
    print(f"train_step ms: {statistics.median(medians):.1f} [{min(medians):.1f}-{max(medians):.1f}] "
          f"(median [min-max] of {args.repeats} repeats' medians)")


if __name__ == "__main__":
    main()
