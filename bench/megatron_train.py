"""Train what dora plans for one GPU with megatron-core, and set the measured step time beside the cost model's.

    python bench/megatron_train.py [--spec bench/specs/qwen3-1.7b-h100x1.yaml] [--steps 4] [--json OUT]

Needs a CUDA GPU and megatron-core (the device machine); elsewhere it says so and exits 2.

1. Plans the spec with dora's planner and lowers the plan: ``megatron/config.json`` as ``dora plan --out``
   writes it.
2. Builds ``MegatronTrainer`` from that config on the GPU. Weights are bf16; the optimizer is megatron-core's
   DDP + Adam with fp32 main weights. It trains GRPO steps: one packed microbatch of the plan's
   ``micro_batch_tokens`` per forward, and one optimizer step per step.
3. Batches hold ``prompts_per_step x samples_per_prompt`` sequences. Prompt and response lengths are drawn from
   the spec's distributions (seeded); the tokens are random, and the rewards are 0/1 within each group. The
   first step is a warm-up and is not reported.
4. Prints, per step:
   - sequences, tokens and the measured seconds;
   - the cost model's seconds for that same step: the plan's layout, the catalog constants, the same tokens and
     the same sum of squared lengths;
   - the ``train_mfu_dense`` (``train_mfu_moe`` for an MoE model) that makes the cost model match the
     measurement, found by bisection. This is the trainer's effective MFU as the cost model counts FLOPs.
   Also prints peak GPU memory against the cost model's training memory.

``--calibration-out FILE`` writes the planned variant's fitted constant as a calibration file for
``dora plan SPEC --calibration FILE`` (``bench/specs/qwen3-1.7b-h100x1.calibration.json`` came from an H100).

``bench/specs/qwen3-30b-a3b-4l-h100x1.yaml`` is an MoE model: Qwen3-30B-A3B's layers (128 experts, top 8), 4 of
its 48, so that weights, gradients and Adam fit one GPU. It fits ``train_mfu_moe``.

Given several variants, each runs in its own process: after an MoE trainer, not all of its GPU memory came back
within the process (``_variant_in_child``).

The catalog's ``train_mfu_dense`` (0.50) describes Megatron with Transformer Engine's fused kernels. This
trainer runs megatron-core's local layers: torch's variable-length flash attention, torch norms, unfused rotary,
and no THD packing. So the fitted value measures dora's trainer, not the best Megatron can do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# as Megatron-LM's launch scripts do: a step's tensors change size from microbatch to microbatch
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

DEFAULT_SPEC = REPO / "bench" / "specs" / "qwen3-1.7b-h100x1.yaml"


def _batch(resolved, vocab: int, rng: random.Random, step: int) -> list:
    from dora.runtime.engines.base import FinishedTrajectory, ScoredTrajectory

    w = resolved.spec.workload
    out = []
    for g in range(w.prompts_per_step):
        prompt = tuple(rng.randrange(vocab) for _ in range(resolved.prompt_lengths.sample(rng)))
        for j in range(w.samples_per_prompt):
            n = resolved.response_lengths.sample(rng)
            traj = FinishedTrajectory(
                request_id=f"{step}-{g}-{j}", prompt_ids=prompt,
                response_ids=tuple(rng.randrange(vocab) for _ in range(n)),
                behaviour_logprobs=(-math.log(vocab),) * n, version_spans=((step, n),), finish_reason="stop")
            out.append(ScoredTrajectory(trajectory=traj, reward=float(rng.random() < 0.5), group_id=f"{step}-{g}"))
    return out


def _predicted(inp, plan, calib, tokens: int, sum_sq: int, num_seqs: int) -> float:
    from planner.train_cost import TrainCostModel

    t = plan.train
    return TrainCostModel(arch=inp.arch, acc=inp.accelerator, tp=t.tp, pp=t.pp, dp=t.dp, ep=t.ep, cp=t.cp,
                          micro_batch_tokens=t.micro_batch_tokens, extra_forward_passes=inp.extra_forward_passes,
                          recompute="full" if t.recompute else "none", optimizer_steps=inp.optimizer_steps,
                          dtype_bytes=inp.dtype_bytes, calib=calib,
                          accelerators_per_node=inp.accelerators_per_node).train_step_s(tokens, sum_sq, num_seqs)


def mfu_constant(inp) -> str:
    """The calibration constant the cost model prices this model's training step with."""
    return "train_mfu_moe" if inp.arch.is_moe else "train_mfu_dense"


