"""megatron/config.json builds megatron-core's own config dataclasses (0.16.1, CPU), so a wrong field name or a
divisibility megatron-core enforces fails here; Megatron-LM flags follow megatron-core's field names.

Needs megatron-core: pip install -c constraints-cpu.txt megatron-core==0.16.1 (pure Python on top of torch).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import warnings

import pytest
from test_lower_plans import EXAMPLE_SPECS, example_plan, load_example

from dora.lower import render_launch
from dora.lower.megatron import to_megatron_kwargs

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected on CPU
    from megatron.core import ModelParallelConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

GPU_SPECS = [s for s in EXAMPLE_SPECS if s != "local-tiny"]
CLASSES = {"TransformerConfig": TransformerConfig, "MLATransformerConfig": MLATransformerConfig}


def _config(stem: str) -> dict:
    resolved = load_example(stem)
    return json.loads(render_launch(resolved, example_plan(resolved, stem))["launch/megatron/config.json"])


def _build(config: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = CLASSES[config["transformer_class"]](
            **to_megatron_kwargs(config["transformer"]), **to_megatron_kwargs(config["model_parallel"]))
        return (transformer, ModelParallelConfig(**to_megatron_kwargs(config["model_parallel"])),
                OptimizerConfig(**to_megatron_kwargs(config["optimizer"])),
                DistributedDataParallelConfig(**config["ddp"]))


@pytest.mark.parametrize("stem", GPU_SPECS)
def test_megatron_core_builds_every_section(stem: str) -> None:
    config = _config(stem)
    transformer, parallel, optimizer, ddp = _build(config)
    arch = load_example(stem).arch
    assert transformer.num_layers == arch.num_layers and transformer.num_query_groups == arch.num_kv_heads
    assert transformer.kv_channels == arch.head_dim
    assert parallel.tensor_model_parallel_size == config["model_parallel"]["tensor_model_parallel_size"]
    assert optimizer.lr == load_example(stem).spec.algorithm.learning_rate
    assert ddp.use_distributed_optimizer == optimizer.use_distributed_optimizer
    if arch.mla is not None:
        assert isinstance(transformer, MLATransformerConfig) and transformer.kv_lora_rank == arch.mla.kv_lora_rank


def test_a_misspelt_field_is_caught() -> None:
    config = _config("dense-8b-h800x64")
    config["transformer"]["num_attention_head"] = config["transformer"].pop("num_attention_heads")
    with pytest.raises(TypeError, match="num_attention_head"):
        _build(config)


def test_a_divisibility_megatron_core_enforces_is_caught() -> None:
    config = _config("dense-8b-h800x64")
    config["model_parallel"]["tensor_model_parallel_size"] = 3
    with pytest.raises(ValueError, match=r"num_attention_heads \(32\) must be a multiple of "
                                         r"tensor_model_parallel_size \(3\)"):
        _build(config)


def test_pipeline_parallel_sets_the_dtype_megatron_core_requires() -> None:
    config = _config("moe-235b-h800x512")
    assert config["model_parallel"]["pipeline_model_parallel_size"] == 2
    config["model_parallel"]["pipeline_dtype"] = None
    with pytest.raises(ValueError, match="pipeline_dtype must be specified"):
        _build(config)


# Megatron-LM spells these differently from megatron-core, or they are training-loop flags (no core field).
LM_ONLY_FLAGS = {
    "--use-mcore-models", "--num-experts", "--swiglu", "--disable-bias-linear", "--group-query-attention",
    "--position-embedding-type", "--lr-decay-style", "--accumulate-allreduce-grads-in-fp32", "--seq-length",
    "--max-position-embeddings", "--micro-batch-size", "--global-batch-size", "--train-iters", "--seed",
    "--untie-embeddings-and-output-weights", "--tokenizer-type", "--tokenizer-model",
}


@pytest.mark.parametrize("stem", GPU_SPECS)
def test_megatron_lm_flags_name_megatron_core_fields(stem: str) -> None:
    resolved = load_example(stem)
    args = shlex.split(render_launch(resolved, example_plan(resolved, stem))["launch/megatron/args.txt"])
    core_fields = {f.name for cls in (MLATransformerConfig, OptimizerConfig, DistributedDataParallelConfig)
                   for f in dataclasses.fields(cls)}
    flags = [a for a in args if a.startswith("--")]
    assert len(flags) == len(set(flags)), "a flag is repeated"
    unknown = [f for f in flags if f not in LM_ONLY_FLAGS and f[2:].replace("-", "_") not in core_fields]
    assert unknown == []
