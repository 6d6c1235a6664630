"""Build the RuntimeConfig (``launch/runtime.json``) from a resolved spec and its plan."""

from __future__ import annotations

from dataclasses import asdict

from dora.lower.megatron import megatron_config
from dora.runtime.checkpoint import (
    CHECKPOINT_DIR,  # where the runtime writes them (it was named "checkpoints" here)
)
from dora.runtime.config import (
    FORMAT_VERSION,
    AlgorithmConfig,
    LengthConfig,
    MLAConfig,
    ModelConfig,
    RuntimeConfig,
    TaskConfig,
)
from dora.spec.loader import ResolvedSpec
from dora.spec.models import LengthSpec
from planner.plan import Plan
from planner.workload import LengthDistribution

TRACE_FILE = "trace.jsonl"
METRICS_FILE = "metrics.jsonl"


def _lengths(spec: LengthSpec, dist: LengthDistribution) -> LengthConfig:
    if dist.kind == "empirical":
        # The distribution keeps cumulative counts; the runtime wants the observed (length, count) rows back.
        counts = [c - p for c, p in zip(dist.cumulative_counts, (0, *dist.cumulative_counts[:-1]), strict=True)]
        rows = tuple((length, count) for length, count in zip(dist.lengths, counts, strict=True))
        return LengthConfig(kind="empirical", max_tokens=dist.max_tokens, min_tokens=dist.min_tokens,
                            median_tokens=None, p99_tokens=None, histogram=rows)
    return LengthConfig(kind="lognormal", max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
                        median_tokens=spec.median_tokens, p99_tokens=spec.p99_tokens, histogram=None)


def _model(resolved: ResolvedSpec) -> ModelConfig:
    fields = asdict(resolved.arch)
    mla = fields.pop("mla")
    fields.pop("moe_sequence_parallel")  # how vLLM serves the model, not what the local runtime builds
    for only_megatron in ("rope_scaling", "router_score", "router_normalizes_topk", "router_scaling", "router_groups",
                          "router_group_topk", "router_expert_bias"):
        fields.pop(only_megatron)
    return ModelConfig(**fields, mla=MLAConfig(**mla) if mla is not None else None,
                       dtype=resolved.spec.model.dtype, checkpoint=resolved.spec.model.checkpoint)


def runtime_config(resolved: ResolvedSpec, plan: Plan) -> RuntimeConfig:
    """The runtime config for ``plan``: the plan's decisions (mode, window, placement sizes) and the spec's values
    the runtime needs (batch, lengths, algorithm, model, engines, seed, output paths); and where the Megatron
    trainer runs beside the torch engines (a CPU rehearsal of the Megatron path), the lowered Megatron config."""
    spec, r, t = resolved.spec, plan.rollout, plan.train
    w = spec.workload
    task = TaskConfig(name=w.task.name, warmup_steps=w.task.warmup_steps) if w.task is not None else None
    rehearsal = spec.runtime.trainer == "megatron" and spec.cluster.accelerator == "cpu"
    return RuntimeConfig(
        format_version=FORMAT_VERSION, spec_hash=resolved.spec_hash, spec_name=spec.name,
        mode=plan.mode, max_version_lag=plan.max_version_lag, allow_version_mixing=plan.allow_version_mixing,
        versions_per_engine=r.versions_per_engine, consolidation_batch=r.consolidation_batch,
        colocated=plan.colocated,
        rollout_workers=r.replicas, max_num_seqs=r.max_num_seqs, max_model_len=r.max_model_len,
        accelerator=spec.cluster.accelerator, accelerators_per_rollout_worker=r.accelerators_per_replica,
        rollout_accelerators=r.accelerators, train_accelerators=t.accelerators,
        train_micro_batch_tokens=t.micro_batch_tokens, train_num_microbatches=t.num_microbatches,
        prompts_per_step=w.prompts_per_step, samples_per_prompt=w.samples_per_prompt, steps=w.steps,
        prompt_length=_lengths(w.prompt_length, resolved.prompt_lengths),
        response_length=_lengths(w.response_length, resolved.response_lengths),
        task=task, algorithm=AlgorithmConfig(**spec.algorithm.model_dump()), model=_model(resolved),
        rollout_engine=spec.runtime.rollout_engine, trainer=spec.runtime.trainer,
        megatron=megatron_config(resolved, plan) if rehearsal else None, seed=spec.runtime.seed,
        output_dir=resolved.output_dir, trace_file=TRACE_FILE, metrics_file=METRICS_FILE,
        checkpoint_dir=CHECKPOINT_DIR,
    )
