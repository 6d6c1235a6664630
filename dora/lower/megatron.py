"""Megatron artifacts for the trainer: megatron-core config sections (JSON) and the Megatron-LM flags.

``megatron/config.json`` holds four sections keyed by megatron-core dataclass field names,
``transformer`` (``TransformerConfig``, or ``MLATransformerConfig`` per ``transformer_class``), ``model_parallel``
(``ModelParallelConfig``; ``TransformerConfig`` inherits it, so a trainer builds
``TransformerConfig(**transformer, **model_parallel)``), ``optimizer`` (``OptimizerConfig``) and ``ddp``
(``DistributedDataParallelConfig``). ``transformer_attributes`` holds what megatron-core reads off the built
``TransformerConfig`` with ``getattr`` but does not declare as a field (YaRN on a non-MLA model: GPTModel and the
attention read ``yarn_*``): the trainer sets each one with ``setattr`` after building the config, as Megatron-LM
does from its flags. ``gpt_model`` holds ``GPTModel``'s keyword arguments. JSON cannot hold a callable or a torch
dtype, so those fields carry a name (``"silu"``, ``"bfloat16"``) that ``to_megatron_kwargs`` turns into the object.
``training`` holds the Megatron-LM training-loop values that are not megatron-core config fields (batch sizes,
sequence length).

Fixed choices (not in the spec), with why: no dropout (RL fine-tuning of a pretrained policy), AdamW with
betas (0.9, 0.99), no weight decay and gradient clipping at 1.0 (the same as dora's CPU trainer), constant
learning rate (``min_lr = lr``), the distributed optimizer and overlapped gradient reduction when dp * cp > 1,
and for MoE models router logits in fp32 (``moe_router_dtype``; slime's Megatron scripts set it for every MoE
model: near-tied top-k choices should not depend on the activation dtype) with a frozen expert bias (``_router``).
When pp does not divide the layers, the busiest stages hold ceil(layers/pp) and the first and last share the rest,
the last (which also runs the output layer and the loss) as few as the split allows
(``num_layers_in_first/last_pipeline_stage``; Megatron-LM ``--decoder-first/last-pipeline-num-layers``;
``train_cost.pipeline_stage_layers``).
"""

from __future__ import annotations

from typing import Any

from dora.lower.errors import LoweringError
from dora.spec.loader import ResolvedSpec
from planner.architecture import ModelArch
from planner.plan import Plan
from planner.train_cost import pipeline_stage_layers

TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}
"""Parameter dtype name per spec dtype (fp8 trains with bf16 master weights)."""

_NAMED_OBJECT_FIELDS = ("activation_func", "params_dtype", "pipeline_dtype", "autocast_dtype")


def _check(resolved: ResolvedSpec, plan: Plan) -> None:
    t, arch = plan.train, resolved.arch
    world = t.tp * t.pp * t.cp * t.dp
    if world != t.accelerators:
        raise LoweringError(f"plan.train: tp({t.tp}) * pp({t.pp}) * cp({t.cp}) * dp({t.dp}) = {world} != "
                            f"accelerators ({t.accelerators})")
    if arch.num_attention_heads % t.tp:
        raise LoweringError(f"plan.train.tp ({t.tp}) does not divide num_attention_heads "
                            f"({arch.num_attention_heads})")
    if arch.num_kv_heads % t.tp and t.tp % arch.num_kv_heads:
        raise LoweringError(f"plan.train.tp ({t.tp}) must divide or be a multiple of num_kv_heads "
                            f"({arch.num_kv_heads})")
    if pipeline_stage_layers(arch.num_layers, t.pp) is None:
        raise LoweringError(f"plan.train.pp ({t.pp}): Megatron cannot split {arch.num_layers} layers over {t.pp} "
                            "stages (equal middle stages of ceil(layers/pp), the rest on the first and last)")
    if t.ep > 1:
        if not arch.is_moe:
            raise LoweringError(f"plan.train.ep = {t.ep} but {arch.name} has no experts")
        if arch.num_experts % t.ep:
            raise LoweringError(f"plan.train.ep ({t.ep}) does not divide num_experts ({arch.num_experts})")
        if (t.tp * t.dp * t.cp) % t.ep:
            raise LoweringError(f"plan.train.ep ({t.ep}) must divide tp * dp * cp = {t.tp} * {t.dp} * {t.cp} = "
                                f"{t.tp * t.dp * t.cp} (experts are whole on each rank and sharded across the "
                                "tensor/data/context-parallel ranks: expert_tensor_parallel_size 1)")


