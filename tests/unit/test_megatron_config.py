"""megatron/config.json builds megatron-core's own config dataclasses (0.16.1, CPU), so a wrong field name or a
divisibility megatron-core enforces fails here; Megatron-LM flags follow megatron-core's field names.

Needs megatron-core: pip install -c constraints-cpu.txt megatron-core==0.16.1 (pure Python on top of torch).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import shlex
import warnings
from pathlib import Path

import pytest
from test_lower_plans import CPU_SPECS, EXAMPLE_SPECS, example_plan, load_example

from dora.lower import render_launch
from dora.lower.megatron import (
    DENSE_YARN_ATTRIBUTES,
    MLA_YARN_FIELDS_DEFAULTS,
    megatron_config,
    megatron_lm_args,
    to_megatron_kwargs,
)
from dora.spec import load_spec
from planner.architecture import arch_from_hf_config, get_preset

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected on CPU
    from megatron.core import ModelParallelConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

GPU_SPECS = [s for s in EXAMPLE_SPECS if s not in CPU_SPECS]
REPO = Path(__file__).resolve().parents[2]
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
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--norm-epsilon",
    "--use-rope-scaling", "--rope-scaling-factor", "--rotary-seq-len-interpolation-factor", "--padded-vocab-size",
}
"""Checked against Megatron-LM's megatron/training/arguments.py (2026-08): ``--norm-epsilon`` is
``layernorm_epsilon``'s flag (its ``argparse_meta``); the RoPE flags are GPTModel arguments."""


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
    """64 layers over pp=6: middle stages of 11, 11 on the first and 9 on the last (which also runs the output layer
    and the loss); megatron-core checks the sum."""
    resolved = load_example("dense-32b-h800x128")
    plan = example_plan(resolved, "dense-32b-h800x128")
    uneven = dataclasses.replace(plan, train=dataclasses.replace(plan.train, pp=6, dp=1, cp=1, tp=1, accelerators=6))
    config = megatron_config(resolved, uneven)
    assert (config["transformer"]["num_layers_in_first_pipeline_stage"],
            config["transformer"]["num_layers_in_last_pipeline_stage"]) == (11, 9)
    transformer = _build(config)[0]
    assert transformer.num_layers_in_first_pipeline_stage == 11
    args = megatron_lm_args(config)
    assert ["--decoder-first-pipeline-num-layers", "11"] in args and ["--decoder-last-pipeline-num-layers", "9"] in args
    config["transformer"]["num_layers_in_last_pipeline_stage"] = 10  # 11 + 4*11 + 10 = 65 layers
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


def _one_device(stem: str, **arch_changes):
    """The example's resolved spec and plan on one training device, with ``arch_changes`` applied (a preset or
    config.json architecture in place of the example's)."""
    resolved = load_example(stem)
    plan = example_plan(resolved, stem)
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, tp=1, pp=1, dp=1, cp=1, ep=1,
                                                               accelerators=1))
    if plan.colocated:  # the trainer's one device is then not the rollout's set: give it one of its own
        r = plan.rollout
        replicas = (resolved.spec.total_accelerators - 1) // r.accelerators_per_replica
        plan = dataclasses.replace(plan, colocated=False, rollout=dataclasses.replace(
            r, replicas=replicas, accelerators=replicas * r.accelerators_per_replica))
    if arch_changes:
        resolved = dataclasses.replace(resolved, arch=arch_changes["arch"])
    return resolved, plan


def _flag(args: list[list[str]], flag: str) -> str | None:
    return next((a[1] if len(a) > 1 else "" for a in args if a[0] == flag), None)


@pytest.mark.parametrize("stem", GPU_SPECS)
def test_rope_and_norm_settings_reach_megatron(stem: str) -> None:
    """The checkpoint's RoPE base and norm epsilon, not megatron-core's defaults (10000, 1e-5): Qwen2.5-32B trains
    with base 1e6 and epsilon 1e-5, Qwen3 with 1e6 and 1e-6."""
    config = _config(stem)
    arch = load_example(stem).arch
    gpt = config["gpt_model"]
    assert set(gpt) <= set(inspect.signature(GPTModel.__init__).parameters)
    assert gpt["vocab_size"] == arch.vocab_size
    transformer = _build(config)[0]
    assert transformer.layernorm_epsilon == arch.norm_eps
    args = megatron_lm_args(config)
    assert float(_flag(args, "--norm-epsilon")) == arch.norm_eps
    assert int(_flag(args, "--rotary-base")) == arch.rope_theta
    if arch.mla is None:
        assert gpt["rotary_base"] == arch.rope_theta
    else:
        assert transformer.rotary_base == arch.rope_theta and transformer.rope_type == "rope"