def _fitted_mfu(inp, plan, measured: float, tokens: int, sum_sq: int, num_seqs: int) -> float:
    """The ``mfu_constant`` at which the cost model predicts ``measured`` (bisection; the prediction falls as the
    efficiency rises). nan when even an efficiency of 1 predicts more than was measured."""
    def at(mfu: float) -> float:
        return _predicted(inp, plan, inp.calibration.with_overrides(**{mfu_constant(inp): mfu}), tokens, sum_sq,
                          num_seqs)

    lo, hi = 1e-3, 1.0
    if at(hi) > measured:
        return float("nan")
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if at(mid) > measured else (lo, mid)
    return hi


def _variant(name: str, recompute: bool, resolved, plan, inp, steps: int, seed: int) -> dict:
    """Train ``steps`` (+1 warm-up) steps of the plan's lowered config, with or without full recomputation."""
    import gc

    import torch

    from dora.lower.megatron import megatron_config
    from dora.runtime.engines.megatron_trainer import MegatronTrainer, MegatronTrainerConfig
    from dora.runtime.engines.torch_trainer import GRPOSettings
    from planner.train_cost import train_memory_per_device

    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, recompute=recompute))
    config = megatron_config(resolved, plan)
    if recompute:  # Megatron-LM's --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
        config["transformer"].update(recompute_granularity="full", recompute_method="uniform",
                                     recompute_num_layers=1)
    t, algo = plan.train, resolved.spec.algorithm
    settings = GRPOSettings(off_policy_correction=algo.off_policy_correction, is_weight_cap=2.0, ppo_clip_eps=0.2,
                            num_minibatches=algo.minibatches_per_step, temperature=1.0,
                            pack_len=t.micro_batch_tokens, microbatch_rows=1)
    print(f"-- {name}: microbatch {t.micro_batch_tokens} tokens, recompute {'full' if recompute else 'none'}")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer = MegatronTrainer(MegatronTrainerConfig(megatron=config, grpo=settings, device="cuda", seed=seed))
    build_s = time.perf_counter() - started
    rng = random.Random(seed)
    vocab = resolved.arch.vocab_size
    mem = train_memory_per_device(inp.arch, inp.accelerator, tp=t.tp, pp=t.pp, dp=t.dp, ep=t.ep, cp=t.cp,
                                  micro_batch_tokens=t.micro_batch_tokens, recompute="full" if recompute else "none",
                                  dtype_bytes=inp.dtype_bytes, calib=inp.calibration)
    parts = {"params": mem.params_bytes, "grads": mem.grads_bytes, "optimizer": mem.optimizer_bytes,
             "activations": mem.activations_bytes, "reserved": mem.reserved_bytes}
    result: dict = {"variant": name, "recompute": recompute, "micro_batch_tokens": t.micro_batch_tokens,
                    "build_s": build_s, "plan_train_memory_gib": mem.total_bytes / 2**30,
                    "plan_train_memory_detail_gib": {k: v / 2**30 for k, v in parts.items()}}
    rows = []
    step = 0
    try:
        for step in range(steps + 1):
            batch = _batch(resolved, vocab, rng, step)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = trainer.train_step(batch)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens, sum_sq = m.num_forward_tokens, m.forward_sum_sq_tokens
            pred = _predicted(inp, plan, inp.calibration, tokens, sum_sq, m.num_sequences)
            row = {"step": step, "sequences": m.num_sequences, "tokens": tokens, "measured_s": seconds,
                   "predicted_s": pred,
                   "fitted_mfu": _fitted_mfu(inp, plan, seconds, tokens, sum_sq, m.num_sequences),
                   "tokens_per_s": tokens / seconds, "loss": m.loss, "grad_norm": m.grad_norm}
            print(("warm-up " if step == 0 else "") + "step {step}: {sequences} seqs, {tokens} tokens, measured "
                  "{measured_s:.2f} s, cost model {predicted_s:.2f} s, {tokens_per_s:,.0f} tokens/s, fitted "
                  "{constant} {fitted_mfu:.3f}, loss {loss:.3g}".format(constant=mfu_constant(inp), **row))
            if step:
                rows.append(row)
    except torch.OutOfMemoryError:
        result["out_of_memory_at_step"] = step
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer
    detail = ", ".join(f"{k} {v:.1f}" for k, v in sorted(result["plan_train_memory_detail_gib"].items()))
    if "out_of_memory_at_step" in result:
        print(f"out of memory in step {result['out_of_memory_at_step']} (peak {result['peak_memory_gib']:.1f} GiB "
              f"allocated); the cost model's training memory {result['plan_train_memory_gib']:.1f} GiB ({detail})")
        return result
    ratio = [r["measured_s"] / r["predicted_s"] for r in rows]
    mfu = [r["fitted_mfu"] for r in rows]
    result.update({
        "steps": len(rows), "measured_over_predicted_median": statistics.median(ratio),
        "measured_over_predicted_range": [min(ratio), max(ratio)],
        "fitted_mfu_median": statistics.median(mfu), "fitted_mfu_range": [min(mfu), max(mfu)],
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows), "rows": rows})
    print(f"measured / cost model: median {result['measured_over_predicted_median']:.2f} "
          f"({min(ratio):.2f}-{max(ratio):.2f}) over {len(rows)} steps; fitted {mfu_constant(inp)} median "
          f"{result['fitted_mfu_median']:.3f} ({min(mfu):.3f}-{max(mfu):.3f}); catalog "
          f"{getattr(inp.calibration, mfu_constant(inp))}")
    print(f"peak GPU memory {result['peak_memory_gib']:.1f} GiB allocated; the cost model's training memory "
          f"{result['plan_train_memory_gib']:.1f} GiB ({detail}); model build {build_s:.1f} s")
    return result


