"""Decode step time of the CPU rollout engine: batch x context, and the cost of hosting several versions.

Table 1: ms per batched decode step (one token for each of ``B`` slots whose
cached context is ``C`` tokens), median over ``--iters`` steps, repeated
``--repeats`` times; printed as ``median [min-max over repeats]``.

Table 2: ms per decode *iteration* of a multi-version engine -- ``B`` active
sequences spread round-robin over ``V`` hosted versions -- done two ways: ``V``
separate forwards over scattered slots (gathered from the shared cache), and one
``decode_versions`` pass (weights stacked per version, one batched matmul per
linear over rows padded per version; rotary, cache and attention once).

Table 3: trainer throughput (packed GRPO step, tokens per second).

    python bench/engine_speed.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dora.runtime.engines.base import FinishedTrajectory, ScoredTrajectory
from dora.runtime.engines.tiny_model import (
    KVCache,
    TinyModelConfig,
    TinyTransformer,
    decode_versions,
    export_weights,
    stack_versions,
)
from dora.runtime.engines.torch_trainer import TorchTrainer, TrainerConfig
from dora.runtime.tasks import TaskConfig


def _time_ms(fn, iters: int) -> float:
    fn()  # warm the allocator and kernels
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} [{min(values):.2f}-{max(values):.2f}]"


@torch.no_grad()
def decode_table(config: TinyModelConfig, batches: list[int], contexts: list[int], iters: int, repeats: int) -> None:
    model = TinyTransformer(config).eval()
    print(f"decode ms/step, model {config.num_params()} params; rows: batch, columns: context tokens")
    print("batch " + "".join(f"{c:>22}" for c in contexts))
    for b in batches:
        cache = KVCache(config, num_slots=b, max_len=max(contexts) + 1)
        cache.k.normal_()
        cache.v.normal_()
        tokens, slots = torch.randint(0, config.vocab_size, (b,)), torch.arange(b)
        row = []
        for c in contexts:
            positions = torch.full((b,), c)

            def step(tokens=tokens, positions=positions, cache=cache, slots=slots) -> None:
                model.decode(tokens, positions, cache, slots)

            row.append(_cell([_time_ms(step, iters) for _ in range(repeats)]))
        print(f"{b:5d} " + "".join(f"{x:>22}" for x in row), flush=True)


@torch.no_grad()
def multi_version_table(config: TinyModelConfig, batches: list[int], context: int, iters: int, repeats: int) -> None:
    models = [TinyTransformer(config, seed=s).eval() for s in range(4)]
    print(f"\nmulti-version decode ms/iteration at context {context}: B slots spread round-robin over V versions;")
    print("'separate': one forward per version over its scattered slots; 'one pass': decode_versions "
          "(stacked weights, batched matmuls)")
    print("batch " + "".join(f"{f'V={k} {how}':>24}" for k in (1, 2, 3) for how in ("separate", "one pass")))
    for b in batches:
        cache = KVCache(config, num_slots=b, max_len=context + 1)
        cache.k.normal_()
        cache.v.normal_()
        tokens, positions = torch.randint(0, config.vocab_size, (b,)), torch.full((b,), context)
        all_slots = torch.arange(b)
        row = []
        for k in (1, 2, 3):
            groups = [torch.arange(v, b, k) for v in range(k) if v < b]

            def separate(groups=groups, tokens=tokens, positions=positions, cache=cache) -> None:
                for v, slots in enumerate(groups):
                    models[v].decode(tokens[slots], positions[slots], cache, slots)

            stacked, index = stack_versions(models[:k]), torch.arange(b) % k

            def one_pass(k=k, tokens=tokens, positions=positions, cache=cache, all_slots=all_slots,
                         stacked=stacked, index=index) -> None:
                if k == 1:
                    models[0].decode(tokens, positions, cache, all_slots)
                else:
                    decode_versions(config, stacked, index, tokens, positions, cache, all_slots)

            row.append(_cell([_time_ms(separate, iters) for _ in range(repeats)]))
            row.append(_cell([_time_ms(one_pass, iters) for _ in range(repeats)]))
        print(f"{b:5d} " + "".join(f"{x:>24}" for x in row), flush=True)


def train_table(config: TinyModelConfig, repeats: int) -> None:
    print("\ntrainer: packed GRPO step (response 8..128 tokens, prompt 4)")
    gen = torch.Generator().manual_seed(0)
    for n_seqs, resp in ((64, 8), (64, 32), (16, 128)):
        batch = []
        for i in range(n_seqs):
            traj = FinishedTrajectory(
                request_id=str(i), prompt_ids=(0, 5, 9, 2),
                response_ids=tuple(torch.randint(3, config.vocab_size, (resp,), generator=gen).tolist()),
                behaviour_logprobs=tuple([-5.0] * resp), version_spans=((0, resp),), finish_reason="stop",
            )
            batch.append(ScoredTrajectory(trajectory=traj, reward=float(i % 3), group_id=str(i // 8)))
        trainer = TorchTrainer(TrainerConfig(model=config, num_threads=torch.get_num_threads()),
                               initial_weights=export_weights(TinyTransformer(config)))
        trainer.train_step(batch)
        times = [trainer.train_step(batch).train_time_s for _ in range(repeats)]
        tokens = n_seqs * (resp + 4)
        print(f"  {n_seqs:3d} x {resp:3d} tokens: {_cell([t * 1e3 for t in times])} ms/step, "
              f"{tokens / statistics.median(times):8.0f} forward tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = TinyModelConfig(vocab_size=TaskConfig().vocab_size)
    batches = [1, 8, 32, 64, 128] if not args.quick else [1, 32, 128]
    contexts = [16, 64, 128, 256] if not args.quick else [16, 128]
    print(f"threads {args.threads}")
    decode_table(config, batches, contexts, args.iters, args.repeats)
    multi_version_table(config, [8, 32, 128], 64, args.iters, args.repeats)
    train_table(config, args.repeats)


if __name__ == "__main__":
    main()
