"""Rollout cost model: one vLLM-like inference instance with continuous batching.

An instance is `tp` accelerators holding one copy of the weights (experts split over the same devices, either
inside each expert (ep = 1) or as whole experts per device (ep = tp)), or, with attention data parallelism, `dp`
ranks of `tp` devices each that attend to their own sequences, with whole experts over all of them (ep = tp x dp;
see `rollout_instance_memory` and `make_rollout_cost_model`).  The simulator calls
`RolloutCostModel.decode_step_s` up to ~10^6 times, so everything that does not depend on the batch is
precomputed by `make_rollout_cost_model`.

Notation (see `planner.architecture` for model symbols):
    t      tensor-parallel size of the instance;  e = expert-parallel size (1 or t)
    B      sequences in the decode batch;  C = sum of their context lengths (tokens)
    P      prompt tokens in one prefill batch;  S2 = sum of squared prompt lengths
    b_w    bytes per weight;  b_kv = bytes per KV element
    F, BW  peak FLOP/s and HBM bytes/s of one device;  eta_* calibration efficiencies

Decode step (seconds), a roofline per device plus communication and a fixed step cost:
    bytes = W_nonexpert/t + bytes of the experts the batch touches + C * kv_tok_dev
    flops = (2 * N_c * B + attn_qk * C) / t          (expert share x imbalance(B) when e > 1: ``ep_imbalance``)
    t_dec = max(bytes / (eta_mem BW), flops / (eta_dec F)) + t_comm(B) + t_step
Experts touched per MoE layer (uniform routing, each token picks k of E + Z slots):
    U(B) = E * (1 - (1 - k/(E+Z))^B)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.architecture import ModelArch
from planner.calibration import DEFAULT_CALIBRATION, Calibration
from planner.hardware import (
    Accelerator,
    all_to_all_s,
    gib,
    group_link_bandwidth_bytes_per_s,
    ring_all_gather_s,
    ring_all_reduce_s,
)
from planner.weight_sync import rollout_weight_bytes_per_device

CPU_DECODE_INGEST_MAX_TOKENS = 8
"""dora's CPU (torch) rollout engine feeds prompts of at most this many tokens through the decode batch, one
token per step, instead of a prefill forward (``RolloutConfig.decode_ingest_max_tokens``; a test keeps the two
equal)."""

VLLM_BLOCK_SIZE_TOKENS = 16
"""vLLM's default KV page (block) size in tokens: a sequence occupies ceil(len / 16) pages."""

VLLM_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens in one vLLM forward (``max_num_batched_tokens``): ``vllm serve``'s default on 80 GB-class GPUs, which dora's
lowering writes into every engine's arguments, so the profiling run the memory model follows is the one that runs."""

DEFAULT_MAX_NUM_SEQS = 256
"""The engine's ``max_num_seqs`` where a caller does not give one (dora's cap on a GPU engine's slots)."""


def _check_parallel(arch: ModelArch, tp: int, ep: int, dp: int = 1) -> None:
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    if dp > 1 and ep != tp * dp:
        raise ValueError(f"attention data parallelism (dp={dp}) runs the experts over every device of the instance: "
                         f"ep must be tp x dp = {tp * dp}, got {ep}")
    if ep not in (1, tp * dp):
        raise ValueError(f"ep ({ep}) must be 1 (experts split by TP) or equal to tp ({tp}) in a rollout instance")
    if ep > 1 and not arch.is_moe:
        raise ValueError(f"ep={ep} needs an MoE model; {arch.name} is dense")
    if ep > 1 and arch.num_experts % ep:
        raise ValueError(f"{arch.name}: {arch.num_experts} experts do not split evenly over ep={ep}")