def _variant_in_child(name: str, args: argparse.Namespace) -> dict:
    """``_variant`` in a fresh Python process (this script with ``--variants NAME``). After an MoE variant
    (megatron-core 0.16.1, 4-layer Qwen3-30B-A3B) the next one in the same process ran out of memory at step 0,
    in either order (76 GiB allocated, where either peaks at 64 GiB alone): not all of the first trainer's
    memory came back (cause not found)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "variant.json"
        cmd = [sys.executable, __file__, "--spec", args.spec, "--steps", str(args.steps), "--variants", name,
               "--seed", str(args.seed), "--json", str(out)]
        done = subprocess.run(cmd, check=False)
        if done.returncode or not out.exists():
            raise SystemExit(f"megatron_train: the {name} variant's process failed (exit {done.returncode})")
        result: dict = json.loads(out.read_text())["variants"][0]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default=str(DEFAULT_SPEC))
    parser.add_argument("--steps", type=int, default=4, help="reported steps per variant (after one warm-up step)")
    parser.add_argument("--variants", default="planned,recompute",
                        help="comma-separated: planned (the plan as it is), recompute (full activation recomputation)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--calibration-out", metavar="FILE",
                        help="write the planned variant's fitted train_mfu_dense (train_mfu_moe) as a calibration file "
                             "(`dora plan SPEC --calibration FILE`)")
    args = parser.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("megatron_train: no CUDA GPU here (run it on a GPU machine)")
        return 2
    try:
        import megatron.core
    except ImportError:
        print("megatron_train: megatron-core is not installed (pip install megatron-core==0.16.1)")
        return 2

    from dora.planning import make_plan, search_inputs
    from dora.spec import load_spec

    resolved = load_spec(args.spec)
    plan = make_plan(resolved).plan
    inp = search_inputs(resolved)
    t = plan.train
    print(f"spec {resolved.spec.name}: {resolved.arch.name}, plan mode {plan.mode}, train tp{t.tp} pp{t.pp} "
          f"dp{t.dp} cp{t.cp}, microbatch {t.micro_batch_tokens} tokens, recompute {t.recompute}")
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; megatron-core "
          f"{megatron.core.__version__}")
    names = args.variants.split(",")
    for name in names:
        if name not in ("planned", "recompute"):
            parser.error(f"--variants: unknown variant {name!r} (planned, recompute)")
    if len(names) == 1:
        results = [_variant(names[0], t.recompute if names[0] == "planned" else True, resolved, plan, inp,
                            args.steps, args.seed)]
    else:  # one process per variant: a trainer's GPU memory is not all given back within a process
        results = [_variant_in_child(name, args) for name in names]
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": resolved.spec.name, "gpu": torch.cuda.get_device_name(),
                                               "fitted_constant": mfu_constant(inp),
                                               "catalog_value": getattr(inp.calibration, mfu_constant(inp)),
                                               "variants": results}, indent=2) + "\n")
    planned = next((r for r in results if r["variant"] == "planned" and "steps" in r), None)
    if args.calibration_out:
        if planned is None:
            print("no calibration written: the planned variant did not run to the end")
            return 1
        mfu = round(planned["fitted_mfu_median"], 4)
        source = (f"bench/megatron_train.py: dora's megatron-core trainer (local layers, varlen flash attention) on "
                  f"{torch.cuda.get_device_name()}, spec {resolved.spec.name}, {planned['steps']} steps")
        Path(args.calibration_out).write_text(json.dumps(
            {"calibration": {mfu_constant(inp): mfu, "source": source}}, indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.calibration_out}: {mfu_constant(inp)} {mfu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
