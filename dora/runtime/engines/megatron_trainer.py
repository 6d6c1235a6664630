"""Megatron trainer: megatron-core's GPTModel, built from the ``megatron/config.json`` dora's lowering writes,
trained with GRPO on packed sequences; weights go out under Hugging Face names.

This is the trainer role of ``base.Trainer`` on megatron-core (0.16.1) instead of the tiny CPU model:

- **The model** is ``GPTModel`` with megatron-core's own layers (the local layer spec: column/row-parallel
  linears, RMSNorm, optional per-head q/k norm, SwiGLU or plain MLP), configured field for field
  by the lowered ``transformer``/``model_parallel``/``gpt_model`` sections (``to_megatron_kwargs``). So a
  lowering that names a field megatron-core lacks, or a shape it refuses, fails here as it would on a cluster.
  Weights are initialised on the host from ``seed`` (``use_cpu_initialization``), so a CPU and a GPU trainer
  with one seed start from the same version 0.
- **Packed sequences.** megatron-core packs sequences only through Transformer Engine's THD attention. Without
  TE, the core attention here (``PackedSDPAttention``) is torch's variable-length flash attention on a GPU
  (each sequence attends to itself alone; no masked block is computed) and ``scaled_dot_product_attention``
  under a block-diagonal causal mask elsewhere. The rotary angles come from per-sequence position ids, so a
  packed row computes exactly what each of its sequences would alone (``tests/unit/test_megatron_trainer.py``
  checks it; ``tests/gpu/test_megatron_gpu.py`` checks the two attentions agree). Rows are packed by
  ``torch_trainer.pack``, as on CPU; the GRPO step is ``torch_trainer.grpo_step``.
- **The optimiser.** On a GPU: megatron-core's ``DistributedDataParallel`` (its contiguous fp32 gradient
  buffer) and ``get_megatron_optimizer`` from the lowered ``optimizer`` and ``ddp`` sections (Adam with fp32
  main weights under bf16 parameters, clipping by the lowered ``clip_grad``). Both allocate CUDA buffers, so on
  a CPU (tests) the same lowered values drive ``torch.optim.AdamW`` with fp32 parameters instead.
- **Export** (``hf_weights``): Megatron's fused tensors split into the checkpoint's names, which is what
  vLLM's weight loader takes: ``linear_qkv`` -> ``q_proj``/``k_proj``/``v_proj`` (Megatron interleaves them per
  query group: the group's query heads, then its key head, then its value head), ``linear_fc1`` ->
  ``gate_proj``/``up_proj`` (gate first), norms and embeddings renamed. ``megatron_weights`` is the inverse,
  for starting from a checkpoint.
- **Memory.** The output layer runs only where a trained token is predicted, and the log-softmax keeps one fp32
  copy of those logits (``token_logprob``). On a GPU, SwiGLU is megatron-core's compiled one, which keeps only
  its input. ``bench/megatron_train.py`` measured the planned Qwen3-1.7B layout on an H100 within the plan's
  memory.
- **MoE layers** (one rank, so expert parallelism 1): megatron-core's ``MoELayer`` with its top-k router as
  lowered (softmax or sigmoid scores, pre-softmax or renormalised top-k, fp32 router logits, dense layers where
  ``moe_layer_freq`` says) and its token dispatcher. The experts are dora's ``GroupedExperts`` (two grouped
  GEMMs per layer through ``torch._grouped_mm``): megatron-core's own grouped experts need Transformer Engine or
  the ``grouped_gemm`` package, and its ``SequentialMLP`` (one expert after another) ran 7.5x slower than the
  cost model on an H100 (bench/RESULTS.md). The export writes the Qwen-MoE/DeepSeek checkpoint layout
  (``mlp.gate``; ``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``, sliced from the stacked expert
  weights; ``mlp.gate.e_score_correction_bias``). Mixtral's ``block_sparse_moe.experts.{e}.w1``/``w2``/``w3``
  names are not written: the lowered config does not say which layout the checkpoint uses. megatron-core's
  router runs on CUDA only (it moves its weight to the current CUDA device), so an MoE model is built on a CPU
  (its weights, their names) but trained only on a GPU.

Not written (refused with ``MegatronTrainerError`` before anything is built): tensor, pipeline, context or
expert parallelism (a launcher with ``torchrun`` and megatron-core's pipeline schedules), shared experts,
multi-latent attention, biases on every linear, LayerNorm, and configs with lowering limitations or extra
attributes (YaRN). Data parallelism is not launched either: the trainer is one rank, whatever dp the plan chose.
Transformer Engine kernels (fused attention, THD packing, grouped expert GEMMs, FP8) are not used.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dora.runtime.engines.sampling import logit_scale
from dora.runtime.engines.tiny_model import packed_attention_mask
from dora.runtime.engines.torch_trainer import (
    GRPOSettings,
    GRPOSteps,
    PackedRows,
    scale_gradients,
)


class MegatronTrainerError(ValueError):
    """The lowered config asks for something this trainer does not run (the message says what and why)."""


@dataclass(frozen=True, kw_only=True)
class MegatronTrainerConfig:
    megatron: dict[str, Any]
    """The lowered ``megatron/config.json`` (all of it)."""
    grpo: GRPOSettings
    device: str = "cuda"
    """``cuda`` (bf16 as lowered, megatron-core's optimiser) or ``cpu`` (fp32, torch AdamW; for tests)."""
    seed: int = 0


def unsupported(config: dict[str, Any]) -> list[str]:
    """Why this trainer cannot run ``config`` (empty when it can)."""
    mp, tr = config["model_parallel"], config["transformer"]
    out = [f"{field} = {mp[field]} (this trainer runs one rank; multi-rank training needs torchrun and "
           "megatron-core's pipeline schedules, which dora does not launch yet)"
           for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                         "expert_model_parallel_size") if mp.get(field, 1) != 1]
    if config["transformer_class"] != "TransformerConfig":
        out.append(f"transformer_class {config['transformer_class']} (multi-latent attention is not written)")
    if tr.get("add_bias_linear"):
        out.append("add_bias_linear (biases on every linear layer: no Llama/Qwen checkpoint has them; the export "
                   "maps q/k/v biases only)")
    if tr.get("normalization", "LayerNorm") != "RMSNorm":
        out.append(f"normalization {tr.get('normalization', 'LayerNorm')!r} (the export maps RMSNorm weights only)")
    if tr.get("num_moe_experts") and not (tr.get("gated_linear_unit") and tr.get("activation_func") == "silu"):
        out.append("num_moe_experts with experts that are not SwiGLU (gated_linear_unit, activation_func silu: "
                   "the only experts written here)")
    if tr.get("moe_shared_expert_intermediate_size"):
        out.append(f"moe_shared_expert_intermediate_size = {tr['moe_shared_expert_intermediate_size']} "
                   "(shared experts are not written)")
    if config.get("transformer_attributes"):
        out.append(f"transformer_attributes {sorted(config['transformer_attributes'])} (YaRN is not written)")
    if config["gpt_model"].get("position_embedding_type", "rope") != "rope":
        out.append(f"position_embedding_type {config['gpt_model']['position_embedding_type']!r} (rope only)")
    out.extend(f"lowering limitation: {item}" for item in config.get("limitations", []))
    return out