def test_the_dense_examples_carry_their_published_rope_base_and_epsilon() -> None:
    assert (_config("dense-32b-h800x128")["gpt_model"]["rotary_base"],
            _config("dense-32b-h800x128")["transformer"]["layernorm_epsilon"]) == (1_000_000, 1e-5)
    assert _config("dense-8b-h800x64")["transformer"]["layernorm_epsilon"] == 1e-6


@pytest.mark.parametrize(("preset", "beta_fast", "factor", "base"), [
    ("deepseek-v3", 32, 40, 10_000), ("kimi-k2", 1.0, 32.0, 50_000)])
def test_mla_yarn_scaling_builds_megatron_cores_mla_config(preset: str, beta_fast: float, factor: float,
                                                           base: int) -> None:
    resolved, plan = _one_device("dense-8b-h800x64", arch=get_preset(preset))
    config = megatron_config(resolved, plan)
    transformer = _build(config)[0]
    assert isinstance(transformer, MLATransformerConfig)
    assert (transformer.rope_type, transformer.rotary_scaling_factor, transformer.rotary_base) == ("yarn", factor, base)
    assert (transformer.beta_fast, transformer.mscale, transformer.mscale_all_dim) == (beta_fast, 1.0, 1.0)
    args = megatron_lm_args(config)
    assert _flag(args, "--rope-type") == "yarn" and float(_flag(args, "--mscale-all-dim")) == 1.0
    assert _flag(args, "--beta-fast") is None  # Megatron-LM has no such flag ...
    noted = [n for n in config["notes"] if "beta_fast" in n]
    assert noted == ([] if beta_fast == 32 else [noted[0]]) and config["limitations"] == []  # ... so it is noted


def test_an_mla_yarn_without_its_original_context_blocks_the_launch() -> None:
    """The dense path blocked a YaRN without original_max_position_embeddings; the MLA path wrote megatron-core's
    4096 without a word (a fuzzing pass)."""
    arch = get_preset("deepseek-v3")
    scaling = tuple((k, v) for k, v in arch.rope_scaling if k != "original_max_position_embeddings")
    resolved, plan = _one_device("dense-8b-h800x64", arch=dataclasses.replace(arch, rope_scaling=scaling))
    (limit,) = megatron_config(resolved, plan)["limitations"]
    assert limit == ("RoPE scaling 'yarn' (factor 40): no original_max_position_embeddings (vLLM requires it; "
                     "megatron-core would assume 4096)")


def test_the_mla_yarn_defaults_dora_assumes_are_megatron_cores() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    assert {k: defaults[k] for k in MLA_YARN_FIELDS_DEFAULTS} == MLA_YARN_FIELDS_DEFAULTS


def test_llama3_scaling_becomes_gpt_model_rope_scaling() -> None:
    llama = json.loads((REPO / "tests" / "data" / "hf_configs" / "llama-3.1-8b.json").read_text())
    resolved, plan = _one_device("dense-8b-h800x64", arch=arch_from_hf_config(llama, name="llama-3.1-8b"))
    config = megatron_config(resolved, plan)
    assert config["gpt_model"] | {"rope_scaling": True, "rope_scaling_factor": 8.0, "rotary_base": 500_000} \
        == config["gpt_model"]
    assert config["limitations"] == [] and config["transformer"]["layernorm_epsilon"] == 1e-5
    args = megatron_lm_args(config)
    assert ["--use-rope-scaling"] in args and _flag(args, "--rope-scaling-factor") == "8"
    # Llama 3.1's frequency factors are megatron-core's fixed ones; other values cannot be expressed
    llama["rope_scaling"]["high_freq_factor"] = 2.0
    resolved, plan = _one_device("dense-8b-h800x64", arch=arch_from_hf_config(llama, name="llama-x"))
    (limit,) = megatron_config(resolved, plan)["limitations"]
    assert "RoPE scaling 'llama3' (factor 8.0)" in limit and "high_freq_factor=2.0" in limit