def _router(arch: ModelArch) -> dict[str, Any]:
    """megatron-core's router fields for the checkpoint's routing. Softmax without renormalisation is softmax over
    all experts before the top-k (``moe_router_pre_softmax``); an expert bias is frozen (update rate 0), as the
    rollout engine routes with the checkpoint's bias and RL must not let the two drift apart."""
    out: dict[str, Any] = {"moe_router_dtype": "fp32", "moe_router_score_function": arch.router_score,
                           "moe_router_pre_softmax": arch.router_score == "softmax" and not arch.router_normalizes_topk}
    if arch.router_scaling != 1.0:
        out["moe_router_topk_scaling_factor"] = arch.router_scaling
    if arch.router_groups > 1:
        out.update({"moe_router_num_groups": arch.router_groups, "moe_router_group_topk": arch.router_group_topk})
    if arch.router_expert_bias and arch.router_score == "sigmoid":  # megatron-core takes the bias with sigmoid only
        out.update({"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.0})
    return out


def limitations(resolved: ResolvedSpec) -> list[str]:
    """Architecture features megatron-core's TransformerConfig cannot express (the config omits them)."""
    arch, out = resolved.arch, []
    if arch.num_zero_experts:
        out.append(f"{arch.num_zero_experts} zero-compute (identity) experts are not representable; the router "
                   f"here chooses top-{arch.experts_top_k} among the {arch.num_experts} real experts only")
    if arch.attention_per_layer != 1:
        out.append(f"{arch.attention_per_layer} attention sub-layers per block are not representable")
    if arch.is_moe and arch.router_score == "sigmoid" and not arch.router_normalizes_topk:
        out.append("sigmoid routing without renormalised top-k weights is not representable (megatron-core "
                   "renormalises sigmoid scores over the chosen experts)")
    if arch.is_moe and arch.router_score == "softmax" and arch.router_expert_bias:
        out.append("an expert-score correction bias on softmax scores (LongCat-Flash) is not representable "
                   "(megatron-core 0.16.1 takes an expert bias with sigmoid scores only)")
    if arch.dense_ffns_per_moe_layer:
        out.append(f"{arch.dense_ffns_per_moe_layer} dense FFNs beside each MoE layer are not representable")
    return out


MLA_YARN_FIELDS_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}
"""``MLATransformerConfig`` YaRN fields that Megatron-LM has no flag for, with megatron-core's defaults (a test
checks them): ``args.txt`` leaves them there, and the notes say so when the checkpoint's differ."""

_MLA_YARN_FIELDS = {"factor": "rotary_scaling_factor", "original_max_position_embeddings":
                    "original_max_position_embeddings", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                    "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}
"""config.json ``rope_scaling`` key -> ``MLATransformerConfig`` field."""

_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""megatron-core's llama3 RoPE scaling takes only the factor; these are its fixed values (Llama 3.1's)."""

DENSE_YARN_ATTRIBUTES = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                         "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")
"""The ``TransformerConfig`` attributes megatron-core 0.16.1's GPTModel reads for YaRN on a non-MLA model (a test
checks them against GPTModel's source)."""

_DENSE_YARN_KEYS = {"rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"}
"""config.json YaRN keys the non-MLA lowering reproduces. The others (an explicit ``attention_factor``, ``mscale``,
``mscale_all_dim``) change the attention factor, which megatron-core derives from ``yarn_mscale``/``_all_dim``
alone and which rollout engines read in their own ways for non-MLA models: they block the launch rather than
guess."""


def _dense_yarn(scaling: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """``(transformer attributes, "")`` for a non-MLA YaRN ``rope_scaling``, or ``(None, why not)``.

    The frequencies: YaRN's ramp between interpolated and original frequencies over ``beta_fast``..``beta_slow``
    rotations of the original context (vLLM's and HF's defaults 32 and 1), correction range rounded to whole
    dimensions unless ``truncate`` is false. The attention factor ``0.1 ln(factor) + 1`` that vLLM multiplies into
    cos and sin is megatron-core's concentration factor for ``yarn_mscale`` 1 and ``yarn_mscale_all_dim`` 0
    (Megatron-LM's defaults)."""
    extra = sorted(set(scaling) - _DENSE_YARN_KEYS)
    if extra:
        return None, f"{', '.join(extra)} (the attention factor) cannot be matched on a non-MLA model"
    if "original_max_position_embeddings" not in scaling:
        return None, "no original_max_position_embeddings (vLLM requires it; megatron-core would assume 4096)"
    factor = scaling.get("factor")
    if not isinstance(factor, int | float) or isinstance(factor, bool) or factor < 1:
        return None, f"factor {factor!r} is not a number >= 1"
    return {"yarn_rotary_scaling_factor": float(factor),
            "yarn_original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
            "yarn_beta_fast": float(scaling.get("beta_fast", 32.0)),
            "yarn_beta_slow": float(scaling.get("beta_slow", 1.0)),
            "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0,
            "yarn_correction_range_round_to_int": bool(scaling.get("truncate", True))}, ""


def _rotary_base(theta: float) -> int | float:
    """Megatron takes the RoPE base as a whole number (GPTModel ``rotary_base: int``, ``--rotary-base`` type=int)."""
    return int(theta) if theta.is_integer() else theta


def _positions(resolved: ResolvedSpec, max_len: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any],
                                                               list[str], list[str]]:
    """RoPE and norm settings: ``(transformer fields, transformer attributes, GPTModel keyword arguments,
    limitations, notes)``.

    A non-MLA model takes its RoPE from GPTModel's arguments (base, llama3 or linear scaling, yarn with the
    ``yarn_*`` attributes); an MLA model from ``MLATransformerConfig`` (rope or yarn). What megatron-core cannot
    take is a limitation (it blocks the launch: the trainer would place tokens differently from the checkpoint and
    from vLLM); what the spec does not say is a note (megatron-core's default applies)."""
    arch = resolved.arch
    explicit = resolved.spec.model.architecture is not None
    where = "model.architecture" if explicit else "the model's config.json"
    transformer: dict[str, Any] = {}
    attributes: dict[str, Any] = {}
    gpt: dict[str, Any] = {"position_embedding_type": "rope", "vocab_size": arch.vocab_size,
                           "max_sequence_length": max_len, "share_embeddings_and_output_weights": arch.tie_embeddings}
    limits: list[str] = []
    notes: list[str] = []
    if arch.norm_eps is not None:
        transformer["layernorm_epsilon"] = arch.norm_eps
    else:
        notes.append(f"norm epsilon unknown ({where} gives no rms_norm_eps): megatron-core's layernorm_epsilon "
                     "default 1e-5 applies" + ("; set model.architecture.norm_eps" if explicit else ""))
    base = None if arch.rope_theta is None else _rotary_base(arch.rope_theta)
    if base is None:
        notes.append(f"RoPE base unknown ({where} gives no rope_theta): megatron-core's rotary_base default 10000 "
                     "applies" + ("; set model.architecture.rope_theta" if explicit else ""))
    elif isinstance(base, float):
        notes.append(f"rope_theta {base} is not a whole number: Megatron-LM's --rotary-base takes an integer")
    scaling = dict(arch.rope_scaling)
    kind = scaling.get("rope_type")
    described = f"RoPE scaling {kind!r} (factor {scaling.get('factor')})"
    if arch.mla is not None:
        if base is not None:
            transformer["rotary_base"] = base
        if not scaling:
            transformer["rope_type"] = "rope"
        elif kind == "yarn" and "original_max_position_embeddings" not in scaling:
            limits.append(f"{described}: no original_max_position_embeddings (vLLM requires it; megatron-core would "
                          f"assume {MLA_YARN_FIELDS_DEFAULTS['original_max_position_embeddings']})")
        elif kind == "yarn":
            transformer["rope_type"] = "yarn"
            for key, field in _MLA_YARN_FIELDS.items():
                if key in scaling:
                    transformer[field] = scaling[key]
                    default = MLA_YARN_FIELDS_DEFAULTS.get(field)
                    if default is not None and scaling[key] != default:
                        notes.append(f"Megatron-LM has no flag for MLA's {field}: args.txt leaves it at "
                                     f"megatron-core's {default}; the checkpoint's {scaling[key]} is in config.json")
        else:
            limits.append(f"{described}: megatron-core's MLA takes only rope or yarn")
        return transformer, attributes, gpt, limits, notes
    if base is not None:
        gpt["rotary_base"] = base
    gpt["rotary_percent"] = 1.0
    if kind == "llama3" and all(scaling.get(k, v) == v for k, v in _LLAMA3_FIXED.items()):
        gpt.update({"rope_scaling": True, "rope_scaling_factor": scaling["factor"]})
    elif kind == "linear" and isinstance(scaling.get("factor"), int | float):
        gpt["seq_len_interpolation_factor"] = scaling["factor"]
        if not float(scaling["factor"]).is_integer():
            notes.append(f"linear RoPE factor {scaling['factor']}: Megatron-LM's "
                         "--rotary-seq-len-interpolation-factor takes an integer (config.json has the factor)")
    elif kind == "yarn":
        yarn, why_not = _dense_yarn(scaling)
        if yarn is None:
            limits.append(f"{described}: {why_not}")
        else:
            gpt["position_embedding_type"] = "yarn"
            attributes.update(yarn)
            # TE's fused RoPE drops the attention factor for packed sequences (megatron-core 0.16.1 warns only
            # for unpacked ones); Megatron-LM turns the fusion off for yarn itself
            transformer["apply_rope_fusion"] = False
    elif scaling:
        rest = ", ".join(f"{k}={v}" for k, v in sorted(scaling.items()) if k not in ("rope_type", "factor"))
        limits.append(f"{described}{f' with {rest}' if rest else ''}: "
                      "megatron-core's GPTModel takes llama3 scaling (low/high frequency factors 1/4, original "
                      "8192 positions), linear interpolation and yarn only")
    return transformer, attributes, gpt, limits, notes


def megatron_config(resolved: ResolvedSpec, plan: Plan) -> dict[str, Any]:
    """The four megatron-core sections, ``gpt_model`` (GPTModel keyword arguments), ``training``, ``limitations``
    (what megatron-core cannot express: it blocks the launch) and ``notes``; raises LoweringError for a plan
    megatron-core would reject (sizes that do not multiply out or divide)."""
    _check(resolved, plan)
    arch, t, spec = resolved.arch, plan.train, resolved.spec
    dtype = spec.model.dtype
    rope_fields, attributes, gpt_model, rope_limits, notes = _positions(resolved, plan.rollout.max_model_len)
    transformer: dict[str, Any] = {
        "num_layers": arch.num_layers, "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads, "num_query_groups": arch.num_kv_heads,
        "kv_channels": arch.head_dim, "ffn_hidden_size": arch.ffn_hidden_size,
        "normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": "silu",
        "add_bias_linear": False, "add_qkv_bias": arch.qkv_bias,
        # megatron-core builds MLA's latent norms (the checkpoint's q_a_layernorm and kv_a_layernorm) from this flag too
        "qk_layernorm": arch.qk_norm or arch.mla is not None,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "recompute_granularity": "full" if t.recompute else None,
        "recompute_method": "uniform" if t.recompute else None,
        "recompute_num_layers": 1 if t.recompute else None,
    }
    split = pipeline_stage_layers(arch.num_layers, t.pp)
    if split is not None and arch.num_layers % t.pp:  # uneven: equal middle stages, the rest on the first and last
        transformer.update({"num_layers_in_first_pipeline_stage": split[0],
                            "num_layers_in_last_pipeline_stage": split[2]})
    if arch.is_moe:
        transformer.update({
            "num_moe_experts": arch.num_experts, "moe_router_topk": arch.experts_top_k,
            "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": (arch.num_shared_experts * arch.moe_ffn_hidden_size
                                                    if arch.num_shared_experts else None),
            # Dense prefix then MoE in every layer (DeepSeek first_k_dense_replace): a per-layer 0/1 pattern.
            "moe_layer_freq": [0] * arch.first_dense_layers + [1] * (arch.num_layers - arch.first_dense_layers),
            "moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall",
            **_router(arch),
        })
    transformer_class = "TransformerConfig"
    if arch.mla is not None:
        transformer_class = "MLATransformerConfig"
        transformer.update({
            "multi_latent_attention": True, "q_lora_rank": arch.mla.q_lora_rank,
            "kv_lora_rank": arch.mla.kv_lora_rank, "qk_head_dim": arch.mla.qk_nope_head_dim,
            "qk_pos_emb_head_dim": arch.mla.qk_rope_head_dim, "v_head_dim": arch.mla.v_head_dim,
        })
    transformer.update(rope_fields)
    # megatron-core splits the embedding and output layer by rows over TP ranks (VocabParallelEmbedding divides the
    # vocabulary by tp). A checkpoint whose vocabulary does not divide gets zero rows appended, as Megatron-LM pads.
    padded_vocab = -(-arch.vocab_size // t.tp) * t.tp
    if padded_vocab != arch.vocab_size:
        gpt_model["vocab_size"] = padded_vocab
        notes.append(f"vocabulary: the checkpoint's {arch.vocab_size} rows do not divide over tp={t.tp}; the "
                     f"trainer's embedding and output layer have {padded_vocab} rows, so a checkpoint converter must "
                     f"append {padded_vocab - arch.vocab_size} zero rows on load and drop them on export to vLLM, and the "
                     f"loss must mask their logits (a zero row scores 0, not minus infinity)")
    model_parallel = {
        "tensor_model_parallel_size": t.tp, "pipeline_model_parallel_size": t.pp,
        "context_parallel_size": t.cp, "expert_model_parallel_size": t.ep,
        # Experts are not split by TP (the cost model's and Megatron-MoE's "parallel folding" layout): EP folds into
        # the tp*dp*cp ranks instead of dp*cp, which megatron-core's default (expert TP = TP) would require.
        **({"expert_tensor_parallel_size": 1} if arch.is_moe else {}),
        # Sequence parallelism is free with TP and megatron-core requires it for EP x TP.
        "sequence_parallel": t.tp > 1,
        "bf16": dtype in ("bf16", "fp8"), "fp16": dtype == "fp16", "params_dtype": TORCH_DTYPE[dtype],
        "pipeline_dtype": TORCH_DTYPE[dtype] if t.pp > 1 else None,
    }
    # Megatron reduces gradients over the data- and context-parallel ranks together and the distributed optimizer
    # shards over that group; the experts' gradients and state go over their own data-parallel group, dp*cp*tp/ep
    # ranks. The memory model divides the optimizer state by those sizes (train_memory_per_device), so the optimizer
    # is distributed whenever either group has more than one rank: an MoE layout with dp*cp = 1 still shards its
    # experts' state over tp/ep ranks.
    expert_dp = t.dp * t.cp * t.tp // t.ep if arch.is_moe else 1
    distributed = t.dp * t.cp > 1 or expert_dp > 1
    lr = spec.algorithm.learning_rate
    optimizer = {
        "optimizer": "adam", "lr": lr, "min_lr": lr, "weight_decay": 0.0,
        "adam_beta1": 0.9, "adam_beta2": 0.99, "adam_eps": 1e-8, "clip_grad": 1.0,
        "bf16": model_parallel["bf16"], "fp16": model_parallel["fp16"], "params_dtype": TORCH_DTYPE[dtype],
        "use_distributed_optimizer": distributed,
    }
    ddp = {"grad_reduce_in_fp32": True, "overlap_grad_reduce": distributed,
           "overlap_param_gather": distributed, "use_distributed_optimizer": distributed}
    sequences = spec.workload.prompts_per_step * spec.workload.samples_per_prompt
    minibatches = spec.algorithm.minibatches_per_step
    if sequences % minibatches or (sequences // minibatches) % t.dp:
        raise LoweringError(f"global batch: prompts_per_step * samples_per_prompt / minibatches_per_step = "
                            f"{sequences} / {minibatches} must be a whole multiple of dp ({t.dp})")
    notes.append(f"microbatches: the plan prices sequences packed into microbatches of {t.micro_batch_tokens} "
                 f"tokens (about {t.num_microbatches} per step); this config is megatron-core's unpacked form, one "
                 f"sequence of up to seq_length per microbatch, so a trainer must pack sequences to match it "
                 f"(Megatron-LM: THD with Transformer Engine; dora's MegatronTrainer packs rows of "
                 f"{t.micro_batch_tokens} tokens under variable-length attention)")
    training = {"seq_length": plan.rollout.max_model_len, "max_position_embeddings": plan.rollout.max_model_len,
                "micro_batch_size": 1, "global_batch_size": sequences // minibatches,
                "train_iters": spec.workload.steps * minibatches * spec.algorithm.ppo_epochs,
                "seed": spec.runtime.seed, "tokenizer_model": spec.model.checkpoint,
                "untie_embeddings_and_output_weights": not arch.tie_embeddings}
    return {"transformer_class": transformer_class, "transformer": transformer,
            "transformer_attributes": attributes, "model_parallel": model_parallel,
            "optimizer": optimizer, "ddp": ddp, "gpt_model": gpt_model, "training": training,
            "limitations": limitations(resolved) + rope_limits, "notes": notes}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def megatron_lm_args(config: dict[str, Any]) -> list[list[str]]:
    """Megatron-LM (``pretrain_gpt.py``) flags equivalent to ``config``: one ``[flag, value...]`` per option.

    Megatron-LM derives most flags from the megatron-core field names (``--`` + field with ``-``; a true bool
    is a bare flag); the exceptions below are the flags it names differently.
    """
    tr, mp, opt, ddp, trn = (config[k] for k in ("transformer", "model_parallel", "optimizer", "ddp", "training"))
    gpt = config["gpt_model"]
    out: list[list[str]] = [["--use-mcore-models"]]
    renamed = {"num_moe_experts": "--num-experts",
               "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
               "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
               "layernorm_epsilon": "--norm-epsilon"}
    derived = {"normalization", "gated_linear_unit", "activation_func", "add_bias_linear", "num_query_groups"}
    for name in sorted(tr):
        value = tr[name]
        if name in derived or name in MLA_YARN_FIELDS_DEFAULTS or value is None or value is False:
            continue
        flag = renamed.get(name, _flag(name))
        if value is True:
            out.append([flag])
        elif isinstance(value, list):
            # Megatron-LM evaluates --moe-layer-freq as a Python list literal.
            out.append([flag, "[" + ",".join(str(v) for v in value) + "]"])
        else:
            out.append([flag, str(value)])
    out.append(["--normalization", tr["normalization"]])
    out.append(["--swiglu"])  # gated_linear_unit + silu
    out.append(["--disable-bias-linear"])
    if tr["num_query_groups"] != tr["num_attention_heads"]:
        out += [["--group-query-attention"], ["--num-query-groups", str(tr["num_query_groups"])]]
    out.append(["--position-embedding-type", gpt["position_embedding_type"]])
    for name, flag in (("rotary_base", "--rotary-base"), ("rotary_percent", "--rotary-percent"),
                       ("rope_scaling_factor", "--rope-scaling-factor"),
                       ("seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor")):
        if name in gpt:
            value = gpt[name]
            out.append([flag, str(int(value) if float(value).is_integer() else value)])
    if gpt.get("rope_scaling"):
        out.append(["--use-rope-scaling"])
    attrs = config["transformer_attributes"]
    for name, flag in (("yarn_rotary_scaling_factor", "--rotary-scaling-factor"),
                       ("yarn_original_max_position_embeddings", "--yarn-original-max-position-embeddings"),
                       ("yarn_beta_fast", "--yarn-beta-fast"), ("yarn_beta_slow", "--yarn-beta-slow"),
                       ("yarn_mscale", "--mscale"), ("yarn_mscale_all_dim", "--mscale-all-dim")):
        if name in attrs:
            out.append([flag, str(attrs[name])])
    if attrs.get("yarn_correction_range_round_to_int") is not None:
        out.append(["--yarn-correction-range-round-to-int" if attrs["yarn_correction_range_round_to_int"]
                    else "--no-yarn-correction-range-round-to-int"])
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size"):
        if name in mp:
            out.append([_flag(name), str(mp[name])])
    out += [["--sequence-parallel"]] if mp["sequence_parallel"] else []
    out += [["--bf16"]] if mp["bf16"] else [["--fp16"]] if mp["fp16"] else []
    for name in ("optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
        out.append([_flag(name), str(opt[name])])
    out.append(["--lr-decay-style", "constant"])
    out += [["--use-distributed-optimizer"]] if opt["use_distributed_optimizer"] else []
    out += [["--accumulate-allreduce-grads-in-fp32"]] if ddp["grad_reduce_in_fp32"] else []
    out += [["--overlap-grad-reduce"]] if ddp["overlap_grad_reduce"] else []
    out += [["--overlap-param-gather"]] if ddp["overlap_param_gather"] else []
    for name in ("seq_length", "max_position_embeddings", "micro_batch_size", "global_batch_size", "train_iters",
                 "seed"):
        out.append([_flag(name), str(trn[name])])
    if trn["untie_embeddings_and_output_weights"]:
        out.append(["--untie-embeddings-and-output-weights"])
    if trn["tokenizer_model"] is not None:
        out += [["--tokenizer-type", "HuggingFaceTokenizer"], ["--tokenizer-model", trn["tokenizer_model"]]]
    # Without it Megatron-LM sizes the embedding from the tokenizer (len(tokenizer), 151,665 for Qwen2.5) rounded up
    # to --make-vocab-size-divisible-by (128) x tp: 151,680 rows at tp=1 where the checkpoint has 152,064.
    out.append(["--padded-vocab-size", str(gpt["vocab_size"])])
    return out


def to_megatron_kwargs(section: dict[str, Any]) -> dict[str, Any]:
    """A config.json section as keyword arguments for the megatron-core dataclass: named callables and dtypes
    become objects. Imports torch, so only the GPU trainer and the validation test call it."""
    import torch
    import torch.nn.functional as F

    objects = {"silu": F.silu, "gelu": F.gelu, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float32": torch.float32}
    out = dict(section)
    for name in _NAMED_OBJECT_FIELDS:
        if out.get(name) is not None:
            out[name] = objects[out[name]]
    return out