def init_single_rank(device: str, seed: int = 0) -> None:
    """torch.distributed with one rank (gloo on CPU, NCCL on a GPU) and megatron-core's parallel state at size 1;
    idempotent. The rendezvous is a file, so no port is taken."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="dora-megatron-rendezvous-")
        os.close(fd)
        os.unlink(path)  # the store creates it
        # one group serves CPU and GPU tensors where there is a GPU (a process may hold trainers on both)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.startswith("cuda"):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        if not get_cuda_rng_tracker().is_initialized():
            model_parallel_cuda_manual_seed(seed)  # activation recomputation restores these RNG states


def _router_gemm_without_te() -> None:
    """megatron-core 0.16.1's router linear (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, a name ``moe_utils`` binds only when Transformer Engine imports: without TE
    every MoE forward raises NameError. Bound to None, the function takes its own torch path (``torch.mm`` in the
    router dtype), which is what it was written to do without TE."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _varlen_attention() -> Any:
    """torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``, CUDA only), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _core_attention_class() -> type:
    import inspect

    from megatron.core.transformer.module import MegatronModule

    varlen = _varlen_attention()
    varlen_params = set(inspect.signature(varlen).parameters) if varlen is not None else set()

    class PackedSDPAttention(MegatronModule):
        """megatron-core's core-attention interface for packed rows. ``attention_mask`` is either

        - ``cu_seqlens`` (int32, ``[n + 1]``): where each sequence starts in the rows laid end to end; each
          sequence then attends causally to itself alone, through variable-length flash attention, which
          computes no masked-out block (a GPU); or
        - a bool mask ``[R, 1, L, L]`` (True = masked, megatron's convention) for
          ``F.scaled_dot_product_attention`` (any device).
        """

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor, attn_mask_type: Any = None, attention_bias: Any = None,
                    packed_seq_params: Any = None) -> torch.Tensor:
            """``query [s, b, heads, d]``, ``key``/``value [s, b, groups, d]`` -> ``[s, b, heads * d]``."""
            if attention_bias is not None or packed_seq_params is not None:
                raise MegatronTrainerError("PackedSDPAttention takes a mask, not an attention bias or THD params")
            s, b, heads, d = query.shape
            group = heads // key.shape[2]
            if attention_mask.dtype == torch.int32:
                q, k, v = (t.transpose(0, 1).reshape(b * s, t.shape[2], d) for t in (query, key, value))
                kwargs: dict[str, Any] = {"scale": self.softmax_scale}
                if "window_size" in varlen_params:
                    kwargs["window_size"] = (-1, 0)  # causal
                else:
                    kwargs["is_causal"] = True
                if group > 1 and "enable_gqa" in varlen_params:
                    kwargs["enable_gqa"] = True
                elif group > 1:
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                # the row width bounds every sequence (an exact maximum would cost a device-to-host sync)
                out = varlen(q, k, v, attention_mask, attention_mask, s, s, **kwargs)
                return out.reshape(b, s, heads * d).transpose(0, 1)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return PackedSDPAttention


def _grouped_experts_class() -> type:
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
    from megatron.core.transformer.module import MegatronModule

    class GroupedExperts(MegatronModule):
        """megatron-core's experts interface (``SequentialMLP``'s) for SwiGLU experts, with every expert's
        weights in one tensor: ``weight1 [E, 2f, h]`` (each expert's ``linear_fc1``, gate rows then up rows) and
        ``weight2 [E, h, f]`` (its ``linear_fc2``). On a GPU in bf16 a layer's experts run as two grouped GEMMs
        (``torch._grouped_mm`` over the dispatcher's token counts: no per-expert launches and no device-to-host
        sync); elsewhere, one expert after another. The router's probabilities scale the activation before
        ``linear_fc2``, as megatron-core's MLP does (its fused weighted SwiGLU where ``bias_activation_fusion``)."""

        def __init__(self, num_local_experts: int, config: Any, submodules: Any = None,
                     pg_collection: Any = None) -> None:
            super().__init__(config=config)
            e, h, f = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size
            # drawn in fp32 on the host, then cast, as megatron-core's CPU initialisation does (drawn in bf16, the
            # 4-layer MoE bench's model took 98 s to build on the H100 machine, against 16-28 s)
            w1, w2 = torch.zeros(e, 2 * f, h), torch.zeros(e, h, f)
            if config.perform_initialization:
                config.init_method(w1)
                config.output_layer_init_method(w2)
            self.weight1 = torch.nn.Parameter(w1.to(config.params_dtype))
            self.weight2 = torch.nn.Parameter(w2.to(config.params_dtype))

        def _activation(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
            if self.config.bias_activation_fusion:
                out: torch.Tensor = weighted_bias_swiglu_impl(x, None, probs[:, None])
                return out
            gate, up = x.chunk(2, dim=-1)
            return (F.silu(gate) * up * probs[:, None]).to(x.dtype)

        def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                    probs: torch.Tensor) -> tuple[torch.Tensor, None]:
            """``hidden [T, h]`` sorted by expert, ``tokens_per_expert [E]``, ``probs [T]`` -> ``[T, h]``."""
            if hidden.is_cuda and hidden.dtype == torch.bfloat16:
                offs = tokens_per_expert.to(device=hidden.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
                x = torch._grouped_mm(hidden, self.weight1.transpose(1, 2), offs=offs)
                return torch._grouped_mm(self._activation(x, probs), self.weight2.transpose(1, 2), offs=offs), None
            outs, start = [], 0
            for e, n in enumerate(tokens_per_expert.tolist()):
                x = hidden[start:start + n] @ self.weight1[e].t()
                outs.append(self._activation(x, probs[start:start + n]) @ self.weight2[e].t())
                start += n
            return torch.cat(outs), None

    return GroupedExperts


def cu_seqlens(packed: PackedRows) -> torch.Tensor:
    """int32 ``[n + 1]``: where each packed sequence (and each row's unfilled tail) starts, rows laid end to
    end, then the total; computed on the host, where the packing is known."""
    starts: list[int] = []
    seg, width = packed.segment_ids.tolist(), packed.segment_ids.shape[1]
    for r, row in enumerate(seg):
        starts.extend(r * width + i for i in range(width) if i == 0 or row[i] != row[i - 1])
    return torch.tensor([*starts, len(seg) * width], dtype=torch.int32)


def _transformer_config(config: dict[str, Any], device: str) -> Any:
    from megatron.core.transformer import TransformerConfig

    from dora.lower.megatron import to_megatron_kwargs

    kwargs = {**to_megatron_kwargs(config["transformer"]), **to_megatron_kwargs(config["model_parallel"])}
    # Kernels megatron-core fuses through Transformer Engine or Apex are off: the local modules run.
    kwargs.update(use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
                  masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                  apply_rope_fusion=False)
    if kwargs.get("num_moe_experts"):
        # the experts are GroupedExperts, put in the layer spec; megatron-core's grouped GEMMs need Transformer
        # Engine or the grouped_gemm package
        kwargs["moe_grouped_gemm"] = False
        if device == "cpu":  # the all-to-all dispatcher takes a CUDA stream when built; one rank exchanges nothing
            kwargs["moe_token_dispatcher_type"] = "allgather"
    if device == "cpu":
        kwargs.update(params_dtype=torch.float32, bf16=False, fp16=False, pipeline_dtype=None)
    elif kwargs.get("gated_linear_unit") and kwargs.get("activation_func") is F.silu:
        # megatron-core's own SwiGLU (torch.compile'd; keeps only its input for the backward)
        kwargs["bias_activation_fusion"] = True
    return TransformerConfig(**kwargs)


def build_gpt_model(config: dict[str, Any], *, device: str, seed: int = 0) -> Any:
    """``GPTModel`` for the lowered ``config`` on ``device`` (see the module docstring)."""
    problems = unsupported(config)
    if problems:
        raise MegatronTrainerError("the Megatron trainer cannot run this plan: " + "; ".join(problems))
    init_single_rank(device, seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex is not installed. Falling back to Torch Norm": intended
        tc = _transformer_config(config, device)
        if tc.num_moe_experts:  # one spec per layer: dense where moe_layer_freq says 0
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            _router_gemm_without_te()
            spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization=tc.normalization,
                                              qk_l2_norm=False)
            layers = spec.layer_specs
            experts = ModuleSpec(module=_grouped_experts_class())
            for layer in layers:
                if hasattr(layer.submodules.mlp.submodules, "experts"):
                    layer.submodules.mlp.submodules.experts = experts
        else:
            spec = get_gpt_layer_local_spec(normalization=tc.normalization, qk_layernorm=tc.qk_layernorm)
            layers = [spec]
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = _core_attention_class()
        torch.manual_seed(seed)
        model = GPTModel(config=tc, transformer_layer_spec=spec, **config["gpt_model"])
    if tc.bf16 or tc.fp16:  # as Megatron-LM's Float16Module: every weight in the training dtype, norms too
        model = model.to(dtype=torch.bfloat16 if tc.bf16 else torch.float16)
    return model.to(device)


def _decoder_output(model: Any, packed: PackedRows) -> torch.Tensor:
    """Hidden states ``[L, R, h]`` after the decoder (its final norm included) for ``packed``'s rows."""
    device = model.embedding.word_embeddings.weight.device
    ids, positions = packed.token_ids.to(device), packed.position_ids.to(device)
    hidden = model.embedding(input_ids=ids, position_ids=positions)  # [L, R, h]
    inv_freq = model.rotary_pos_emb.inv_freq.to(device=device, dtype=torch.float32)
    angles = positions.t().to(torch.float32)[..., None] * inv_freq  # [L, R, rotary_dim / 2]
    rotary = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # megatron's non-interleaved layout
    if device.type == "cuda" and _varlen_attention() is not None:
        mask = cu_seqlens(packed).to(device, non_blocking=True)
    else:
        mask = ~packed_attention_mask(positions, packed.segment_ids.to(device))
    return model.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)


def _output_layer(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight)
    return logits


def packed_logits(model: Any, packed: PackedRows) -> torch.Tensor:
    """Logits ``[R, L, vocab]`` of ``packed``'s rows: embedding, the decoder under the block-diagonal mask with
    per-sequence rotary positions, the output layer (GPTModel's own forward, less its position handling)."""
    return _output_layer(model, _decoder_output(model, packed)).transpose(0, 1)


class _TokenLogProb(torch.autograd.Function):
    """``log softmax(logits / T)[target]`` per row, keeping one fp32 ``[N, vocab]`` tensor (the softmax, which the
    backward turns into the gradient in place), as Megatron's vocab-parallel cross entropy does. The autograd
    composition keeps two (log-softmax's input and output); at a 150K-token vocabulary these are a step's largest
    tensors. Backward runs once (the graph is not retained)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        x = logits.float()
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()  # fp32 logits: do not overwrite the caller's tensor
        if temperature != 1.0:
            x.div_(temperature)
        x.sub_(x.amax(dim=-1, keepdim=True))
        picked = x.gather(1, targets[:, None]).squeeze(1)
        x.exp_()
        total = x.sum(dim=-1, keepdim=True)
        x.div_(total)  # the softmax
        ctx.save_for_backward(x, targets)
        ctx.temperature, ctx.in_dtype = temperature, logits.dtype
        return picked - total.squeeze(1).log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, targets = ctx.saved_tensors
        g = softmax.mul_(-grad[:, None])  # d logp / d x = onehot - softmax
        g.scatter_add_(1, targets[:, None], grad[:, None])
        if ctx.temperature != 1.0:
            g.div_(ctx.temperature)
        return g.to(ctx.in_dtype), None, None


def token_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[N]`` ``log softmax(logits / temperature)[targets]`` for ``logits [N, vocab]``, computed in fp32 (temperature
    0, greedy sampling: under ``softmax(logits)``, as the sampler records it)."""
    out: torch.Tensor = _TokenLogProb.apply(logits, targets, logit_scale(temperature))
    return out


def trained_token_logprobs(model: Any, packed: PackedRows, temperature: float) -> torch.Tensor:
    """``[N]`` log-probs of ``packed``'s trained tokens under ``softmax(logits / temperature)``. The output layer
    runs only at the positions that predict a trained token, and the log-softmax keeps one fp32 copy of the
    logits (``token_logprob``)."""
    hidden = _decoder_output(model, packed)
    flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[packed.logit_index.to(hidden.device)]
    logits = _output_layer(model, flat[:, None, :])[:, 0]
    return token_logprob(logits, packed.target_ids.to(logits.device), temperature)


def moe_layers(tr: dict[str, Any]) -> list[bool]:
    """Per decoder layer: an MoE layer (True) or a dense FFN, as megatron-core reads ``moe_layer_freq`` (a 0/1
    list, or every n-th layer)."""
    n = tr["num_layers"]
    if not tr.get("num_moe_experts"):
        return [False] * n
    freq = tr.get("moe_layer_freq", 1)
    return [bool(f) for f in freq] if isinstance(freq, list) else [i % freq == 0 for i in range(n)]


def _ffn_names(tr: dict[str, Any], moe: bool) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """One layer's FFN, less an MoE layer's experts (``_expert_names``): (Megatron name, Hugging Face name) of
    the tensors that only change name, and (Megatron fused gate+up name, Hugging Face gate name, up name) of those
    split in two; relative to the layer."""
    if moe:
        renames = [("mlp.router.weight", "mlp.gate.weight")]
        if tr.get("moe_router_enable_expert_bias"):
            renames.append(("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"))
        return renames, []
    if tr.get("gated_linear_unit"):
        return ([("mlp.linear_fc2.weight", "mlp.down_proj.weight")],
                [("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")])
    return [("mlp.linear_fc2.weight", "mlp.down_proj.weight"), ("mlp.linear_fc1.weight", "mlp.up_proj.weight")], []


def _expert_names(i: int, e: int) -> tuple[str, str, str]:
    """Layer ``i``'s expert ``e`` under the checkpoint's names: gate, up, down."""
    p = f"model.layers.{i}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def _layer_map(tr: dict[str, Any], moe: bool) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """``_ffn_names`` for a whole layer (``{i}`` stands for its index), the attention's renames included."""
    names = [("input_layernorm.weight", "input_layernorm.weight"),
             ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
             ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    if tr.get("qk_layernorm"):
        names += [("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                  ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
    renames, split = _ffn_names(tr, moe)
    m_, h_ = "decoder.layers.{i}.", "model.layers.{i}."
    return ([(m_ + m, h_ + h) for m, h in names + renames],
            [(m_ + m, h_ + gate, h_ + up) for m, gate, up in split])


def _qkv_shape(tr: dict[str, Any]) -> tuple[int, int, int]:
    """(query groups, query heads per group, head dim)."""
    groups = tr.get("num_query_groups") or tr["num_attention_heads"]
    return groups, tr["num_attention_heads"] // groups, tr.get("kv_channels") or \
        tr["hidden_size"] // tr["num_attention_heads"]


def hf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A GPTModel state dict (no ``_extra_state``) under the checkpoint's (Hugging Face Llama/Qwen) names, as
    detached contiguous CPU tensors. See the module docstring for the splits."""
    tr = config["transformer"]
    groups, per_group, d = _qkv_shape(tr)
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if not config["gpt_model"].get("share_embeddings_and_output_weights", True):
        out["lm_head.weight"] = state["output_layer.weight"]
    for i, moe in enumerate(moe_layers(tr)):
        renames, split = _layer_map(tr, moe)
        for m, h in renames:
            out[h.format(i=i)] = state[m.format(i=i)]
        for fc1, gate, up in split:
            out[gate.format(i=i)], out[up.format(i=i)] = state[fc1.format(i=i)].chunk(2, dim=0)
        if moe:  # GroupedExperts: weight1 [E, 2f, h] (gate rows, then up rows), weight2 [E, h, f]
            w1, w2 = (state[f"decoder.layers.{i}.mlp.experts.weight{n}"] for n in (1, 2))
            for e in range(w1.shape[0]):
                gate, up, down = _expert_names(i, e)
                out[gate], out[up] = w1[e].chunk(2, dim=0)
                out[down] = w2[e]
        for kind in ("weight", "bias") if tr.get("add_qkv_bias") else ("weight",):
            fused = state[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"]
            blocks = fused.reshape(groups, per_group + 2, d, *fused.shape[1:])
            out[f"model.layers.{i}.self_attn.q_proj.{kind}"] = blocks[:, :per_group].reshape(-1, *fused.shape[1:])
            out[f"model.layers.{i}.self_attn.k_proj.{kind}"] = blocks[:, per_group].reshape(-1, *fused.shape[1:])
            out[f"model.layers.{i}.self_attn.v_proj.{kind}"] = blocks[:, per_group + 1].reshape(-1, *fused.shape[1:])
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def megatron_weights(hf: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_weights``: checkpoint names -> a GPTModel state dict (without ``_extra_state``).
    A name the model needs and ``hf`` lacks, or one it has and the model does not use, is an error."""
    tr = config["transformer"]
    groups, per_group, d = _qkv_shape(tr)
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise MegatronTrainerError(f"the checkpoint weights lack {name!r}")
        used.add(name)
        return hf[name]

    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": get("model.norm.weight")}
    if not config["gpt_model"].get("share_embeddings_and_output_weights", True):
        out["output_layer.weight"] = get("lm_head.weight")
    for i, moe in enumerate(moe_layers(tr)):
        renames, split = _layer_map(tr, moe)
        for m, h in renames:
            out[m.format(i=i)] = get(h.format(i=i))
        for fc1, gate, up in split:
            out[fc1.format(i=i)] = torch.cat([get(gate.format(i=i)), get(up.format(i=i))])
        if moe:
            names = [_expert_names(i, e) for e in range(tr["num_moe_experts"])]
            out[f"decoder.layers.{i}.mlp.experts.weight1"] = torch.stack(
                [torch.cat([get(gate), get(up)]) for gate, up, _ in names])
            out[f"decoder.layers.{i}.mlp.experts.weight2"] = torch.stack([get(down) for _, _, down in names])
        for kind in ("weight", "bias") if tr.get("add_qkv_bias") else ("weight",):
            q, k, v = (get(f"model.layers.{i}.self_attn.{p}_proj.{kind}") for p in "qkv")
            rest = q.shape[1:]
            blocks = torch.cat([q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest),
                                v.reshape(groups, 1, d, *rest)], dim=1)
            out[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = blocks.reshape(-1, *rest)
    unused = sorted(set(hf) - used)
    if unused:
        raise MegatronTrainerError(f"the checkpoint weights hold names this model does not use: {unused[:4]}")
    return out


def _weights_only(model: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _cpu_copy(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").clone() for k, v in _weights_only(model).items()}


def _load(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Every weight of ``model`` from ``weights`` (``_extra_state`` entries, which hold no weights, may be absent)."""
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise MegatronTrainerError(f"weights do not match the model: missing {missing[:4]}, "
                                   f"unexpected {result.unexpected_keys[:4]}")


class MegatronTrainer(GRPOSteps):
    """Implements ``Trainer`` (see ``base.py``) on megatron-core; see the module docstring."""

    def __init__(self, config: MegatronTrainerConfig, *,
                 initial_weights: dict[str, torch.Tensor] | None = None) -> None:
        self.config = config
        if config.megatron["transformer"].get("num_moe_experts") and not config.device.startswith("cuda"):
            raise MegatronTrainerError("megatron-core's MoE router runs on CUDA only (it moves its weight to the "
                                       "current CUDA device): train an MoE model on a GPU")
        self.model = build_gpt_model(config.megatron, device=config.device, seed=config.seed)
        if initial_weights is not None:
            _load(self.model, megatron_weights(initial_weights, config.megatron))
        opt = config.megatron["optimizer"]
        self.on_gpu = config.device.startswith("cuda")
        if self.on_gpu:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            from dora.lower.megatron import to_megatron_kwargs

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Falling back to Torch optimizers": intended without Apex/TE
                self.ddp = DistributedDataParallel(config=self.model.config,
                                                   ddp_config=DistributedDataParallelConfig(**config.megatron["ddp"]),
                                                   module=self.model)
                self.optimizer: Any = get_megatron_optimizer(OptimizerConfig(**to_megatron_kwargs(opt)), [self.ddp])
        else:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=opt["lr"], betas=(opt["adam_beta1"], opt["adam_beta2"]),
                eps=opt["adam_eps"], weight_decay=opt["weight_decay"])
        self.clip_grad = float(opt["clip_grad"])
        self.version = 0
        self.step = 0
        self.reference: Any = None
        """The KL penalty's reference policy: version 0's weights in a second model, frozen at the first step."""

    def logprobs(self, packed: PackedRows) -> torch.Tensor:
        """``[N]`` log-probs of ``packed``'s trained tokens at the configured temperature."""
        return trained_token_logprobs(self.model, packed, self.config.grpo.temperature)

    def zero_grad(self) -> None:
        if self.on_gpu:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def apply_gradients(self) -> float:
        if self.on_gpu:
            self.ddp.finish_grad_sync()
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise FloatingPointError("the Megatron optimizer skipped its step (non-finite gradients)")
            return float(grad_norm)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad))
        self.optimizer.step()
        return grad_norm

    def scale_gradients(self, factor: float) -> None:
        if self.on_gpu:
            self.ddp.scale_gradients(factor)  # its contiguous gradient buffer
        else:
            scale_gradients(self.model, factor)

    def grpo_settings(self) -> GRPOSettings:
        return self.config.grpo

    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, weights)`` under the checkpoint's names (``hf_weights``)."""
        return self.version, hf_weights(_weights_only(self.model), self.config.megatron)

    def state_dict(self) -> dict[str, object]:
        state = {"model": _cpu_copy(self.model), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                 "step": self.step, "version": self.version}
        if self.reference is not None:
            state["reference"] = _cpu_copy(self.reference)
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        _load(self.model, state["model"])  # type: ignore[arg-type]
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])  # type: ignore[call-overload]
        self.version = int(state["version"])  # type: ignore[call-overload]
        reference = state.get("reference")
        self.reference = None if reference is None else self._frozen(reference)  # type: ignore[arg-type]

    def _frozen(self, weights: dict[str, torch.Tensor]) -> Any:
        """A second model holding ``weights``, without gradients."""
        model = build_gpt_model(self.config.megatron, device=self.config.device, seed=self.config.seed)
        _load(model, weights)
        return model.requires_grad_(False).eval()

    def _reference_logprobs(self) -> Callable[[PackedRows], torch.Tensor] | None:
        """The reference policy's log-probs (None without a KL penalty), freezing version 0's weights first."""
        if self.config.grpo.kl_coef == 0:
            return None
        if self.reference is None:
            if self.version != 0:
                raise MegatronTrainerError(f"kl_coef needs the reference policy (version 0's weights), but the "
                                           f"trainer is at version {self.version} and has none: its checkpoint was "
                                           "written without them")
            self.reference = self._frozen(_weights_only(self.model))
        reference = self.reference
        return lambda rows: trained_token_logprobs(reference, rows, self.config.grpo.temperature)
