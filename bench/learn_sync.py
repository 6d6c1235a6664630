"""A plain synchronous RL loop (no Ray) that shows the local task is learnable.

Each step: load the newest weights into the rollout engine, generate
``prompts_per_step`` groups of ``group_size`` responses (continuous batching,
each prompt with its response budget ``L`` drawn from the long-tailed length
distribution; the step waits for the longest response: the synchronous tail),
score them, one GRPO train step. Prints per step: reward, mean / p99 / max response length,
rollout time, train time and the rollout share of the step, then a summary.

    python bench/learn_sync.py                    # defaults: 150 steps, 16 x 8 responses, 2 threads
    python bench/learn_sync.py --cache-dir out/   # reuse the warm-up weights on the next run
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from dora.runtime.engines.base import GenerationRequest, ScoredTrajectory
from dora.runtime.engines.tiny_model import TinyModelConfig
from dora.runtime.engines.torch_rollout import RolloutConfig, TorchRolloutEngine
from dora.runtime.engines.torch_trainer import TorchTrainer, TrainerConfig, warm_up
from dora.runtime.tasks import TaskConfig, make_prompts, score
from planner.workload import LengthDistribution


def _quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--correction", default="tis", choices=["none", "tis", "decoupled-ppo"])
    ap.add_argument("--warmup-steps", type=int, default=TaskConfig().warmup_steps)
    ap.add_argument("--warmup-smoothing", type=float, default=TaskConfig().warmup_label_smoothing)
    ap.add_argument("--median", type=float, default=8.0)
    ap.add_argument("--p99", type=float, default=80.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", type=Path, default=None, help="cache the warm-up weights here")
    args = ap.parse_args()

    task = TaskConfig(warmup_steps=args.warmup_steps, warmup_label_smoothing=args.warmup_smoothing)
    lengths = LengthDistribution.lognormal(median=args.median, p99=args.p99, max_tokens=args.max_tokens)
    model = TinyModelConfig(vocab_size=task.vocab_size)
    max_model_len = 4 + args.max_tokens + 1
    trainer = TorchTrainer(TrainerConfig(
        model=model, learning_rate=args.lr, off_policy_correction=args.correction, num_threads=args.threads,
        seed=args.seed,
    ))
    engine = TorchRolloutEngine(RolloutConfig(
        model=model, eos_token_id=task.eos_token_id, max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len, num_threads=args.threads,
    ))
    t0 = time.perf_counter()
    losses = warm_up(trainer, task, lengths, seed=args.seed, cache_dir=args.cache_dir)
    print(f"warm-up: {len(losses)} steps in {time.perf_counter() - t0:.1f}s, "
          f"loss {losses[0] if losses else float('nan'):.3f} -> {losses[-1] if losses else float('nan'):.3f}")
    print(f"model: {model.num_params()} params; task vocab {task.vocab_size}; "
          f"{args.prompts_per_step}x{args.group_size} responses/step; threads {args.threads}")
    print(f"{'step':>4} {'reward':>6} {'exact':>5} {'len_mean':>8} {'len_p99':>7} {'len_max':>7} "
          f"{'rollout_s':>9} {'train_s':>7} {'share':>5} {'isw_max':>7}")
    rng = random.Random(args.seed + 1)
    rewards, rollout_s_all, train_s_all, all_lengths = [], [], [], []
    run_start = time.perf_counter()
    for step in range(args.steps):
        version, weights = trainer.export_weights()
        engine.load_weights(version, weights)
        for old in engine.hosted_versions():
            if old != version:
                engine.drop_version(old)
        prompts = make_prompts(task, lengths, rng, args.prompts_per_step, prefix=f"s{step}-")
        by_request = {}
        for p in prompts:
            for j in range(args.group_size):
                rid = f"{p.prompt_id}-{j}"
                by_request[rid] = p
                engine.add_request(GenerationRequest(
                    request_id=rid, prompt_ids=p.prompt_ids, version=version,
                    max_new_tokens=p.max_new_tokens, min_new_tokens=p.min_new_tokens, seed=rng.getrandbits(63),
                ))
        start = time.perf_counter()
        finished = []
        while engine.num_active() or engine.num_waiting():
            finished.extend(engine.step())
        rollout_s = time.perf_counter() - start
        batch = [ScoredTrajectory(trajectory=t, reward=score(by_request[t.request_id], t.response_ids),
                                  group_id=by_request[t.request_id].prompt_id) for t in finished]
        metrics = trainer.train_step(batch)
        lens = [len(t.response_ids) for t in finished]
        exact = sum(s.reward == 1.0 for s in batch) / len(batch)
        rewards.append(metrics.reward_mean)
        rollout_s_all.append(rollout_s)
        train_s_all.append(metrics.train_time_s)
        all_lengths.extend(lens)
        print(f"{step:4d} {metrics.reward_mean:6.3f} {exact:5.2f} {statistics.mean(lens):8.1f} "
              f"{_quantile(lens, 0.99):7.0f} {max(lens):7d} {rollout_s:9.3f} {metrics.train_time_s:7.3f} "
              f"{rollout_s / (rollout_s + metrics.train_time_s):5.2f} {metrics.is_weight_max:7.3f}", flush=True)
    k = max(1, len(rewards) // 10)
    total_r, total_t = sum(rollout_s_all), sum(train_s_all)
    print(f"summary: reward first {k} steps {statistics.mean(rewards[:k]):.3f} -> last {k} steps "
          f"{statistics.mean(rewards[-k:]):.3f}; run {time.perf_counter() - run_start:.0f}s; rollout share "
          f"{total_r / (total_r + total_t):.2f}; response length median {statistics.median(all_lengths):.0f} "
          f"p99 {_quantile(all_lengths, 0.99):.0f} (p99/median {_quantile(all_lengths, 0.99) / statistics.median(all_lengths):.1f})")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
