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
from dora.lower.megatron import megatron_config, megatron_lm_args, to_megatron_kwargs

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
    assert config["model_parallel"]["pipeline_model_parallel_size"] > 1
    config["model_parallel"]["pipeline_dtype"] = None
    with pytest.raises(ValueError, match="pipeline_dtype must be specified"):
        _build(config)


# Megatron-LM spells these differently from megatron-core, or they are training-loop flags (no core field).
LM_ONLY_FLAGS = {
    "--use-mcore-models", "--num-experts", "--swiglu", "--disable-bias-linear", "--group-query-attention",
    "--position-embedding-type", "--lr-decay-style", "--accumulate-allreduce-grads-in-fp32", "--seq-length",
    "--max-position-embeddings", "--micro-batch-size", "--global-batch-size", "--train-iters", "--seed",
    "--untie-embeddings-and-output-weights", "--tokenizer-type", "--tokenizer-model",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
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


def test_an_uneven_pipeline_split_is_one_megatron_core_accepts() -> None:
    """64 layers over pp=6: middle stages of 11, 10 on the first and last; megatron-core checks the sum."""
    resolved = load_example("dense-32b-h800x128")
    plan = example_plan(resolved, "dense-32b-h800x128")
    uneven = dataclasses.replace(plan, train=dataclasses.replace(plan.train, pp=6, dp=1, cp=1, tp=1, accelerators=6))
    config = megatron_config(resolved, uneven)
    assert (config["transformer"]["num_layers_in_first_pipeline_stage"],
            config["transformer"]["num_layers_in_last_pipeline_stage"]) == (10, 10)
    transformer = _build(config)[0]
    assert transformer.num_layers_in_first_pipeline_stage == 10
    args = megatron_lm_args(config)
    assert ["--decoder-first-pipeline-num-layers", "10"] in args and ["--decoder-last-pipeline-num-layers", "10"] in args
    config["transformer"]["num_layers_in_last_pipeline_stage"] = 11  # 10 + 4*11 + 11 = 65 layers
    with pytest.raises(ValueError, match="number of layers at middle stage"):
        _build(config)
    even = megatron_config(resolved, dataclasses.replace(uneven, train=dataclasses.replace(
        uneven.train, pp=8, accelerators=8)))
    assert "num_layers_in_first_pipeline_stage" not in even["transformer"]


def test_distributed_optimizer_shards_over_data_and_context_ranks() -> None:
    """Megatron reduces gradients over dp x cp and shards the distributed optimizer there, as the memory model does."""
    resolved = load_example("dense-32b-h800x128")
    plan = example_plan(resolved, "dense-32b-h800x128")
    for dp, cp, sharded in ((1, 1, False), (1, 8, True), (2, 1, True)):
        train = dataclasses.replace(plan.train, tp=1, pp=8, dp=dp, cp=cp, accelerators=8 * dp * cp)
        config = megatron_config(resolved, dataclasses.replace(plan, train=train))
        assert config["optimizer"]["use_distributed_optimizer"] is sharded
        assert config["ddp"]["use_distributed_optimizer"] is config["ddp"]["overlap_grad_reduce"] is sharded
