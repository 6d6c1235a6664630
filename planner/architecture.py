"""Model catalog: transformer architectures, with every size the cost model needs derived from the shape.

Parameter counts, active parameters, matmul FLOPs per token and KV-cache bytes per token are computed from the
layer shapes below, never typed in; `tests/unit/test_architecture.py` checks them against published totals.

Notation (used throughout `planner`):
    L      layers (decoder blocks); A = attention sub-layers per block (1, or 2 in LongCat-Flash)
    h      hidden size;  a = query heads;  n_kv = KV heads;  d = head dim;  V = vocabulary size
    f      dense FFN intermediate size;  f_e = expert intermediate size
    E      routed experts;  Z = zero-compute (identity) experts;  k = experts per token (top-k over E + Z)
    S      shared experts (each of size f_e, always active)
    b      bytes per element

All FFNs are gated (SwiGLU): 3*h*f weights.  Norm weights are counted (h per RMSNorm).  Multi-token-prediction
modules (DeepSeek-V3 `num_nextn_predict_layers`) are not counted: RL training and rollout do not use them, and
published totals (671B) exclude them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Any

DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1})
"""Bytes per weight of a spec's ``model.dtype``: the rollout engine's weights (fp8: vLLM's ``quantization: fp8``)."""
ACTIVATION_BYTES: Mapping[str, int] = MappingProxyType({"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2})
"""Bytes per element of everything else: activations, the KV cache, messages, and the trainer's weights. An fp8 spec
quantizes only the rollout engine's weights: vLLM keeps the model's bf16 for activations and, with no
``kv_cache_dtype``, for its KV cache, and the trainer trains bf16 (``dora/lower``)."""

__all__ = [
    "ACTIVATION_BYTES",
    "DTYPE_BYTES",
    "MLA",
    "MODEL_PRESETS",
    "HFConfigError",
    "ModelArch",
    "arch_from_hf_config",
    "catalog_fingerprint",
    "get_preset",
    "rope_scaling_items",
]


@dataclass(frozen=True, kw_only=True)
class MLA:
    """Multi-head latent attention shape (DeepSeek-V2/V3).  The KV cache stores the compressed latent
    (kv_lora_rank) plus the shared RoPE key (qk_rope_head_dim) per token and layer."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    """A decoder-only transformer, dense or MoE, GQA or MLA.  See module docstring for notation.

    Frozen: the parameter counts the cost model reads per simulated step are computed once (``cached_property``)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    """Dense FFN intermediate size f (dense layers, leading dense layers of MoE models, LongCat's dense FFNs)."""
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3): 2*d weights per attention sub-layer."""
    num_experts: int = 0
    """Routed experts E; 0 means dense."""
    experts_top_k: int = 0
    num_shared_experts: int = 0
    moe_ffn_hidden_size: int = 0
    first_dense_layers: int = 0
    """Leading layers with a dense FFN instead of MoE (DeepSeek first_k_dense_replace)."""
    mla: MLA | None = None
    num_zero_experts: int = 0
    """Z identity experts in the routing pool (LongCat-Flash): chosen slots that cost no compute."""
    attention_per_layer: int = 1
    """A: attention sub-layers per block (LongCat-Flash: 2)."""
    dense_ffns_per_moe_layer: int = 0
    """Dense FFNs running beside the MoE in each MoE block (LongCat-Flash shortcut-connected MoE: 2)."""
    moe_sequence_parallel: bool = True
    """MoE only: vLLM's model splits a rank's tokens over its TP devices before the experts when it serves with
    attention data parallelism and TP > 1 (sequence-parallel MoE: Qwen3-MoE, DeepSeek-V2/V3, Kimi-K2). vLLM's
    LongCat-Flash does not: each device of a rank dispatches all of the rank's tokens to the experts."""
    max_context_tokens: int | None = None
    """The longest sequence (prompt + response) the checkpoint is configured for: ``max_position_embeddings``, or
    with a RoPE scaling ``factor`` the (original) length times it, as vLLM derives its limit on ``max_model_len``;
    None when unknown (no check)."""
    router_score: str = "softmax"
    """MoE only: how router logits become expert scores, ``softmax`` or ``sigmoid`` (DeepSeek-V3 ``scoring_func``).
    Like the RoPE fields below, costs nothing: the trainer must route as the checkpoint does."""
    router_normalizes_topk: bool = True
    """MoE only: the chosen experts' weights are renormalised to sum to 1 (``norm_topk_prob``)."""
    router_scaling: float = 1.0
    """MoE only: factor on the routed experts' output (``routed_scaling_factor``)."""
    router_groups: int = 1
    """MoE only: expert groups for group-limited routing (``n_group``; 1 = none)..."""
    router_group_topk: int = 1
    """... and the groups each token may pick its experts from (``topk_group``)."""
    router_expert_bias: bool = False
    """MoE only: a per-expert bias steers the top-k choice (aux-loss-free balancing, ``topk_method: noaux_tc``)."""
    rope_theta: float | None = None
    """RoPE base frequency (config.json ``rope_theta``); None when unknown. Costs nothing: the trainer's config
    needs it to rebuild the checkpoint's positions (Megatron's ``rotary_base``)."""
    norm_eps: float | None = None
    """RMSNorm epsilon (``rms_norm_eps``); None when unknown. Costs nothing, like ``rope_theta``."""
    rope_scaling: tuple[tuple[str, float | int | str], ...] = ()
    """The checkpoint's RoPE scaling (config.json ``rope_scaling``: ``rope_type``, ``factor``, ...) as sorted
    ``(key, value)`` pairs; empty when it has none."""

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                    "vocab_size", "attention_per_layer")
        for field in positive:
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be >= 1")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts:
            if not 1 <= self.experts_top_k <= self.num_experts + self.num_zero_experts:
                raise ValueError(f"{self.name}: experts_top_k={self.experts_top_k} must lie in "
                                 f"[1, num_experts + num_zero_experts]")
            if self.moe_ffn_hidden_size < 1:
                raise ValueError(f"{self.name}: an MoE model needs moe_ffn_hidden_size >= 1")
            if not 0 <= self.first_dense_layers <= self.num_layers:
                raise ValueError(f"{self.name}: first_dense_layers must lie in [0, num_layers]")
        elif self.ffn_hidden_size < 1:
            raise ValueError(f"{self.name}: a dense model needs ffn_hidden_size >= 1")
        if self.router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"{self.name}: router_score must be softmax or sigmoid, got {self.router_score!r}")
        if not (self.router_scaling > 0 and 1 <= self.router_group_topk <= self.router_groups):
            raise ValueError(f"{self.name}: need router_scaling > 0 and 1 <= router_group_topk <= router_groups")
        for field in ("rope_theta", "norm_eps"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"{self.name}: {field} must be > 0, got {value}")

    # ----- shape helpers ------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def num_dense_ffn_layers(self) -> int:
        """Layers whose (only) FFN is dense."""
        return self.num_layers - self.num_moe_layers

    @property
    def num_attention_layers(self) -> int:
        """L * A: attention sub-layers in the whole model (each one has its own KV cache)."""
        return self.num_layers * self.attention_per_layer

    @property
    def num_dense_ffns(self) -> int:
        """Dense FFN instances in the model: one per dense layer plus the side FFNs of MoE blocks."""
        return self.num_dense_ffn_layers + self.num_moe_layers * self.dense_ffns_per_moe_layer

    @property
    def qk_head_dim(self) -> int:
        return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def expected_routed_experts_per_token(self) -> float:
        """k_real = k * E / (E + Z): routed experts a token actually computes, averaged under uniform routing
        over the E + Z slots (equals k when there are no zero-compute experts)."""
        if not self.is_moe:
            return 0.0
        return self.experts_top_k * self.num_experts / (self.num_experts + self.num_zero_experts)

    # ----- parameter counts ---------------------------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """Weights of one attention sub-layer (projections, biases, q/k norms; not the pre-norm).

        GQA: h*a*d (q) + 2*h*n_kv*d (k, v) + a*d*h (o) [+ a*d + 2*n_kv*d bias] [+ 2*d qk-norm].
        MLA: [h*r_q + r_q + r_q*a*(d_nope+d_rope)] or h*a*(d_nope+d_rope) for q; h*(r_kv+d_rope) + r_kv for the
        compressed kv; r_kv*a*(d_nope+d_v) to expand it; a*d_v*h for o.
        """
        h, a = self.hidden_size, self.num_attention_heads
        if self.mla is None:
            d, kv = self.head_dim, self.num_kv_heads
            total = h * a * d + 2 * h * kv * d + a * d * h
            if self.qkv_bias:
                total += a * d + 2 * kv * d
            if self.qk_norm:
                total += 2 * d
            return total
        m = self.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * a * qk
        else:
            q = h * a * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * a * (
            m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + a * m.v_head_dim * h

    @property
    def dense_ffn_params(self) -> int:
        """3*h*f (gate, up, down)."""
        return 3 * self.hidden_size * self.ffn_hidden_size

    @property
    def expert_params(self) -> int:
        """One routed or shared expert: 3*h*f_e."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def router_params(self) -> int:
        """Router of one MoE layer: h*(E + Z)."""
        return self.hidden_size * (self.num_experts + self.num_zero_experts)

    @property
    def norm_params(self) -> int:
        """RMSNorm weights: two per attention sub-layer (pre-attention, pre-FFN) plus the final norm."""
        return 2 * self.hidden_size * self.num_attention_layers + self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus LM head: V*h, twice unless tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def routed_expert_params_total(self) -> int:
        """E * 3*h*f_e * (MoE layers): the part of the model that expert parallelism shards."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @cached_property
    def total_params(self) -> int:
        """N: every weight of the model (see module docstring for what is excluded)."""
        per_moe_layer = self.router_params + self.num_shared_experts * self.expert_params
        return (self.num_attention_layers * self.attention_params
                + self.num_dense_ffns * self.dense_ffn_params
                + self.num_moe_layers * per_moe_layer
                + self.routed_expert_params_total
                + self.norm_params + self.embedding_params)

    @cached_property
    def non_expert_params(self) -> int:
        """N minus routed experts: the part replicated across expert-parallel ranks."""
        return self.total_params - self.routed_expert_params_total

    def active_params_with(self, routed_experts_per_token: float) -> float:
        """Parameters one token touches when it computes `routed_experts_per_token` routed experts per MoE layer
        (embedding and LM head included, as in published "active" counts)."""
        return self.non_expert_params + self.num_moe_layers * routed_experts_per_token * self.expert_params

    @property
    def active_params(self) -> float:
        """N_act = N - routed experts + L_moe * k_real * 3*h*f_e, with k_real the expected routed experts per
        token (`expected_routed_experts_per_token`)."""
        return self.active_params_with(self.expected_routed_experts_per_token)

    @cached_property
    def matmul_params_per_token(self) -> float:
        """N_c: weights a token multiplies with = N_act minus the input embedding (a table lookup, no FLOPs),
        keeping the LM head.  Forward FLOPs of the weight matmuls are 2*N_c per token."""
        lookup = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        return self.active_params - lookup

    # ----- attention and KV cache ---------------------------------------------------------------------------
    def attention_flops_per_query_key(self, *, absorbed_mla: bool = False) -> int:
        """Forward FLOPs for one (query, key) pair summed over all attention sub-layers.

        Per sub-layer: 2*a*d_qk (scores) + 2*a*d_v (weighted sum of values).
        With `absorbed_mla` (MLA decode with the up-projections folded into q and o, as vLLM and SGLang do),
        scores and values both live in the latent space: 2*a*(r_kv + d_rope) + 2*a*r_kv.
        """
        a = self.num_attention_heads
        if absorbed_mla and self.mla is not None:
            per = 2 * a * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) + 2 * a * self.mla.kv_lora_rank
        else:
            per = 2 * a * (self.qk_head_dim + self.v_head_dim)
        return self.num_attention_layers * per

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        """Cached elements per token per attention sub-layer: GQA 2*n_kv*d (K and V); MLA r_kv + d_rope."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """KV-cache bytes per token for the whole model: L * A * kv_elements * b."""
        return self.num_attention_layers * self.kv_elements_per_token_per_layer * dtype_bytes

    def tp_shards_kv_heads(self, tp: int) -> bool:
        """Whether ``tp`` tensor-parallel ranks can hold the KV heads as vLLM's QKV projection lays them out: each
        rank a whole share (tp divides them), or each head replicated on tp / n_kv ranks (they divide tp). MLA's
        latent has no head axis: any tp."""
        return self.mla is not None or self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0

    def kv_bytes_per_token_per_device(self, dtype_bytes: float, *, tp: int) -> float:
        """KV bytes one of `tp` tensor-parallel devices stores per token.

        GQA shards KV heads: ceil(n_kv / tp) heads per device (replicated when tp > n_kv).
        MLA's latent cache has no head axis: every TP rank keeps the full latent (vLLM behaviour).
        """
        if self.mla is not None:
            return self.kv_bytes_per_token(dtype_bytes)
        heads_per_device = -(-self.num_kv_heads // tp)
        return self.num_attention_layers * 2 * heads_per_device * self.head_dim * dtype_bytes

    @property
    def num_weight_tensors(self) -> int:
        """Named weight tensors in a Hugging Face checkpoint (what a weight reload iterates over).

        Per attention sub-layer: 4 projections (+3 biases, +2 qk-norms) or MLA's 5 matrices + 2 norms; 2 norms.
        Per dense FFN or expert: 3.  Per MoE layer: 1 router (+1 ``e_score_correction_bias`` with an expert bias).
        Plus embeddings and the final norm.
        """
        if self.mla is None:
            attn = 4 + (3 if self.qkv_bias else 0) + (2 if self.qk_norm else 0)
        else:
            attn = 7 if self.mla.q_lora_rank else 5
        per_attention = attn + 2
        experts = self.num_experts + self.num_shared_experts
        router = 2 if self.router_expert_bias else 1
        return (self.num_attention_layers * per_attention + 3 * self.num_dense_ffns
                + self.num_moe_layers * (router + 3 * experts)
                + (1 if self.tie_embeddings else 2) + 1)


def rope_scaling_items(scaling: Mapping[str, Any]) -> tuple[tuple[str, float | int | str], ...]:
    """A config.json ``rope_scaling`` (or transformers 5 ``rope_parameters``) as sorted ``(key, value)`` pairs, the
    form ``ModelArch.rope_scaling`` keeps: an older config's ``type`` reads as ``rope_type``; ``rope_theta`` and
    entries that are not numbers, booleans (YaRN's ``truncate``) or strings are left out; empty for the ``default``
    (unscaled) type."""
    out: dict[str, float | int | str] = {}
    for key, value in scaling.items():
        if key == "rope_theta" or not isinstance(value, int | float | str):  # bool is an int
            continue
        if key == "type":
            if "rope_type" in scaling:
                continue
            key = "rope_type"
        out[key] = value
    if out.get("rope_type") == "default" or not out:
        return ()
    return tuple(sorted(out.items()))


def _mla_deepseek() -> MLA:
    return MLA(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _yarn(*, factor: float, beta_fast: float, beta_slow: float) -> tuple[tuple[str, float | int | str], ...]:
    """DeepSeek-V3-style YaRN ``rope_scaling`` (4096-token original context, mscale 1 on both sides)."""
    return rope_scaling_items({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 4096,
                               "beta_fast": beta_fast, "beta_slow": beta_slow, "mscale": 1.0, "mscale_all_dim": 1.0})


# Shapes from each model's published config.json (Hugging Face model cards) or, for LongCat-Flash, the
# transformers LongcatFlashConfig defaults that reproduce meituan-longcat/LongCat-Flash-Chat. RoPE base, norm
# epsilon and RoPE scaling from the same configs (the Megatron flags of slime's scripts/models/*.sh agree);
# tiny-local's are those of dora's CPU model (dora/runtime/engines/tiny_model.py).
_PRESETS: dict[str, ModelArch] = {
    "qwen2.5-7b": ModelArch(  # huggingface.co/Qwen/Qwen2.5-7B config.json
        name="qwen2.5-7b", num_layers=28, hidden_size=3584, num_attention_heads=28, num_kv_heads=4,
        head_dim=128, ffn_hidden_size=18944, vocab_size=152064, qkv_bias=True,
        max_context_tokens=131072, rope_theta=1e6, norm_eps=1e-6),
    "qwen2.5-32b": ModelArch(  # huggingface.co/Qwen/Qwen2.5-32B config.json
        name="qwen2.5-32b", num_layers=64, hidden_size=5120, num_attention_heads=40, num_kv_heads=8,
        head_dim=128, ffn_hidden_size=27648, vocab_size=152064, qkv_bias=True,
        max_context_tokens=131072, rope_theta=1e6, norm_eps=1e-5),
    "qwen3-8b": ModelArch(  # huggingface.co/Qwen/Qwen3-8B config.json
        name="qwen3-8b", num_layers=36, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
        head_dim=128, ffn_hidden_size=12288, vocab_size=151936, qk_norm=True,
        max_context_tokens=40960, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-32b": ModelArch(  # huggingface.co/Qwen/Qwen3-32B config.json
        name="qwen3-32b", num_layers=64, hidden_size=5120, num_attention_heads=64, num_kv_heads=8,
        head_dim=128, ffn_hidden_size=25600, vocab_size=151936, qk_norm=True,
        max_context_tokens=40960, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-30b-a3b": ModelArch(  # huggingface.co/Qwen/Qwen3-30B-A3B config.json
        name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_attention_heads=32, num_kv_heads=4,
        head_dim=128, ffn_hidden_size=6144, vocab_size=151936, qk_norm=True,
        num_experts=128, experts_top_k=8, moe_ffn_hidden_size=768,
        max_context_tokens=40960, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-235b-a22b": ModelArch(  # huggingface.co/Qwen/Qwen3-235B-A22B config.json
        name="qwen3-235b-a22b", num_layers=94, hidden_size=4096, num_attention_heads=64, num_kv_heads=4,
        head_dim=128, ffn_hidden_size=12288, vocab_size=151936, qk_norm=True,
        num_experts=128, experts_top_k=8, moe_ffn_hidden_size=1536,
        max_context_tokens=40960, rope_theta=1e6, norm_eps=1e-6),
    "deepseek-v3": ModelArch(  # huggingface.co/deepseek-ai/DeepSeek-V3 config.json (MTP module not counted)
        name="deepseek-v3", num_layers=61, hidden_size=7168, num_attention_heads=128, num_kv_heads=128,
        head_dim=192, ffn_hidden_size=18432, vocab_size=129280,
        num_experts=256, experts_top_k=8, num_shared_experts=1, moe_ffn_hidden_size=2048,
        first_dense_layers=3, mla=_mla_deepseek(), router_score="sigmoid", router_scaling=2.5, router_groups=8,
        router_group_topk=4, router_expert_bias=True, max_context_tokens=163840, rope_theta=1e4, norm_eps=1e-6,
        rope_scaling=_yarn(factor=40, beta_fast=32, beta_slow=1)),
    "kimi-k2": ModelArch(  # huggingface.co/moonshotai/Kimi-K2-Instruct config.json (DeepSeek-V3 architecture)
        name="kimi-k2", num_layers=61, hidden_size=7168, num_attention_heads=64, num_kv_heads=64,
        head_dim=192, ffn_hidden_size=18432, vocab_size=163840,
        num_experts=384, experts_top_k=8, num_shared_experts=1, moe_ffn_hidden_size=2048,
        first_dense_layers=1, mla=_mla_deepseek(), router_score="sigmoid", router_scaling=2.827,
        router_expert_bias=True, max_context_tokens=131072, rope_theta=5e4, norm_eps=1e-6,
        rope_scaling=_yarn(factor=32.0, beta_fast=1.0, beta_slow=1.0)),
    "longcat-flash": ModelArch(  # transformers LongcatFlashConfig defaults; arXiv 2509.01322
        name="longcat-flash", num_layers=28, hidden_size=6144, num_attention_heads=64, num_kv_heads=64,
        head_dim=192, ffn_hidden_size=12288, vocab_size=131072,
        num_experts=512, num_zero_experts=256, experts_top_k=12, moe_ffn_hidden_size=2048,
        attention_per_layer=2, dense_ffns_per_moe_layer=2, moe_sequence_parallel=False, mla=_mla_deepseek(),
        router_scaling=6.0,
        # transformers' LongcatFlashTopkRouter: top-k over softmax scores plus a correction bias, no renormalisation
        router_normalizes_topk=False, router_expert_bias=True, max_context_tokens=131072,
        rope_theta=1e7, norm_eps=1e-5),
    "tiny-local": ModelArch(  # the CPU model the local runtime trains (dora/runtime)
        name="tiny-local", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4, head_dim=16,
        ffn_hidden_size=256, vocab_size=192, tie_embeddings=True, rope_theta=1e4, norm_eps=1e-6),
}

MODEL_PRESETS: Mapping[str, ModelArch] = MappingProxyType(_PRESETS)


def get_preset(name: str) -> ModelArch:
    """Preset by key; unknown names raise KeyError listing the valid ones."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; valid names: {', '.join(sorted(MODEL_PRESETS))}") from None