def vllm_reserved_bytes(arch: ModelArch, *, tp: int, ep: int = 1, max_num_seqs: int,
                        max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS,
                        calib: Calibration = DEFAULT_CALIBRATION, dp: int = 1) -> float:
    """Per-device memory a vLLM engine takes before its KV cache, beyond the weights (bytes): what its start-up
    profiling run measures (activation peak) plus the memory outside torch (CUDA context, NCCL):

        reserve = R0 + [t > 1] * R_comm + s_logit * max_num_seqs * V + moe_workspace
        moe_workspace = M * k / e * (2 * I_moe / (t / e) + h) * 2          (MoE models; M = max_num_batched_tokens)

    R0, R_comm and s_logit are the calibration's ``rollout_reserved_bytes_per_device``,
    ``rollout_tp_comm_bytes_per_device`` and ``rollout_sampler_bytes_per_logit``. The sampler term is the dummy
    sampler pass over ``max_num_seqs`` rows of fp32 logits that ends the profiling run. The MoE term is the fused-MoE
    kernel's bf16 buffers for the profiling forward of M tokens: each token's k routed copies of the gate/up output
    (2 I_moe, split over the experts' TP shards) and of the expert output (h); with expert parallelism a device
    receives 1/e of the copies. On vLLM 0.19.0 logs (the calibration fields' source) it accounts for the MoE models'
    activation peak above the dense fit: Qwen3-30B-A3B +0.44 GiB (measured +0.44), DeepSeek-V2-Lite +0.45 (+0.34),
    Mixtral-8x7B at TP 2 +0.56 (+0.55).

    With attention data parallelism (``dp`` ranks of ``tp`` devices each) every rank is an engine core of its own:
    ``max_num_seqs`` is a rank's, and the communication buffers are the expert all-to-all's.
    """
    c = calib
    reserve = c.rollout_reserved_bytes_per_device + c.rollout_sampler_bytes_per_logit * max_num_seqs * arch.vocab_size
    if tp * dp > 1:
        reserve += c.rollout_tp_comm_bytes_per_device
    if arch.is_moe:
        shard = max(1, tp // ep)  # TP shards of each expert's intermediate dimension
        # under dp every rank dispatches its own (each of its devices all of them without sequence-parallel MoE)
        copies = max_num_batched_tokens * arch.experts_top_k * dp / ep * expert_token_copies(arch, tp=tp, dp=dp)
        reserve += copies * (2 * arch.moe_ffn_hidden_size / shard + arch.hidden_size) * 2
        if dp > 1 and ep > 1:
            reserve += deepep_low_latency_buffer_bytes(arch)
    return reserve


DEEPEP_LL_MAX_TOKENS_PER_RANK = 256
"""Tokens one rank dispatches at most per DeepEP low-latency call: vLLM's ``VLLM_MOE_DP_CHUNK_SIZE`` default, which
sizes the buffer (``deepep_low_latency_buffer_bytes``)."""


def deepep_low_latency_buffer_bytes(arch: ModelArch, max_tokens_per_rank: int = DEEPEP_LL_MAX_TOKENS_PER_RANK) -> float:
    """The RDMA buffer each device of an engine with attention data parallelism allocates for DeepEP's low-latency
    all-to-all (``all2all_backend: deepep_low_latency``, what dora's lowering writes), following DeepEP's
    ``LowLatencyLayout`` (``get_low_latency_rdma_size_hint``): two buffers, each with room to send and to receive a
    bf16 hidden state (plus a 16-byte header on dispatch) per token and expert:

        bytes = 2 * E * T * ((2 h + 16) + 2 h)        (E routed experts, T = max_tokens_per_rank, h hidden size)

    6.0 GiB for LongCat-Flash (512 experts, h 6144), 1.0 GiB for Qwen3-235B-A22B (128, 4096)."""
    e, t, h = arch.num_experts, max_tokens_per_rank, arch.hidden_size
    return 2.0 * e * t * ((2 * h + 16) + 2 * h)


def expert_token_copies(arch: ModelArch, *, tp: int, dp: int) -> int:
    """How many devices send each token to its experts: tp when attention data-parallel ranks of several devices
    serve a model whose vLLM implementation has no sequence-parallel MoE (``ModelArch.moe_sequence_parallel``: every
    device of a rank dispatches all of the rank's tokens, and the experts compute each copy), else 1."""
    return tp if dp > 1 and tp > 1 and not arch.moe_sequence_parallel else 1


@dataclass(frozen=True, kw_only=True)
class RolloutMemory:
    """Memory of one rollout instance, per device (bytes), and what it leaves for the KV cache."""

    devices: int
    usable_bytes_per_device: float
    """gpu_memory_utilization x device memory: what the engine may take (on ``cpu``, what dora's torch engine takes:
    ``_torch_engine_memory``)."""
    weights_bytes_per_device: float
    extra_version_bytes_per_device: float
    """Extra policy versions held resident (multi-version rollout) beyond the serving one."""
    reserved_bytes_per_device: float
    kv_bytes_per_device: float
    kv_bytes_per_token_per_device: float
    kv_capacity_tokens: int
    context_tokens: int
    max_concurrent_seqs: int
    """Sequences of `context_tokens` whose pages fit at once (0 when not even one fits)."""
    needed_bytes_per_device: float
    """Weights + extra versions + reserve + the pages of one sequence of `context_tokens`."""
    fits: bool
    message: str


TORCH_KV_DTYPE_BYTES = 4
"""dora's torch engine keeps its KV cache in float32, torch's default (``runtime.engines.tiny_model.KVCache``)."""


def _torch_engine_memory(arch: ModelArch, acc: Accelerator, *, weights: float, extra: float, reserve: float,
                         usable: float, context_tokens: int, max_num_seqs: int) -> RolloutMemory:
    """``rollout_instance_memory`` of dora's CPU engine: one thread, one device, and a KV cache preallocated for every
    slot at the whole context (``KVCache``: [layers, slots, kv heads, max_model_len, head dim], keys and values), not
    vLLM's pool of pages sized to what the weights leave. It never preempts: every slot holds a whole sequence.
    ``usable_bytes_per_device`` is what the engine takes; it fits when that is within ``usable``."""
    kv_tok = arch.kv_bytes_per_token_per_device(TORCH_KV_DTYPE_BYTES, tp=1)
    kv_bytes = max_num_seqs * context_tokens * kv_tok
    takes = weights + extra + reserve + kv_bytes
    fits = takes <= usable
    message = (f"fits: {max_num_seqs} slots of {context_tokens} tokens preallocated ({gib(kv_bytes)} GiB)" if fits else
               f"does not fit: the engine preallocates {max_num_seqs} slots of {context_tokens} tokens "
               f"({gib(kv_bytes)} GiB of KV cache) beside {gib(weights + extra)} GiB of weights and a {gib(reserve)} "
               f"GiB reserve, over the {gib(usable)} GiB it may take on {acc.name}; lower "
               f"placement.rollout.max_num_seqs or the lengths")
    return RolloutMemory(
        devices=1, usable_bytes_per_device=takes, weights_bytes_per_device=weights,
        extra_version_bytes_per_device=extra, reserved_bytes_per_device=reserve, kv_bytes_per_device=kv_bytes,
        kv_bytes_per_token_per_device=kv_tok, kv_capacity_tokens=max_num_seqs * context_tokens,
        context_tokens=context_tokens, max_concurrent_seqs=max_num_seqs if fits else 0,
        needed_bytes_per_device=takes, fits=fits, message=message)


def rollout_instance_memory(
    arch: ModelArch,
    acc: Accelerator,
    *,
    tp: int,
    ep: int = 1,
    dtype_bytes: float,
    kv_dtype_bytes: float | None = None,
    weight_dtype_bytes: float | None = None,
    gpu_memory_utilization: float = 0.9,
    extra_versions: int = 0,
    context_tokens: int = 4096,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    calib: Calibration = DEFAULT_CALIBRATION,
    dp: int = 1,
) -> RolloutMemory:
    """Per-device memory of an instance and its KV capacity.

    usable   = util * M                                   (vLLM gpu_memory_utilization, default 0.9)
    weights  = N * b_w / t                                (every weight sharded over the t devices; b_w =
                                                           ``weight_dtype_bytes``, default ``dtype_bytes``)
    extra    = versions * weights
    reserve  = vllm_reserved_bytes(...)                   (profiling peak and memory outside torch; ``max_num_seqs``
                                                           sizes the sampler's share: pass the engine's cap)
    kv_bytes = usable - weights - extra - reserve
    capacity = floor(kv_bytes / kv_tok_dev) tokens;  seqs = floor(capacity/16 / ceil(ctx/16)) (16-token pages)
    Bytes throughout; kv_tok_dev from `ModelArch.kv_bytes_per_token_per_device`.

    Attention data parallelism (``dp`` > 1, vLLM's ``data_parallel_size`` with expert parallelism over all t * dp
    devices, as DeepSeek-style MoE models are served): each of the dp ranks holds the non-expert weights (split over
    its t devices) and 1/(t dp) of the experts, and the KV cache of its own sequences only, so the instance's KV
    capacity is dp times a device's (an MLA latent is not copied onto every device, as under TP alone):
        weights = (N_nonexpert / t + N_experts / (t dp)) * b_w;   kv_tok_dev = kv_tok(t) / dp
    A sequence's pages are all on its rank: capacity = dp * floor(kv_bytes / kv_tok(t)), and it fits only when one
    rank holds one sequence of the context. ``max_num_seqs`` is one rank's.
    """
    _check_parallel(arch, tp, ep, dp)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization}")
    if extra_versions < 0 or context_tokens < 1:
        raise ValueError("extra_versions must be >= 0 and context_tokens >= 1")
    calib = calib.resolved_for(acc.name)
    kv_b = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    usable = gpu_memory_utilization * acc.hbm_bytes
    weights = rollout_weight_bytes_per_device(
        arch, tp=tp, dp=dp, dtype_bytes=dtype_bytes if weight_dtype_bytes is None else weight_dtype_bytes)
    extra = extra_versions * weights
    reserve = vllm_reserved_bytes(arch, tp=tp, ep=ep, max_num_seqs=max_num_seqs, calib=calib, dp=dp)
    if acc.name == "cpu":
        return _torch_engine_memory(arch, acc, weights=weights, extra=extra, reserve=reserve, usable=usable,
                                    context_tokens=context_tokens, max_num_seqs=max_num_seqs)
    kv_tok_rank = arch.kv_bytes_per_token_per_device(kv_b, tp=tp)  # a sequence's KV on each device of its rank
    kv_tok = kv_tok_rank / dp
    kv_bytes = max(0.0, usable - weights - extra - reserve)
    # a sequence's KV cache lives on one rank: each rank must hold a whole one
    rank_capacity = int(kv_bytes // kv_tok_rank)
    capacity = dp * rank_capacity
    pages_per_seq = math.ceil(context_tokens / VLLM_BLOCK_SIZE_TOKENS)
    seqs = dp * ((rank_capacity // VLLM_BLOCK_SIZE_TOKENS) // pages_per_seq)
    needed = weights + extra + reserve + pages_per_seq * VLLM_BLOCK_SIZE_TOKENS * kv_tok_rank
    fits = seqs >= 1
    if fits:
        message = (f"fits: {seqs} concurrent sequences of {context_tokens} tokens "
                   f"({capacity} KV tokens per instance of {tp * dp} x {acc.name})")
    else:
        message = (f"does not fit: needs {gib(needed)} GiB per device (weights {gib(weights)}"
                   f" + extra versions {gib(extra)} + reserve {gib(reserve)} + one "
                   f"{context_tokens}-token sequence), has {gib(usable)} GiB "
                   f"({gpu_memory_utilization} x {gib(acc.hbm_bytes)} GiB on {acc.name}); "
                   f"raise tp or gpu_memory_utilization, or lower the context"
                   + (f" or max_num_seqs ({max_num_seqs}: the reserve holds a sampler pass over that many rows of "
                      f"logits)" if reserve > usable / 2 else ""))
    return RolloutMemory(
        devices=tp * dp, usable_bytes_per_device=usable, weights_bytes_per_device=weights,
        extra_version_bytes_per_device=extra, reserved_bytes_per_device=reserve, kv_bytes_per_device=kv_bytes,
        kv_bytes_per_token_per_device=kv_tok, kv_capacity_tokens=capacity, context_tokens=context_tokens,
        max_concurrent_seqs=seqs, needed_bytes_per_device=needed, fits=fits, message=message,
    )


@dataclass(frozen=True, kw_only=True)
class RolloutCostModel:
    """Precomputed per-instance constants; call `decode_step_s` / `prefill_s` (seconds)."""

    nonexpert_weight_bytes_per_device: float
    """Weights read on every step regardless of routing (attention, dense FFNs, shared experts, LM head)."""
    expert_bytes_on_device: float
    """Bytes of one routed expert that live on one device (whole expert when ep > 1, 1/t of it otherwise)."""
    num_experts: int
    expert_slot_probability: float
    """k / (E + Z): chance that a token picks a given routed expert."""
    num_moe_layers: int
    ep: int
    imbalance: float
    kv_bytes_per_token_per_device: float
    dense_flops_per_token_per_device: float
    expert_flops_per_token_per_device: float
    decode_attn_flops_per_ctx_token_per_device: float
    prefill_attn_flops_per_pair_per_device: float
    memory_rate_bytes_per_s: float
    decode_flops_per_s: float
    prefill_flops_per_s: float
    allreduces_per_pass: int
    """All-reduces over the TP group per forward: every attention layer and dense FFN, and without attention data
    parallelism every MoE layer too (vLLM reduces the experts' outputs, split by TP or by EP, over the same group)."""
    allgathers_per_pass: int
    """With attention data parallelism over ranks of several devices: one all-gather over the rank per MoE layer
    (vLLM's sequence-parallel MoE: each device dispatches 1/tp of its rank's tokens, then gathers the results)."""
    hidden_bytes_per_token: float
    """h * b: one token's activation as exchanged by TP / EP collectives."""
    tp: int
    link_bandwidth_bytes_per_s: float
    """Per device, over the tensor-parallel group (a rank's tp devices)."""
    link_efficiency: float
    ep_link_bandwidth_bytes_per_s: float
    """Per device, over the expert-parallel group (all tp x dp devices; the TP group's when dp = 1)."""
    ep_link_efficiency: float
    collective_latency_s: float
    expert_slots_per_token: float
    step_overhead_s: float
    dp: int = 1
    """Attention data-parallel ranks: each decodes its own sequences, in lockstep with the others."""
    expert_token_copies: int = 1
    """Devices that send each token to its experts (``expert_token_copies``): the all-to-all and the experts' work
    are this many times a token's."""
    ep_spread: float = 0.0
    """2 ln(e) (1 - 1/e) for e = ep > 1 (0 otherwise): the squared spread of the busiest of e devices' routed loads
    (``ep_imbalance``)."""

    def ep_imbalance(self, num_tokens: float) -> float:
        """The busiest expert-parallel device's routed copies over the mean, when ``num_tokens`` tokens run the
        experts (1 when ep = 1: every device holds a slice of every expert).

        Two factors. The routing's popularity skew, ``imbalance`` (``moe_imbalance_factor``, a prior). And chance: a
        device receives each of the n k routed copies with probability 1/e, a Binomial(n k, 1/e) load of mean
        mu = n k / e, and the largest of e such loads is about mu + sqrt(2 ln e) sigma (the first-order expected
        maximum of e near-normal variables), sigma^2 = mu (1 - 1/e):
            imbalance(n) = skew * min(e, 1 + sqrt(2 ln e (1 - 1/e) / mu))
        It matters where decode batches are small against the devices: a tp4dp8ep32 engine of Qwen3-235B (k = 8)
        decoding 320 sequences sends 80 copies to a device on average and 1.29x that to the busiest; ep128 engines
        at the same batch, 20 and 1.70x. Without it, every extra device of expert parallelism looked free."""
        if self.ep <= 1:
            return 1.0
        mu = num_tokens * self.expert_slots_per_token / self.ep
        chance = self.ep if mu <= 0 else min(float(self.ep), 1.0 + math.sqrt(self.ep_spread / mu))
        return self.imbalance * chance

    def rank_share(self, batch_size: int) -> float:
        """How much more than an even 1/dp of a decode batch's sequences the busiest rank holds: ceil(B/dp) dp / B
        (1 without attention data parallelism, or when dp divides B). Its attention, KV reads and dense layers
        set the step; the experts' tokens come from every rank alike."""
        if self.dp == 1 or batch_size <= 0:
            return 1.0
        return -(-batch_size // self.dp) * self.dp / batch_size

    def matmul_flops(self, num_tokens: float, share: float = 1.0) -> float:
        """The weight matmuls' FLOPs of ``num_tokens`` tokens on the busiest device: the dense layers ``share`` times
        an even split (``rank_share``), the experts' over every rank's tokens."""
        return (num_tokens * share * self.dense_flops_per_token_per_device
                + self.expert_flops(num_tokens, self.ep_imbalance(num_tokens)))

    def expert_flops(self, num_tokens: float, imbalance: float) -> float:
        """The experts' FLOPs of ``num_tokens`` tokens on the busiest expert-parallel device, ``imbalance`` =
        ``ep_imbalance(num_tokens)`` (apart, so that a caller varying the ranks' split of one batch computes it
        once)."""
        return num_tokens * self.expert_flops_per_token_per_device * self.expert_token_copies * imbalance

    def experts_touched_per_layer(self, num_tokens: float) -> float:
        """U(n) = E * (1 - (1 - k/(E+Z))^n): expected distinct routed experts hit by n tokens."""
        if self.num_experts == 0 or num_tokens <= 0:
            return 0.0
        if self.expert_slot_probability >= 1.0:  # every token picks every expert (k = E, no zero experts)
            return float(self.num_experts)
        return self.num_experts * -math.expm1(num_tokens * math.log1p(-self.expert_slot_probability))

    def _expert_bytes(self, num_tokens: float) -> float:
        touched = self.experts_touched_per_layer(num_tokens)
        if self.ep > 1:
            resident = self.num_experts / self.ep
            touched = min(resident, touched / self.ep * self.ep_imbalance(num_tokens))
        return self.num_moe_layers * touched * self.expert_bytes_on_device

    def _comm_s(self, num_tokens: float, share: float = 1.0) -> float:
        return self.comm_rank_s(num_tokens * share / self.dp, self.ep_imbalance(num_tokens))

    def comm_rank_s(self, rank_tokens: float, imbalance: float) -> float:
        """The collectives of a decode step whose busiest attention rank holds ``rank_tokens`` tokens, ``imbalance``
        the whole batch's ``ep_imbalance`` (without attention data parallelism, ``rank_tokens`` is the batch)."""
        # the all-reduces run inside each rank, over its tp devices, on its share of the tokens (all of them, dp = 1)
        payload = rank_tokens * self.hidden_bytes_per_token
        t = self.allreduces_per_pass * ring_all_reduce_s(
            payload, group_size=self.tp, bandwidth_bytes_per_s=self.link_bandwidth_bytes_per_s,
            efficiency=self.link_efficiency, latency_s=self.collective_latency_s)
        if self.allgathers_per_pass:
            t += self.allgathers_per_pass * ring_all_gather_s(
                payload, group_size=self.tp, bandwidth_bytes_per_s=self.link_bandwidth_bytes_per_s,
                efficiency=self.link_efficiency, latency_s=self.collective_latency_s)
        if self.dp > 1:
            # Dispatch and combine: each device scatters its 1/e of the tokens' k routed copies (with attention data
            # parallelism, 1/tp of its rank's: ``share`` times an even split on the busiest rank); the busiest device
            # receives imbalance x the mean.
            per_rank = (rank_tokens * self.dp / self.ep * self.expert_slots_per_token * self.hidden_bytes_per_token
                        * self.expert_token_copies)
            t += 2 * self.num_moe_layers * all_to_all_s(
                per_rank * imbalance, group_size=self.ep, bandwidth_bytes_per_s=self.ep_link_bandwidth_bytes_per_s,
                efficiency=self.ep_link_efficiency, latency_s=self.collective_latency_s)
        return t

    def decode_step_s(self, batch_size: int, total_context_tokens: float) -> float:
        """One decode step for `batch_size` sequences holding `total_context_tokens` in all (s).

        t = max(bytes / (eta_mem BW), flops / (eta_dec F)) + t_comm(B) + t_step; 0 for an empty batch.
        """
        if batch_size <= 0:
            return 0.0
        share = self.rank_share(batch_size)
        bytes_moved = (self.nonexpert_weight_bytes_per_device + self._expert_bytes(batch_size)
                       + total_context_tokens * self.kv_bytes_per_token_per_device * share)
        flops = (self.matmul_flops(batch_size, share)
                 + total_context_tokens * self.decode_attn_flops_per_ctx_token_per_device * share)
        roofline = max(bytes_moved / self.memory_rate_bytes_per_s, flops / self.decode_flops_per_s)
        return roofline + self._comm_s(batch_size, share) + self.step_overhead_s

    def decode_step_ranks_s(self, batch_size: int, busiest_batch: int, busiest_context_tokens: float) -> float:
        """One decode step with attention data parallelism, given how the sequences sit on the ranks (s): the busiest
        rank decodes ``busiest_batch`` of the ``batch_size`` sequences (its dense layers and its share of the
        all-to-all), and the rank holding the most context ``busiest_context_tokens`` of it (its KV reads and
        attention). The ranks run in lockstep, so these set the step; taking both as one rank's overstates the
        compute roofline when they are two ranks, which decode on these engines never reaches (memory-bound).
        ``decode_step_s(B, C)`` is this at ``busiest_batch = ceil(B/dp)`` and ``busiest_context_tokens =
        C ceil(B/dp) / B`` (an even spread of sequences and context); the simulator tracks the ranks instead.
        """
        if batch_size <= 0:
            return 0.0
        share = busiest_batch * self.dp / batch_size
        bytes_moved = (self.nonexpert_weight_bytes_per_device + self._expert_bytes(batch_size)
                       + busiest_context_tokens * self.kv_bytes_per_token_per_device * self.dp)
        flops = (self.matmul_flops(batch_size, share)
                 + busiest_context_tokens * self.decode_attn_flops_per_ctx_token_per_device * self.dp)
        roofline = max(bytes_moved / self.memory_rate_bytes_per_s, flops / self.decode_flops_per_s)
        return roofline + self._comm_s(batch_size, share) + self.step_overhead_s

    def decode_tokens_per_s(self, batch_size: int, total_context_tokens: float) -> float:
        """Generated tokens per second of the instance: B / t_dec."""
        step = self.decode_step_s(batch_size, total_context_tokens)
        return batch_size / step if step > 0 else 0.0

    def batching_knee(self, context_tokens_per_seq: float, max_batch: int) -> int:
        """The decode batch beyond which one more sequence raises the instance's tokens/s by less than half in
        proportion: the smallest B <= max_batch with elasticity d ln(B / t_dec) / d ln B <= 1/2 (max_batch if none).

        With t_dec(B) ~ a + c*B the elasticity is a / (a + c*B), so the knee is B = a / c: the batch whose
        per-sequence costs (KV reads, expert and attention work, collectives) equal the batch-independent ones
        (weights, fixed step cost). Below it batching is nearly free; above it each added sequence slows the
        batch about in proportion. Each sequence holds `context_tokens_per_seq` tokens (finite differences).

        With attention data parallelism the step time is a staircase in B (the busiest rank's ceil(B/dp) sequences):
        the sequence after a whole round of dp doubles one rank's attention and KV reads, and the knee is often dp,
        one sequence per rank (24 on the 235B example's tp4dp8 engines). Over whole rounds of dp the elasticity
        stays above 1/2 much longer (15 per rank on its tp1dp32 engines at a tail's context, 55 on tp4dp8); packed
        that full, the 42nd session's tp1dp32 colocated streaming plan simulated 4% slower (132.6K trained tokens/s
        against 138.6K), while on tp4dp8 engines a pack of 4x the knee simulates 1.7% faster colocated and 8% faster
        disaggregated (143.2K against 140.8K; 137.8K against 127.5K): the rule is not the best for these engines, and
        the search steps from it in simulation (``search.core._pack_step``).
        """
        prev = self.decode_step_s(1, context_tokens_per_seq)
        for b in range(1, max(1, max_batch)):
            nxt = self.decode_step_s(b + 1, (b + 1) * context_tokens_per_seq)
            if 1 - math.log(nxt / prev) / math.log((b + 1) / b) <= 0.5:
                return b
            prev = nxt
        return max(1, max_batch)

    def prefill_s(self, num_tokens: int, sum_sq_tokens: float | None = None, sequences: int = 1) -> float:
        """Prefill of `num_tokens` prompt tokens in one batch (s); `sum_sq_tokens` = sum of squared prompt
        lengths (default: one prompt, num_tokens^2).

        flops = 2*N_c*P/t + attn_pair * (S2 + P)/2 / t     (causal: a prompt of s tokens has s(s+1)/2 pairs)
            N_c keeps the LM head for every prompt token, as dora's CPU engine computes it; vLLM computes logits
            at each prompt's last position only, so on GPUs this overstates prefill's matmuls by V h / (N_c - V h):
            2.5% for Qwen2.5-32B, 9.0% for Qwen3-8B, 11.4% for Qwen3-30B-A3B (less with attention; prefill is a
            small share of a rollout step)
        bytes = weights touched by P tokens + P * kv_tok_dev (KV written)
        t = max(bytes / (eta_mem BW), flops / (eta_pre F)) + t_comm(P) + t_step
        With attention data parallelism the tokens of ``sequences`` sequences spread over the ranks as the sequences
        do, and the busiest rank sets the time (``rank_share``): one prompt's prefill is one rank's attention, dense
        layers and KV writes; the re-prefill of many preempted or migrated sequences spreads over all of them.
        """
        if num_tokens <= 0:
            return 0.0
        s2 = float(num_tokens) ** 2 if sum_sq_tokens is None else sum_sq_tokens
        share = self.rank_share(sequences)
        flops = (self.matmul_flops(num_tokens, share)
                 + self.prefill_attn_flops_per_pair_per_device * share * (s2 + num_tokens) / 2)
        bytes_moved = (self.nonexpert_weight_bytes_per_device + self._expert_bytes(num_tokens)
                       + num_tokens * self.kv_bytes_per_token_per_device * share)
        roofline = max(bytes_moved / self.memory_rate_bytes_per_s, flops / self.prefill_flops_per_s)
        return roofline + self._comm_s(num_tokens, share) + self.step_overhead_s


def make_rollout_cost_model(
    arch: ModelArch,
    acc: Accelerator,
    *,
    tp: int,
    ep: int = 1,
    dtype_bytes: float,
    kv_dtype_bytes: float | None = None,
    weight_dtype_bytes: float | None = None,
    calib: Calibration = DEFAULT_CALIBRATION,
    accelerators_per_node: int | None = None,
    dp: int = 1,
) -> RolloutCostModel:
    """Precompute the batch-independent constants of one instance (see module docstring).

    ``dtype_bytes`` sizes activations and messages, and the KV cache unless ``kv_dtype_bytes`` is given;
    ``weight_dtype_bytes`` (default ``dtype_bytes``) sizes the weights read each step (1 for fp8 weights).

    With attention data parallelism (``dp`` > 1; ep = t * dp) the instance's B sequences spread over its dp ranks:
    a rank's t devices compute the attention of B/dp of them, read their KV and run their dense layers, split t ways
    as under TP (its non-expert weights, 1/t on each device, are read every step; the all-reduces run over the t
    devices on the rank's B/dp tokens, none at t = 1), the experts run as under ep, and the tokens reach their
    experts by all-to-all over all t * dp devices (each device sends 1/t of its rank's). The per-device constants
    below carry the 1/dp; ``decode_step_s`` takes the sequences and their context spread evenly over the ranks, and
    ``decode_step_ranks_s`` the busiest rank's as the simulator tracks them (vLLM's DP load balancer assigns requests by
    count, so long ones can gather on a rank)."""
    _check_parallel(arch, tp, ep, dp)
    devices = tp * dp
    per_node = accelerators_per_node or acc.default_accelerators_per_node
    calib = calib.resolved_for(acc.name)
    kv_b = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    w_b = dtype_bytes if weight_dtype_bytes is None else weight_dtype_bytes
    # The input embedding table is only indexed (B rows), never streamed; every other non-expert weight is read.
    lookup_params = 0 if arch.tie_embeddings else arch.vocab_size * arch.hidden_size
    nonexpert = (arch.non_expert_params - lookup_params) * w_b / tp
    expert_on_device = arch.expert_params * w_b / (1 if ep > 1 else tp)
    # B/dp of the sequences per rank, each rank's work split over its t devices: per-token figures over t * dp
    expert_matmul = arch.num_moe_layers * arch.expected_routed_experts_per_token * arch.expert_params
    # vLLM without attention data parallelism: the tokens are on every device of the TP group, each applies its
    # experts (split by TP, or whole ones under EP) and the outputs are all-reduced. With it: the tokens reach their
    # experts by all-to-all (``_comm_s``), each device sending 1/tp of its rank's, which are gathered afterwards
    # (sequence-parallel MoE; without it, each device sends all of them and needs no gather).
    num_allreduces = arch.num_attention_layers + arch.num_dense_ffns + (arch.num_moe_layers if dp == 1 else 0)
    return RolloutCostModel(
        nonexpert_weight_bytes_per_device=nonexpert,
        expert_bytes_on_device=expert_on_device,
        num_experts=arch.num_experts,
        expert_slot_probability=(arch.experts_top_k / (arch.num_experts + arch.num_zero_experts)
                                 if arch.is_moe else 0.0),
        num_moe_layers=arch.num_moe_layers,
        ep=ep,
        imbalance=calib.moe_imbalance_factor,
        kv_bytes_per_token_per_device=arch.kv_bytes_per_token_per_device(kv_b, tp=tp) / dp,
        dense_flops_per_token_per_device=2 * (arch.matmul_params_per_token - expert_matmul) / devices,
        expert_flops_per_token_per_device=2 * expert_matmul / devices,
        decode_attn_flops_per_ctx_token_per_device=arch.attention_flops_per_query_key(absorbed_mla=True) / devices,
        prefill_attn_flops_per_pair_per_device=arch.attention_flops_per_query_key() / devices,
        memory_rate_bytes_per_s=calib.hbm_bandwidth_efficiency * acc.hbm_bandwidth_bytes_per_s,
        decode_flops_per_s=calib.decode_compute_efficiency * acc.bf16_flops,
        prefill_flops_per_s=calib.prefill_compute_efficiency * acc.bf16_flops,
        allreduces_per_pass=num_allreduces if tp > 1 else 0,
        allgathers_per_pass=arch.num_moe_layers if tp > 1 and dp > 1 and arch.moe_sequence_parallel else 0,
        hidden_bytes_per_token=arch.hidden_size * dtype_bytes,
        tp=tp,
        link_bandwidth_bytes_per_s=group_link_bandwidth_bytes_per_s(
            acc, group_size=tp, accelerators_per_node=accelerators_per_node),
        link_efficiency=calib.scale_up_efficiency if tp <= per_node else calib.scale_out_efficiency,
        ep_link_bandwidth_bytes_per_s=group_link_bandwidth_bytes_per_s(
            acc, group_size=devices, accelerators_per_node=accelerators_per_node),
        ep_link_efficiency=calib.scale_up_efficiency if devices <= per_node else calib.scale_out_efficiency,
        collective_latency_s=calib.collective_latency_s,
        expert_slots_per_token=arch.expected_routed_experts_per_token,
        step_overhead_s=calib.decode_step_overhead_s,
        dp=dp,
        expert_token_copies=expert_token_copies(arch, tp=tp, dp=dp),
        ep_spread=2 * math.log(ep) * (1 - 1 / ep) if arch.is_moe and ep > 1 else 0.0,
    )


def decode_step_time_s(arch: ModelArch, acc: Accelerator, *, tp: int, ep: int = 1, batch_size: int,
                       total_context_tokens: float, dtype_bytes: float,
                       calib: Calibration = DEFAULT_CALIBRATION) -> float:
    """One-off form of `RolloutCostModel.decode_step_s` (seconds)."""
    model = make_rollout_cost_model(arch, acc, tp=tp, ep=ep, dtype_bytes=dtype_bytes, calib=calib)
    return model.decode_step_s(batch_size, total_context_tokens)


def prefill_time_s(arch: ModelArch, acc: Accelerator, *, tp: int, ep: int = 1, num_tokens: int,
                   dtype_bytes: float, calib: Calibration = DEFAULT_CALIBRATION,
                   sum_sq_tokens: float | None = None) -> float:
    """One-off form of `RolloutCostModel.prefill_s` (seconds)."""
    model = make_rollout_cost_model(arch, acc, tp=tp, ep=ep, dtype_bytes=dtype_bytes, calib=calib)
    return model.prefill_s(num_tokens, sum_sq_tokens)