def _qwen3_yarn(**rope_scaling) -> tuple:
    """Qwen3-8B with its model card's YaRN setting (factor 4 over 32768 positions), changed by ``rope_scaling``."""
    qwen = json.loads((REPO / "tests" / "data" / "hf_configs" / "qwen3-8b.json").read_text())
    qwen["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                            **rope_scaling}
    qwen["rope_scaling"] = {k: v for k, v in qwen["rope_scaling"].items() if v is not None}
    return _one_device("dense-8b-h800x64", arch=arch_from_hf_config(qwen, name="qwen3-8b-yarn"))


def _vllm_yarn(dim: int, base: float, factor: float, original: int, beta_fast: float, beta_slow: float,
               truncate: bool) -> tuple[list[float], float]:
    """vLLM's YaRN (``YaRNScalingRotaryEmbedding``, HF's ``_compute_yarn_parameters`` alike), written out here:
    the inverse frequencies and the attention factor multiplied into cos and sin."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        extrapolate = 1 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1: keep the original frequency
        pos_freq = base ** (2 * i / dim)
        out.append((1 / (factor * pos_freq)) * (1 - extrapolate) + (1 / pos_freq) * extrapolate)
    return out, 0.1 * math.log(factor) + 1.0


@pytest.mark.parametrize("truncate", [None, False])
def test_yarn_on_a_dense_model_reaches_gpt_model_as_vllm_applies_it(truncate: bool | None) -> None:
    """Qwen3's documented YaRN setting. GPTModel takes ``position_embedding_type='yarn'`` and reads the ``yarn_*``
    attributes off the config; with them set, megatron-core's frequencies and attention (concentration) factor
    are vLLM's, so the trainer scores tokens at the positions the rollout engine generated them."""
    import inspect as _inspect
    import re

    import torch
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn_module
    from megatron.core.models.gpt import gpt_model

    resolved, plan = _qwen3_yarn(truncate=truncate)
    config = megatron_config(resolved, plan)
    assert config["limitations"] == [] and config["gpt_model"]["position_embedding_type"] == "yarn"
    attributes = config["transformer_attributes"]
    read = set(re.findall(r'getattr\(\s*self\.config,\s*"(yarn_\w+)"', _inspect.getsource(gpt_model)))
    assert read == set(attributes) == set(DENSE_YARN_ATTRIBUTES)
    assert "yarn" in str(_inspect.signature(GPTModel.__init__).parameters["position_embedding_type"].annotation)
    transformer = _build(config)[0]
    assert transformer.apply_rope_fusion is False
    for name, value in attributes.items():
        setattr(transformer, name, value)  # what the trainer does after building the config

    arch = resolved.arch
    dim, base = transformer.kv_channels, config["gpt_model"]["rotary_base"]
    rounded = truncate is not False
    low, high = yarn_module._yarn_find_correction_range(
        transformer.yarn_beta_fast, transformer.yarn_beta_slow, dim, base,
        transformer.yarn_original_max_position_embeddings, transformer.yarn_correction_range_round_to_int)
    mask = 1.0 - yarn_module._yarn_linear_ramp_mask(low, high, dim // 2, device=torch.device("cpu"))
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    megatron_inv_freq = (extra / transformer.yarn_rotary_scaling_factor) * (1 - mask) + extra * mask
    expected, attention_factor = _vllm_yarn(arch.head_dim, arch.rope_theta, 4.0, 32768, 32.0, 1.0, rounded)
    assert megatron_inv_freq.tolist() == pytest.approx(expected, rel=1e-6)
    assert yarn_module._yarn_get_concentration_factor_from_config(transformer) == pytest.approx(attention_factor)

    args = megatron_lm_args(config)
    assert _flag(args, "--position-embedding-type") == "yarn"
    assert (float(_flag(args, "--rotary-scaling-factor")), int(_flag(args, "--yarn-original-max-position-embeddings")),
            float(_flag(args, "--mscale")), float(_flag(args, "--mscale-all-dim"))) == (4.0, 32768, 1.0, 0.0)
    assert (_flag(args, "--no-yarn-correction-range-round-to-int") is None) == rounded


@pytest.mark.parametrize(("change", "why"), [
    ({"attention_factor": 1.2}, "attention_factor (the attention factor) cannot be matched"),
    ({"original_max_position_embeddings": None}, "no original_max_position_embeddings")])
def test_a_dense_yarn_megatron_cannot_match_blocks_the_launch(change: dict, why: str) -> None:
    resolved, plan = _qwen3_yarn(**change)
    (limit,) = megatron_config(resolved, plan)["limitations"]
    assert limit.startswith("RoPE scaling 'yarn' (factor 4.0)") and why in limit
    notes = render_launch(resolved, plan)["launch/NOTES.txt"]
    assert "BLOCKED: megatron-core cannot express this architecture" in notes and "RoPE scaling 'yarn'" in notes


def test_an_explicit_architecture_without_rope_base_is_noted(tmp_path) -> None:
    spec = (REPO / "specs" / "dense-8b-h800x64.yaml").read_text().replace(
        "  preset: qwen3-8b\n",
        "  architecture: {num_layers: 36, hidden_size: 4096, num_attention_heads: 32, num_kv_heads: 8, head_dim: 128,"
        " ffn_hidden_size: 12288, vocab_size: 151936, qk_norm: true}\n")
    (tmp_path / "s.yaml").write_text(spec)
    resolved = load_spec(str(tmp_path / "s.yaml"))
    _, plan = _one_device("dense-8b-h800x64")
    config = megatron_config(resolved, plan)
    assert "rotary_base" not in config["gpt_model"] and "layernorm_epsilon" not in config["transformer"]
    notes = [n for n in config["notes"] if not n.startswith("microbatches:")]  # every plan has that one
    assert [n.split(" (")[0] for n in notes] == ["norm epsilon unknown", "RoPE base unknown"]
    assert all("set model.architecture." in n for n in notes)
    notes = render_launch(resolved, plan)["launch/NOTES.txt"]
    assert "megatron note: RoPE base unknown" in notes
    (tmp_path / "s.yaml").write_text(spec.replace("qk_norm: true}", "qk_norm: true, rope_theta: 1000000, "
                                                                     "norm_eps: 0.000001}"))
    resolved = load_spec(str(tmp_path / "s.yaml"))
    config = megatron_config(resolved, plan)
    assert config["gpt_model"]["rotary_base"] == 1_000_000
    assert [n for n in config["notes"] if not n.startswith("microbatches:")] == []
    assert resolved.arch == dataclasses.replace(get_preset("qwen3-8b"), name=resolved.arch.name,
                                                max_context_tokens=None)


@pytest.mark.parametrize(("preset", "router"), [
    ("deepseek-v3", {"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5,
                     "moe_router_num_groups": 8, "moe_router_group_topk": 4, "moe_router_enable_expert_bias": True,
                     "moe_router_bias_update_rate": 0.0, "moe_router_pre_softmax": False}),
    ("kimi-k2", {"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.827,
                 "moe_router_num_groups": None, "moe_router_enable_expert_bias": True}),
    ("qwen3-235b-a22b", {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
                         "moe_router_topk_scaling_factor": None, "moe_router_enable_expert_bias": False,
                         "moe_router_dtype": "fp32"}),
])
def test_moe_routing_follows_the_checkpoint(preset: str, router: dict) -> None:
    """megatron-core's router defaults (softmax, no scaling, no groups, no bias) are Qwen3's, not DeepSeek-V3's or
    Kimi-K2's; an expert bias stays frozen so training routes as the rollout engine does."""
    resolved, plan = _one_device("dense-8b-h800x64", arch=get_preset(preset))
    config = megatron_config(resolved, plan)
    transformer = _build(config)[0]
    assert {k: getattr(transformer, k) for k in router} == router
    args = megatron_lm_args(config)
    if router["moe_router_score_function"] == "sigmoid":
        assert _flag(args, "--moe-router-score-function") == "sigmoid"
        assert ["--moe-router-enable-expert-bias"] in args and _flag(args, "--moe-router-bias-update-rate") == "0.0"


def test_softmax_routing_without_renormalisation_is_softmax_before_the_top_k() -> None:
    """DeepSeek-V2 style (norm_topk_prob false): megatron-core's pre-softmax; sigmoid without it is not expressible."""
    v2 = dataclasses.replace(get_preset("qwen3-235b-a22b"), router_normalizes_topk=False)
    resolved, plan = _one_device("dense-8b-h800x64", arch=v2)
    assert _build(megatron_config(resolved, plan))[0].moe_router_pre_softmax is True
    odd = dataclasses.replace(get_preset("deepseek-v3"), router_normalizes_topk=False)
    resolved, plan = _one_device("dense-8b-h800x64", arch=odd)
    (limit,) = megatron_config(resolved, plan)["limitations"]
    assert limit.startswith("sigmoid routing without renormalised top-k weights")


@pytest.mark.parametrize(("tp", "ep", "dp"), [(4, 2, 1), (4, 4, 1), (1, 1, 1), (2, 2, 2), (8, 2, 1)])
def test_the_optimizer_is_distributed_wherever_the_memory_model_shards_its_state(tp: int, ep: int, dp: int) -> None:
    """The memory model shards the experts' optimizer state over their data-parallel group, dp*cp*tp/ep ranks
    (megatron-core's expert data-parallel group). A layout with dp*cp = 1 but tp > ep must still turn the distributed
    optimizer on, or it keeps the whole state and needs memory the plan did not price."""
    from planner.hardware import get_accelerator
    from planner.train_cost import train_memory_per_device

    resolved = load_example("moe-235b-h800x512")
    plan = example_plan(resolved, "moe-235b-h800x512")
    pp = plan.train.pp
    train = dataclasses.replace(plan.train, tp=tp, pp=pp, dp=dp, cp=1, ep=ep, accelerators=tp * pp * dp)
    config = megatron_config(resolved, dataclasses.replace(plan, train=train))
    acc = get_accelerator(resolved.spec.cluster.accelerator)
    memory = {on: train_memory_per_device(resolved.arch, acc, tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_tokens=8192,
                                          distributed_optimizer=on).optimizer_bytes for on in (True, False)}
    assert config["optimizer"]["use_distributed_optimizer"] is (memory[True] < memory[False])
    assert config["ddp"]["use_distributed_optimizer"] is config["optimizer"]["use_distributed_optimizer"]


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
def test_mla_keeps_its_latent_norms_in_megatron(preset: str) -> None:
    """The checkpoint's q_a_layernorm and kv_a_layernorm exist only if qk_layernorm is set: megatron-core builds
    MLA's latent norms from that flag, and without them the trainer computes another function than vLLM."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    resolved, plan = _one_device("dense-8b-h800x64", arch=get_preset(preset))
    config = megatron_config(resolved, plan)
    assert config["transformer"]["qk_layernorm"] is True
    assert _flag(megatron_lm_args(config), "--qk-layernorm") == ""
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    submodules = spec.submodules.self_attention.submodules
    assert "IdentityOp" not in (submodules.q_layernorm.__name__, submodules.kv_layernorm.__name__)


@pytest.mark.parametrize("stem", GPU_SPECS)
def test_megatron_lm_sizes_the_vocabulary_as_the_checkpoint_does(stem: str) -> None:
    """Megatron-LM sizes its embedding from the tokenizer (``len(tokenizer)``: 151,665 for Qwen2.5) rounded up to
    128 x tp unless ``--padded-vocab-size`` is given: 151,680 rows at tp=1 against the checkpoint's 152,064. args.txt
    gives the checkpoint's size, which megatron-core's vocabulary-parallel split must divide over tp."""
    from megatron.core.tensor_parallel.utils import VocabUtility

    resolved = load_example(stem)
    plan = example_plan(resolved, stem)
    config = megatron_config(resolved, plan)
    size = int(_flag(megatron_lm_args(config), "--padded-vocab-size"))
    assert size == config["gpt_model"]["vocab_size"] == resolved.arch.vocab_size
    first, last = VocabUtility.vocab_range_from_global_vocab_size(size, plan.train.tp - 1, plan.train.tp)
    assert last == size and (last - first) * plan.train.tp == size


def test_a_vocabulary_tp_does_not_divide_is_padded_and_noted() -> None:
    """32,001 rows (a Llama tokenizer plus a pad token) over tp=2: megatron-core would refuse the split, so the
    trainer gets 32,002 rows and the notes tell the checkpoint converter to add and drop the extra row."""
    from megatron.core.tensor_parallel.utils import VocabUtility

    resolved, plan = _one_device("dense-8b-h800x64")
    resolved = dataclasses.replace(resolved, arch=dataclasses.replace(resolved.arch, vocab_size=32001))
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, tp=2, accelerators=2))
    with pytest.raises(AssertionError):
        VocabUtility.vocab_range_from_global_vocab_size(32001, 0, 2)
    config = megatron_config(resolved, plan)
    assert config["gpt_model"]["vocab_size"] == 32002
    assert _flag(megatron_lm_args(config), "--padded-vocab-size") == "32002"
    assert any("32001 rows do not divide over tp=2" in note and "append 1 zero rows" in note
               for note in config["notes"])
    VocabUtility.vocab_range_from_global_vocab_size(32002, 1, 2)