def catalog_fingerprint() -> str:
    """First 16 hex digits of sha256 over the sorted JSON of every preset."""
    blob = json.dumps({k: dataclasses.asdict(v) for k, v in MODEL_PRESETS.items()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----- Hugging Face config.json --------------------------------------------------------------------------------
class HFConfigError(ValueError):
    """A config.json field is missing or unusable; `key` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config.json key {key!r}: {message}")
        self.key = key
        self.reason = message


_MOE_TYPES = {"qwen3_moe", "qwen2_moe", "mixtral"}
_MLA_TYPES = {"deepseek_v3", "deepseek_v2", "kimi_k2"}

_TRANSFORMERS_DEFAULTS: dict[str, Mapping[str, Any]] = {
    # transformers 5.23's config class of each model_type: what it gives a key config.json leaves out (its class
    # attributes). vLLM and the trainer load the checkpoint with these, so the plan reads the config as they do. Not
    # listed: num_key_value_heads and head_dim where the class (or, for Qwen2's and Qwen3-MoE's head_dim, the modeling
    # code) derives them from the heads, as dora does; and the keys the cost model is sized by (layers, hidden,
    # heads, vocabulary, a dense model's FFN, expert counts and sizes, MLA ranks): their class default is one model's
    # size, so dora requires them.
    "llama": {"max_position_embeddings": 2048, "rope_theta": 1e4, "rms_norm_eps": 1e-6},  # LlamaConfig
    "mistral": {"num_key_value_heads": 8, "sliding_window": 4096, "max_position_embeddings": 131072,  # MistralConfig
                "rope_theta": 1e4, "rms_norm_eps": 1e-6},
    "qwen2": {"num_key_value_heads": 32, "sliding_window": 4096, "max_position_embeddings": 32768,  # Qwen2Config
              "rope_theta": 1e4, "rms_norm_eps": 1e-6},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096,  # Qwen3Config
              "max_position_embeddings": 32768, "rope_theta": 1e4, "rms_norm_eps": 1e-6},
    "qwen3_moe": {"num_key_value_heads": 4, "intermediate_size": 6144, "norm_topk_prob": False,  # Qwen3MoeConfig
                  "sliding_window": 4096, "max_position_embeddings": 32768, "rope_theta": 1e4, "rms_norm_eps": 1e-6},
    "qwen2_moe": {},  # refused: its separately sized shared expert
    "mixtral": {"num_key_value_heads": 8, "intermediate_size": 14336, "max_position_embeddings": 131072,  # MixtralConfig
                "rope_theta": 1e6, "rms_norm_eps": 1e-5},
    "deepseek_v2": {"intermediate_size": 11008, "q_lora_rank": 1536, "n_shared_experts": 2,  # DeepseekV2Config
                    "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "topk_method": "greedy",
                    "norm_topk_prob": False, "max_position_embeddings": 2048, "rope_theta": 1e4, "rms_norm_eps": 1e-6},
    "deepseek_v3": {"intermediate_size": 18432, "q_lora_rank": 1536, "n_shared_experts": 1,  # DeepseekV3Config
                    "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                    "norm_topk_prob": True, "max_position_embeddings": 4096, "rope_theta": 1e4, "rms_norm_eps": 1e-6},
    "kimi_k2": {},  # no transformers class: _KIMI_REQUIRED
}
_KIMI_REQUIRED = ("q_lora_rank", "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "scoring_func",
                  "topk_method", "norm_topk_prob")
"""Kimi K2's config.json is read by the checkpoint's own code (its ``configuration_deepseek.py``), whose defaults
are not DeepSeek-V3's in transformers: these keys, which size or route the model, must be written out."""
_NULL_IS_A_VALUE = {"num_key_value_heads", "head_dim", "q_lora_rank", "sliding_window"}
"""Keys whose null means something: the heads derive the first two (transformers' ``__post_init__``), a null
q_lora_rank projects q directly (DeepSeek-V2-Lite), a null window is full attention. Any other null reads as the key
left out."""


HF_INT_MAX = 1 << 40
"""Largest integer a config.json field may hold (a vocabulary or context length is far below; the cost model's float
arithmetic is exact there)."""
MAX_ROPE_THETA = 1e12
"""Largest RoPE base a config.json or spec may give (released models use 1e4-1e7)."""
MAX_NORM_EPS = 1.0
"""Largest RMSNorm epsilon a config.json or spec may give (released models use 1e-6-1e-5)."""
MAX_ROUTER_SCALING = 1000.0
"""Largest ``routed_scaling_factor`` a config.json may give (DeepSeek-V3 2.5, Kimi K2 2.827)."""


def _int(config: Mapping[str, Any], key: str, *, default: int | None = None, minimum: int = 1) -> int:
    value = config.get(key)
    if value is None:  # absent (with no transformers default) or a null that means "derive it"
        value = default
    if value is None:
        raise HFConfigError(key, "is required but missing (or null)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise HFConfigError(key, f"must be an integer, got {value!r}")
    if value < minimum:
        raise HFConfigError(key, f"must be >= {minimum}, got {value}")
    if value > HF_INT_MAX:
        raise HFConfigError(key, f"must be at most {HF_INT_MAX}, got {value}")
    return value


def _bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise HFConfigError(key, f"must be true or false, got {value!r}")
    return value


_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor")}
"""The keys each RoPE scaling type needs (transformers' ``rope_config_validation`` requires them; vLLM and the
Megatron lowering read them)."""
_ROPE_POSITIVE = ("factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor")
"""RoPE scaling numbers that must be > 0: the frequency formulas divide by them (or take their logarithm)."""
_ROPE_NON_NEGATIVE = ("attention_factor", "mscale", "mscale_all_dim")
_CONTEXT_SCALING = ("linear", "dynamic", "yarn")
"""RoPE scaling types whose ``factor`` multiplies the context vLLM accepts (llama3's and longrope's
``max_position_embeddings`` is already the scaled length)."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_rope_scaling(source: str, scaling: Mapping[str, Any]) -> None:
    """Raise HFConfigError (key ``<source>.<field>``) for a RoPE scaling whose fields vLLM, transformers or the
    Megatron lowering could not read: a type that is not a string, a field its type needs that is missing, a
    number that is not a number in range, ``original_max_position_embeddings`` that is not a whole number,
    ``truncate`` that is not a boolean. An unknown type passes (the lowering names it as a limitation)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    type_key = f"{source}.{'rope_type' if 'rope_type' in scaling else 'type'}"
    if kind is None:
        if set(scaling) - {"rope_theta"}:
            raise HFConfigError(f"{source}.rope_type", f"is required but missing (one of {', '.join(_ROPE_REQUIRED)})")
        return
    if not isinstance(kind, str):
        raise HFConfigError(type_key, f"must be a string such as 'yarn' or 'linear', got {_short(kind)}")
    for field in _ROPE_REQUIRED.get(kind, ()):
        if scaling.get(field) is None:
            raise HFConfigError(f"{source}.{field}", f"is required for rope_type {kind!r} but missing")
    for field, value in scaling.items():
        if value is None:
            continue
        key = f"{source}.{field}"
        if field in _ROPE_POSITIVE or field in _ROPE_NON_NEGATIVE:
            positive = field in _ROPE_POSITIVE
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or (isinstance(value, float) and not math.isfinite(value))
                    or not (value > 0 if positive else value >= 0)):
                raise HFConfigError(key, f"must be a number {'>' if positive else '>='} 0, got {_short(value)}")
            # a factor that scales the context is held to the context's bound by _context_limit, in those terms
            if value > HF_INT_MAX and not (field == "factor" and kind in _CONTEXT_SCALING):
                raise HFConfigError(key, f"must be at most {HF_INT_MAX}, got {_short(value)}")
        elif field == "original_max_position_embeddings":
            if isinstance(value, bool) or not isinstance(value, int):
                raise HFConfigError(key, f"must be an integer, got {_short(value)}")
            if not 1 <= value <= HF_INT_MAX:
                raise HFConfigError(key, f"must be in 1..{HF_INT_MAX}, got {value}")
        elif field == "truncate" and not isinstance(value, bool):
            raise HFConfigError(key, f"must be true or false, got {_short(value)}")
        elif field in ("short_factor", "long_factor") and (
                not isinstance(value, list) or not value
                or any(isinstance(v, bool) or not isinstance(v, int | float) or not abs(v) <= HF_INT_MAX
                       for v in value)):
            raise HFConfigError(key, f"must be a non-empty list of numbers, got {_short(value)}")


def _rope_scaling(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The config's RoPE scaling: ``rope_scaling``, or transformers 5's ``rope_parameters``; None without one.
    Raises HFConfigError for one that is not an object or whose fields are unusable (``_check_rope_scaling``)."""
    found: list[tuple[str, Mapping[str, Any]]] = []
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise HFConfigError(key, f"must be an object (or null), got {_short(value)}")
        _check_rope_scaling(key, value)
        found.append((key, value))
    scalings = [rope_scaling_items(value) for _, value in found]
    if len(found) == 2 and all(scalings) and scalings[0] != scalings[1]:  # a default-type one carries a base only
        # transformers 5 reads rope_parameters, older transformers and vLLM versions rope_scaling: each reader would
        # place tokens differently
        raise HFConfigError("rope_parameters", f"{_short(dict(found[1][1]))} scales RoPE differently from rope_scaling "
                            f"{_short(dict(found[0][1]))}; readers differ on which one applies: make them agree, or "
                            "keep one")
    return found[0][1] if found else None


def _positive_number(key: str, value: Any, most: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= most:
        raise HFConfigError(key, f"must be a number > 0 and at most {most:g}, got {value!r}")
    return float(value)


def _router(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The ``router_*`` fields of an MoE config (its absent keys already filled in as transformers does; Mixtral
    always renormalises and has no key)."""
    if model_type == "deepseek_v3":
        # transformers' DeepseekV3TopkRouter (5.23) always scores with a sigmoid, chooses with e_score_correction_bias
        # added and within topk_group of n_group groups, whatever scoring_func and topk_method say
        score, bias, grouped = "sigmoid", True, True
    else:
        score = config.get("scoring_func", "softmax")
        if score not in ("softmax", "sigmoid"):
            raise HFConfigError("scoring_func", f"must be softmax or sigmoid, got {score!r}")
        bias = config.get("topk_method") == "noaux_tc"
        grouped = config.get("topk_method") in ("group_limited_greedy", "noaux_tc")
    out: dict[str, Any] = {
        "router_score": score,
        "router_normalizes_topk": True if model_type == "mixtral" else _bool(config, "norm_topk_prob", False),
        "router_scaling": _positive_number("routed_scaling_factor", config.get("routed_scaling_factor", 1.0),
                                           MAX_ROUTER_SCALING),
        "router_expert_bias": bias,
    }
    if grouped:  # required: DeepSeek-V2's class leaves them null, and group routing cannot run without them
        out["router_groups"] = _int(config, "n_group")
        out["router_group_topk"] = _int(config, "topk_group")
        if out["router_group_topk"] > out["router_groups"]:
            raise HFConfigError("topk_group", f"must be at most n_group ({out['router_groups']}), got "
                                f"{out['router_group_topk']}")
    return out


def _context_limit(config: Mapping[str, Any]) -> int | None:
    """``max_position_embeddings``, times the ``factor`` of a linear, dynamic or YaRN RoPE scaling (YaRN's of
    ``original_max_position_embeddings`` when given), as vLLM derives the longest ``max_model_len`` it accepts;
    None when the config has no ``max_position_embeddings``."""
    if config.get("max_position_embeddings") is None:
        return None
    limit = _int(config, "max_position_embeddings")
    scaling = _rope_scaling(config)
    if scaling is None or not isinstance(scaling.get("factor"), int | float):
        return limit
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in _CONTEXT_SCALING and scaling["factor"] > 1:  # llama3/longrope: already the scaled length
        base = scaling.get("original_max_position_embeddings") if kind == "yarn" else None
        scaled = (base if isinstance(base, int) and base > 0 else limit) * scaling["factor"]
        if not scaled <= HF_INT_MAX:
            raise HFConfigError("rope_scaling", f"factor {scaling['factor']!r} scales the context past {HF_INT_MAX} "
                                "tokens")
        limit = int(scaled)
    return limit


def _refuse_sliding_window(config: Mapping[str, Any], model_type: str, context: int | None) -> None:
    """Sliding-window attention (Mistral-7B-v0.1's 4096 tokens; Qwen2/Qwen3 with ``use_sliding_window``) is not in
    the cost model, and the Megatron lowering would train full attention where vLLM attends within the window: the
    trainer's log-probs would differ from the sampler's past the window. A window at least the context is full
    attention (Qwen2.5's ``sliding_window: 131072`` is also off, ``use_sliding_window: false``)."""
    window = config.get("sliding_window")
    applies = (model_type in ("mistral", "mixtral") or (model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
                                                         and _bool(config, "use_sliding_window", False)))
    if not applies or window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise HFConfigError("sliding_window", f"must be a positive integer or null, got {window!r}")
    if context is None or window < context:
        raise HFConfigError("sliding_window", f"{window}-token sliding-window attention is not supported (the cost "
                            "model and the Megatron lowering assume full attention); use a model with full attention")


def arch_from_hf_config(config: Mapping[str, Any], *, name: str) -> ModelArch:
    """Build a ModelArch from a parsed Hugging Face config.json (pure: takes the dict, reads no file).

    Understands the field names of Llama/Mistral, Qwen2, Qwen3, Qwen3-MoE/Qwen2-MoE/Mixtral and DeepSeek-V2/V3
    (`model_type`). A key the config leaves out takes the default transformers gives it for that model_type
    (``_TRANSFORMERS_DEFAULTS``). Raises HFConfigError (a ValueError with `.key`) for a missing or invalid field, or
    for a layout the cost model cannot represent (e.g. interleaved dense/MoE layers).
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in _TRANSFORMERS_DEFAULTS:
        known = ", ".join(sorted(_TRANSFORMERS_DEFAULTS))
        raise HFConfigError("model_type", f"unsupported value {model_type!r}; supported: {known}")
    for key in _KIMI_REQUIRED if model_type == "kimi_k2" else ():
        if key not in config:
            raise HFConfigError(key, "is required for model_type 'kimi_k2' but missing: transformers has no Kimi K2 "
                                "class to default it as the checkpoint's code does; write the checkpoint's value")
    defaults = dict(_TRANSFORMERS_DEFAULTS[model_type])
    if "max_position_embeddings" in config and config["max_position_embeddings"] is None:
        # not "left out": transformers keeps the null (its default does not apply) and vLLM then finds no context
        # to hold --max-model-len to, so the plan's context check would rest on a default neither reader uses
        default = defaults.get("max_position_embeddings")
        raise HFConfigError("max_position_embeddings", "is null: transformers keeps the null" + (
            f" (not its default for {model_type}, {default})" if default is not None else "") + " and vLLM then holds "
            "--max-model-len to no context length; write the checkpoint's context length")
    default_theta = defaults.pop("rope_theta", None)  # after rope_parameters' (transformers 5): see _arch
    given = {k: v for k, v in config.items() if v is not None or k in _NULL_IS_A_VALUE}
    try:
        return _arch(defaults | given, model_type, name, default_theta)
    except HFConfigError as exc:
        if exc.key not in defaults or exc.key in given:
            raise
        raise HFConfigError(exc.key, f"{exc.reason} (config.json leaves it out, so transformers' default for "
                            f"{model_type}, {defaults[exc.key]!r}, applies; write the key)") from None


_SWIGLU_ACTIVATIONS = ("silu", "swish")
"""``hidden_act`` values of a SwiGLU MLP (transformers' ACT2FN maps both to SiLU)."""

_FAMILY_OF_CLASS = {
    "LlamaForCausalLM": {"llama"}, "MistralForCausalLM": {"mistral"}, "Qwen2ForCausalLM": {"qwen2"},
    "Qwen3ForCausalLM": {"qwen3"}, "Qwen3MoeForCausalLM": {"qwen3_moe"}, "Qwen2MoeForCausalLM": {"qwen2_moe"},
    "MixtralForCausalLM": {"mixtral"}, "DeepseekV2ForCausalLM": {"deepseek_v2"},
    "DeepseekV3ForCausalLM": {"deepseek_v3", "kimi_k2"}}  # Kimi K2's checkpoint names DeepSeek-V3's class
"""``architectures`` classes -> the ``model_type`` values they go with. vLLM picks the model's code by the class,
dora (as transformers' AutoConfig) by ``model_type``: a config whose two disagree would be planned as one model and
served as another. A class not listed is not checked."""


def _check_family(config: Mapping[str, Any], model_type: str) -> None:
    classes = config.get("architectures")
    if classes is None:
        return
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise HFConfigError("architectures", f"must be a list of class names, got {_short(classes)}")
    for name in classes:
        family = _FAMILY_OF_CLASS.get(name)
        if family is not None and model_type not in family:
            raise HFConfigError("architectures", f"{name} is a {' or '.join(sorted(family))} model, but model_type "
                                f"is {model_type!r}: vLLM would serve the class, dora plans the model_type; make them "
                                "agree")


def _arch(config: Mapping[str, Any], model_type: str, name: str, default_theta: float | None) -> ModelArch:
    """``arch_from_hf_config`` of ``config`` with its absent keys filled in, but for ``rope_theta``: the config's
    own, else its ``rope_parameters``' (transformers 5), else ``default_theta``."""
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    _check_family(config, model_type)
    act = config.get("hidden_act", "silu")
    if act not in _SWIGLU_ACTIVATIONS:
        raise HFConfigError("hidden_act", f"must be silu (a SwiGLU MLP: the cost model and the Megatron lowering's "
                            f"--swiglu assume it), got {_short(act)}")
    if _bool(config, "mlp_bias", False):
        raise HFConfigError("mlp_bias", "must be false: the cost model and the Megatron lowering "
                            "(--disable-bias-linear) assume MLP projections without biases")
    kw: dict[str, Any] = {
        "name": name,
        "num_layers": _int(config, "num_hidden_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "vocab_size": _int(config, "vocab_size"),
        "tie_embeddings": _bool(config, "tie_word_embeddings", False),
    }
    if model_type in _MLA_TYPES:
        kw["mla"] = MLA(
            q_lora_rank=None if config.get("q_lora_rank") is None else _int(config, "q_lora_rank"),
            kv_lora_rank=_int(config, "kv_lora_rank"),
            qk_nope_head_dim=_int(config, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(config, "qk_rope_head_dim"),
            v_head_dim=_int(config, "v_head_dim"),
        )
        if kw["mla"].qk_rope_head_dim % 2:
            raise HFConfigError("qk_rope_head_dim", f"must be even (RoPE rotates pairs of dimensions), got "
                                f"{kw['mla'].qk_rope_head_dim}")
        kw["head_dim"] = kw["mla"].qk_nope_head_dim + kw["mla"].qk_rope_head_dim
        kw["num_kv_heads"] = heads  # MLA caches a latent, not KV heads: num_key_value_heads sizes nothing
    else:
        kw["num_kv_heads"] = _int(config, "num_key_value_heads", default=heads)
        if heads % kw["num_kv_heads"]:
            raise HFConfigError("num_key_value_heads", f"must divide num_attention_heads ({heads}) into equal query "
                                f"groups, got {kw['num_kv_heads']}")
        if hidden % heads and config.get("head_dim") is None:
            raise HFConfigError("head_dim", f"missing, and hidden_size {hidden} is not divisible by {heads} heads")
        kw["head_dim"] = _int(config, "head_dim", default=hidden // heads)
        if kw["head_dim"] % 2:
            raise HFConfigError("head_dim", f"must be even (RoPE rotates pairs of dimensions), got {kw['head_dim']}"
                                + ("" if "head_dim" in config else " (hidden_size / num_attention_heads)"))
        # Qwen2 always has q/k/v biases (the config has no flag); Llama-family configs say attention_bias.
        kw["qkv_bias"] = True if model_type in {"qwen2", "qwen2_moe"} else _bool(config, "attention_bias", False)
        kw["qk_norm"] = model_type in {"qwen3", "qwen3_moe"}

    # transformers' DeepSeek-V2/V3 make every layer past first_k_dense_replace MoE; Kimi K2's own code, only with
    # n_routed_experts. A Qwen-MoE's intermediate_size sizes nothing; Mixtral's is the experts' size.
    is_moe = model_type in _MOE_TYPES | {"deepseek_v2", "deepseek_v3"} or (
        model_type == "kimi_k2" and bool(config.get("n_routed_experts")))
    kw["ffn_hidden_size"] = _int(config, "intermediate_size", minimum=0 if is_moe and model_type != "mixtral" else 1)
    if is_moe:
        experts_key = "n_routed_experts" if model_type in _MLA_TYPES else (
            "num_local_experts" if model_type == "mixtral" else "num_experts")
        kw["num_experts"] = _int(config, experts_key)
        kw["experts_top_k"] = _int(config, "num_experts_per_tok")
        if kw["experts_top_k"] > kw["num_experts"]:
            raise HFConfigError("num_experts_per_tok", f"must be at most {experts_key} ({kw['num_experts']}), got "
                                f"{kw['experts_top_k']}")
        kw["moe_ffn_hidden_size"] = (kw["ffn_hidden_size"] if model_type == "mixtral"
                                     else _int(config, "moe_intermediate_size"))
        kw.update(_router(config, model_type))
        if "router_groups" in kw:  # scores reshape to [tokens, n_group, experts / n_group] (vLLM, megatron-core)
            groups, experts = kw["router_groups"], kw["num_experts"]
            if experts % groups:
                raise HFConfigError("n_group", f"must divide {experts_key} ({experts}) into equal groups, got {groups}")
            reachable = kw["router_group_topk"] * (experts // groups)
            if kw["experts_top_k"] > reachable:
                raise HFConfigError("num_experts_per_tok", f"must be at most the {reachable} experts the topk_group "
                                    f"({kw['router_group_topk']}) chosen groups of {experts // groups} hold, got "
                                    f"{kw['experts_top_k']}")
        if model_type in _MLA_TYPES:
            kw["num_shared_experts"] = _int(config, "n_shared_experts", default=0, minimum=0)
            kw["first_dense_layers"] = _int(config, "first_k_dense_replace", default=0, minimum=0)
            if kw["first_dense_layers"] >= kw["num_layers"]:
                raise HFConfigError("first_k_dense_replace", f"must be below num_hidden_layers ({kw['num_layers']}): "
                                    f"at least one layer is MoE in a config with n_routed_experts; got "
                                    f"{kw['first_dense_layers']}")
            if _int(config, "moe_layer_freq", default=1) != 1:
                raise HFConfigError("moe_layer_freq", "only 1 (every layer after the dense prefix) is supported")
        elif model_type == "qwen2_moe":
            raise HFConfigError("shared_expert_intermediate_size",
                                "Qwen2-MoE's separately sized shared expert is not supported")
        else:
            if _int(config, "decoder_sparse_step", default=1) != 1:
                raise HFConfigError("decoder_sparse_step", "only 1 (every layer is MoE) is supported")
            if config.get("mlp_only_layers"):
                raise HFConfigError("mlp_only_layers", "interleaved dense layers are not supported")
    kw["max_context_tokens"] = _context_limit(config)
    _refuse_sliding_window(config, model_type, kw["max_context_tokens"])
    scaling = _rope_scaling(config)
    parameters = config.get("rope_parameters")  # transformers 5 keeps the base there, beside a rope_scaling or not
    bases = [v for v in (config.get("rope_theta"), (scaling or {}).get("rope_theta"),
                         parameters.get("rope_theta") if isinstance(parameters, Mapping) else None) if v is not None]
    if len(set(bases)) > 1:
        shown = ", ".join(map(_short, sorted(set(bases), key=str)))
        raise HFConfigError("rope_theta", f"the config gives several RoPE bases ({shown}: rope_theta and "
                            "rope_parameters.rope_theta); readers differ on which one applies: make them agree, or "
                            "keep one")
    theta = bases[0] if bases else default_theta
    kw["rope_theta"] = _positive_number("rope_theta", theta, MAX_ROPE_THETA)
    kw["norm_eps"] = _positive_number("rms_norm_eps", config.get("rms_norm_eps"), MAX_NORM_EPS)
    kw["rope_scaling"] = rope_scaling_items(scaling) if scaling is not None else ()
    try:
        return ModelArch(**kw)
    except ValueError as exc:
        raise HFConfigError("num_key_value_heads" if "num_kv_heads" in str(exc) else "model_type",
                            str(exc)) from exc
