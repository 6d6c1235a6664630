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

``--engine``: instead, ms per ``TorchRolloutEngine.step()`` as the job runs it -- ``B`` slots kept full from a
stream of count-task requests (4-token prompts ingested through the decode batch, response lengths from the
``local-tiny`` workload: median 8, p99 96, max 128, EOS masked until the last token), groups of 8 spread
round-robin over ``V`` hosted versions; plus a digest of every finished trajectory (tokens and log-probs), so two
checkouts can be compared for identical output. ``--profile`` adds torch.profiler's self-CPU table and
cProfile's top functions for the first configuration. ``--engines torch vllm`` times vLLM's engine
(``VLLMRolloutEngine``, its CPU backend) beside the torch engine, alternating them in each repeat, on
``specs/local-tiny-vllm.yaml``'s model (2 heads of 32: vLLM's CPU attention takes none under 32) for both, one version
per engine (vLLM hosts one), and prints their ratio; the digests differ (vLLM draws its own sampling noise).

    python bench/engine_speed.py --threads 1
    python bench/engine_speed.py --engine --configs 64x1 64x3 16x1 [--profile]
    python bench/engine_speed.py --engine --engines torch vllm --configs 8x1 40x1
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import random
import statistics
import struct
import time
from typing import Literal

import torch

from dora.runtime.actors import rollout_engine
from dora.runtime.engines.base import FinishedTrajectory, GenerationRequest, ScoredTrajectory
from dora.runtime.engines.tiny_model import (
    KVCache,
    TinyModelConfig,
    TinyTransformer,
    decode_versions,
    export_weights,
    stack_versions,
)
from dora.runtime.engines.torch_rollout import RolloutConfig
from dora.runtime.engines.torch_trainer import TorchTrainer, TrainerConfig
from dora.runtime.tasks import TaskConfig, make_prompt
from planner.workload import LengthDistribution


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


Engine = Literal["torch", "vllm"]


class _EngineRun:
    """A rollout engine kept at ``batch`` active sequences (plus one queued group) over ``versions``."""

    def __init__(self, config: TinyModelConfig, batch: int, versions: int, engine: Engine = "torch") -> None:
        task = TaskConfig()
        self.lengths = LengthDistribution.lognormal(median=8, p99=96, max_tokens=128)
        self.engine = rollout_engine(RolloutConfig(
            model=config, engine=engine, eos_token_id=task.eos_token_id, max_num_seqs=batch,
            max_model_len=4 + 128 + 1, num_threads=torch.get_num_threads()))
        for v in range(versions):
            self.engine.load_weights(v, export_weights(TinyTransformer(config, seed=v)))
        self.task, self.batch, self.versions = task, batch, versions
        self.rng, self.groups = random.Random(0), 0
        self.digest = hashlib.sha256()

    def step(self) -> None:
        while self.engine.num_active() + self.engine.num_waiting() < self.batch + 8:
            g = self.groups
            prompt = make_prompt(self.task, self.lengths, self.rng, f"g{g}")
            for i in range(8):
                self.engine.add_request(GenerationRequest(
                    request_id=f"g{g}/{i}", prompt_ids=prompt.prompt_ids, version=g % self.versions,
                    max_new_tokens=prompt.max_new_tokens, min_new_tokens=prompt.min_new_tokens, seed=g * 8 + i))
            self.groups += 1
        for t in self.engine.step():
            self.digest.update(t.request_id.encode() + struct.pack(f"{len(t.response_ids)}q", *t.response_ids)
                               + struct.pack(f"{len(t.behaviour_logprobs)}f", *t.behaviour_logprobs))


def engine_table(config: TinyModelConfig, shapes: list[tuple[int, int]], steps: int, repeats: int,
                 profile: bool, engines: tuple[Engine, ...] = ("torch",)) -> None:
    print(f"engine ms/step ({'/'.join(engines)} engine step(), {steps} steps after 300 warm-up), "
          "median [min-max over repeats]; digest of the finished trajectories")
    for batch, versions in shapes:
        medians: dict[str, list[float]] = {e: [] for e in engines}
        digests: dict[str, set[str]] = {e: set() for e in engines}
        for _ in range(repeats):
            for engine in engines:  # alternating: the machine's drift falls on every engine alike
                run = _EngineRun(config, batch, versions, engine)
                for _ in range(300):  # past the first admissions: a steady mix of ingesting and long-running rows
                    run.step()
                samples = []
                for _ in range(steps):
                    start = time.perf_counter()
                    run.step()
                    samples.append((time.perf_counter() - start) * 1e3)
                medians[engine].append(statistics.median(samples))
                digests[engine].add(run.digest.hexdigest()[:16])
        for engine in engines:
            ratio = ("" if engine == engines[0] else
                     f"  {statistics.median(medians[engine]) / statistics.median(medians[engines[0]]):.2f}x "
                     f"{engines[0]}'s")
            print(f"  B={batch:3d} V={versions} {engine:>5}: {_cell(medians[engine])} ms/step{ratio}  digest "
                  f"{' '.join(sorted(digests[engine]))}", flush=True)
    if profile:
        batch, versions = shapes[0]
        run = _EngineRun(config, batch, versions)
        for _ in range(300):
            run.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                run.step()
        print(f"\ntorch.profiler, B={batch} V={versions}, {steps} steps (self CPU):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            run.step()
        profiler.disable()
        print(f"cProfile, B={batch} V={versions}, {steps} steps (by own time):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    ap.add_argument("--engine", action="store_true", help="time TorchRolloutEngine.step() instead (see the doc)")
    ap.add_argument("--configs", nargs="+", default=["64x1", "64x3", "16x1"], help="--engine: BATCHxVERSIONS")
    ap.add_argument("--steps", type=int, default=500, help="--engine: timed steps per repeat")
    ap.add_argument("--profile", action="store_true", help="--engine: profile the first configuration")
    ap.add_argument("--engines", nargs="+", choices=["torch", "vllm"], default=["torch"],
                    help="--engine: the rollout engines to time, side by side (vllm: local-tiny-vllm's model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = TinyModelConfig(vocab_size=TaskConfig().vocab_size)
    if args.engine:
        shapes = [(int(b), int(v)) for b, v in (c.split("x") for c in args.configs)]
        if "vllm" in args.engines:  # local-tiny-vllm's model, for every engine timed: like with like
            config = TinyModelConfig(vocab_size=TaskConfig().vocab_size, num_heads=2, num_kv_heads=2, head_dim=32)
            if any(v != 1 for _, v in shapes):
                ap.error("--engines vllm: a vLLM engine hosts one version, so every --configs entry is BATCHx1")
        engine_table(config, shapes, args.steps, args.repeats, args.profile, tuple(args.engines))
        return
    batches = [1, 8, 32, 64, 128] if not args.quick else [1, 32, 128]
    contexts = [16, 64, 128, 256] if not args.quick else [16, 128]
    print(f"threads {args.threads}")
    decode_table(config, batches, contexts, args.iters, args.repeats)
    multi_version_table(config, [8, 32, 128], 64, args.iters, args.repeats)
    train_table(config, args.repeats)


if __name__ == "__main__":
    main()
