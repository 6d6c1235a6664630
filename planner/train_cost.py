"""Training cost model: one Megatron-like RL training step (policy update plus the extra forward passes RL needs).

Notation (model symbols from `planner.architecture`):
    t, p, d, e, c   tensor, pipeline, data, expert and context parallel sizes;  n = t*p*d*c devices
    T               tokens in the step;  S2 = sum of squared sequence lengths;  m = microbatches per DP rank
    o               optimizer steps in the RL step (minibatches x PPO epochs); each is one Megatron global batch
    N_c             matmul parameters per token (`ModelArch.matmul_params_per_token`)
    q               attention forward FLOPs per (query, key) pair (`attention_flops_per_query_key`)
    F, BW           peak FLOP/s and HBM bytes/s of one device;  eta_train = calibrated compute efficiency

FLOPs (one step):
    fwd    = 2*N_c*T + q*pairs,   pairs = (S2 + T)/2 causal (what flash attention executes) or S2 non-causal
    model  = 3*fwd + x*fwd        (x = extra forward passes: old-logprob, reference)
    hw     = model + fwd - head (full recompute: the layers again, not the LM head) | + q*pairs (selective: core
             attention only);  head = 2*V*h*T, the LM head's forward (part of N_c)
Time:
    compute = u * g * hw / (n * F * eta_train);   bubble = compute * (p-1)/(v*m/o)   (the pipeline flushes at
              every optimizer step, so the bubble follows the m/o microbatches of one global batch); on `cpu`
              with n > 1, n threads of one process do the work of n * cpu_train_parallel_efficiency cores
    g       = pipeline stage imbalance p*max(f, m, l + H)/(L + H): every stage runs at the pace of the busiest.
              Megatron's split (`pipeline_stage_layers`) gives the first, middle and last stages f, m = ceil(L/p)
              and l layers; the last also runs the LM head and the loss, H layers' worth of work
              (`lm_head_layers`; the first stage's embedding lookup is a gather, no FLOPs). 1 with p = 1;
              p*ceil(L/p)/(L + H) while H fits in the last stage's m - l spare layers; up to about 1 + H/m
              beyond (the 560B example's LongCat-Flash at p = L = 28: 1.70, a layer plus a head of 0.74 layers).
    u       = DP load imbalance (`dp_imbalance`): each global batch splits into d equal sample counts s, so the rank
              that gets the step's longest sequence L carries L + (s-1)*mean tokens against the average s*mean;
              every rank waits for it at the gradient sync. 1 with d = 1.
    comm    = exposed TP all-reduce + EP all-to-all + o * DP reduce-scatter/all-gather + PP send/recv
    step    = compute + bubble + comm + o * optimizer (memory-bound Adam) + fixed overhead
Context-parallel ring exchange is assumed hidden behind attention compute (Megatron overlaps its P2P).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

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

Recompute = Literal["none", "selective", "full"]
ADAM_BYTES_PER_PARAM = 30
"""Bytes an Adam step streams per local parameter: read fp32 master, m, v, grad (16), write master, m, v (12),
write the bf16 copy (2)."""
GRAD_BYTES = 4
"""Gradients are reduced and stored in fp32 (the Megatron distributed-optimizer accounting)."""
LOSS_BYTES_PER_LOGIT = 52
"""HBM bytes the log-softmax over the LM head's output moves per logit (one token, one vocabulary entry) in a
training pass, as dora's Megatron trainer (``_TokenLogProb``) and megatron-core's ``VocabParallelCrossEntropy`` do
it: forward, cast the bf16 logits to fp32 (read 2, write 4), max (4), subtract it in place (8), exp in place (8), sum
(4), divide in place (8): 38; backward, scale the saved softmax in place (8), cast the gradient to bf16 (6): 14.
Memory-bound elementwise kernels, run on the last pipeline stage only."""
LOSS_FORWARD_BYTES_PER_LOGIT = 38
"""The forward part of ``LOSS_BYTES_PER_LOGIT``: what an extra forward pass (old log-probs, reference) moves."""


def train_flops(arch: ModelArch, *, tokens: float, seq_len_sum_sq: float, extra_forward_passes: int = 0,
                recompute: Recompute = "none", causal: bool = True) -> tuple[float, float]:
    """(model_flops, hardware_flops) of one step; see module docstring.

    With causal=False the attention term is the non-causal S2 count used by Megatron and verl's MFU reports
    (6*N*T + 12*L*a*d*S2 for GQA).
    """
    pairs = (seq_len_sum_sq + tokens) / 2 if causal else seq_len_sum_sq
    attn_fwd = arch.attention_flops_per_query_key() * pairs
    fwd = 2 * arch.matmul_params_per_token * tokens + attn_fwd
    model = (3 + extra_forward_passes) * fwd
    if recompute == "full":  # megatron-core checkpoints the transformer layers; the output layer runs once
        return model, model + fwd - lm_head_flops(arch, tokens=tokens)
    if recompute == "selective":
        return model, model + attn_fwd
    if recompute != "none":
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    return model, model


def lm_head_flops(arch: ModelArch, *, tokens: float) -> float:
    """Forward FLOPs of the LM head (output layer) over ``tokens``: 2*V*h per token, the vocabulary-sized matmul
    ``matmul_params_per_token`` counts once whether or not the embedding is tied. Megatron runs it on the last
    pipeline stage (and the embedding lookup, a gather with no FLOPs, on the first)."""
    return 2.0 * arch.vocab_size * arch.hidden_size * tokens


def pipeline_stage_layers(num_layers: int, pp: int) -> tuple[int, int, int] | None:
    """Megatron's layer split over ``pp`` stages as (first stage, each middle stage, last stage), with the busiest
    stage holding ceil(L/p) layers; None when no such split exists.

    Megatron gives every middle stage the same count and lets the first and last differ
    (``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``, each >= 1), so with
    m = ceil(L/p) the middle p-2 stages take m each and the ends share the rest r = L - (p-2)*m. The last stage
    also runs the LM head and the loss (``lm_head_layers``: 0.7 to 4 layers' work on the example specs), so it
    takes as few layers as the split allows, max(1, r - m), and the first the rest, min(m, r - 1): any layer moved
    to the first stage shortens the slowest stage or leaves it as it was (the first never exceeds m). With p = 2
    that is (ceil(L/2), floor(L/2)). An even split (p divides L) is (m, m, m).
    """
    if pp < 1 or pp > num_layers:
        return None
    m = -(-num_layers // pp)
    if num_layers % pp == 0 or pp == 1:
        return m, m, m
    rest = num_layers - (pp - 2) * m
    if rest < 2:
        return None
    last = max(1, rest - m)
    return rest - last, m, last


def pipeline_stage_imbalance(num_layers: int, pp: int, head_layers: float = 0.0) -> float:
    """Busiest stage's work / the mean (>= 1), counting the work in layers: p*max(f, m, l + H)/(L + H) for
    Megatron's split (f, m, l) (``pipeline_stage_layers``) with the LM head and loss on the last stage worth
    ``head_layers`` = H layers (``lm_head_layers``). With H = 0, p*ceil(L/p)/L; always 1 with p = 1, where the
    calibrated efficiency covers the whole step, loss kernels included (``train_step_time`` multiplies the step's
    hardware FLOPs by it, so the mean stage carries (L + H)/p layers' worth and the busiest max(f, m, l + H)).

    Megatron-LM places the output layer and the loss on the last stage (``GPTModel(post_process=...)``), and the
    pipeline runs at the pace of its slowest stage: a stage holding ceil(L/p) layers plus the head. It does not
    shift layers off that stage unless told (``num_layers_in_last_pipeline_stage``;
    ``account_for_loss_in_pipeline_split``, which counts the loss as one layer, requires p to divide L + 1 or
    L + 2 and cannot be combined with uneven first and last stages).
    """
    split = pipeline_stage_layers(num_layers, pp)
    if split is None:  # no Megatron split (train_step_time refuses these): the busiest stage's layers alone
        return pp * -(-num_layers // pp) / num_layers
    first, middle, last = split
    return pp * max(first, middle, last + head_layers) / (num_layers + head_layers)


def lm_head_layers(arch: ModelArch, acc: Accelerator, *, layers_hw_flops: float, tokens: float,
                   extra_forward_passes: int, eta_train: float, hbm_efficiency: float) -> float:
    """The last stage's extra work, the LM head and loss, in units of one transformer layer's share of
    ``layers_hw_flops`` (the step's hardware FLOPs less the head's): the head's matmuls, (3 + x) * 2*V*h*T FLOPs
    at the calibrated compute efficiency, plus the log-softmax over T*V logits, memory-bound
    (``LOSS_BYTES_PER_LOGIT``, ``LOSS_FORWARD_BYTES_PER_LOGIT`` per extra forward pass) at the HBM efficiency.
    Both sides divide by the same tp*dp*cp devices (the head is vocabulary-parallel over tp), so they cancel."""
    if layers_hw_flops <= 0:
        return 0.0
    head_s = (3 + extra_forward_passes) * lm_head_flops(arch, tokens=tokens) / (acc.bf16_flops * eta_train)
    loss_bytes = tokens * arch.vocab_size * (LOSS_BYTES_PER_LOGIT + extra_forward_passes * LOSS_FORWARD_BYTES_PER_LOGIT)
    loss_s = loss_bytes / (acc.hbm_bandwidth_bytes_per_s * hbm_efficiency)
    layer_s = layers_hw_flops / arch.num_layers / (acc.bf16_flops * eta_train)
    return (head_s + loss_s) / layer_s


def _check(arch: ModelArch, tp: int, pp: int, dp: int, ep: int, cp: int) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep), ("cp", cp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if ep > 1:
        if not arch.is_moe:
            raise ValueError(f"ep={ep} needs an MoE model; {arch.name} is dense")
        if arch.num_experts % ep:
            raise ValueError(f"{arch.name}: {arch.num_experts} experts do not split over ep={ep}")
        if (tp * cp * dp) % ep:
            raise ValueError(f"ep ({ep}) must divide tp*cp*dp = {tp}*{cp}*{dp} = {tp * cp * dp} "
                             "(expert ranks are folded from the tensor/context/data ranks)")
    if pp > arch.num_layers:
        raise ValueError(f"pp ({pp}) exceeds the {arch.num_layers} layers of {arch.name}")
    if pipeline_stage_layers(arch.num_layers, pp) is None:
        raise ValueError(f"pp ({pp}): Megatron cannot split {arch.num_layers} layers with ceil(L/p) on the busiest "
                         "stage (equal middle stages, the rest on the first and last)")


@dataclass(frozen=True, kw_only=True)
class TrainStepTime:
    """One training step on n devices.  FLOPs in FLOP, times in seconds."""

    devices: int
    model_flops: float
    hardware_flops: float
    compute_s: float
    """Including the DP load and pipeline stage imbalances."""
    dp_imbalance: float
    """Busiest DP rank's load / the average rank's (``dp_imbalance``)."""
    stage_imbalance: float
    """Busiest pipeline stage's work / the mean, the LM head and loss on the last stage included
    (``pipeline_stage_imbalance``)."""
    bubble_s: float
    comm_s: float
    """Exposed (not overlapped) communication."""
    optimizer_s: float
    overhead_s: float
    total_s: float
    mfu: float
    """model_flops / (total_s * n * F)."""
    tflops_per_device: float
    """model_flops / total_s / n / 1e12 (how Megatron reports throughput)."""


def _shard_params(arch: ModelArch, *, tp: int, pp: int, ep: int) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters on the busiest pipeline stage's device.

    Transformer layers split evenly over p stages (ceil(L/p) on the busiest); non-expert weights over t, routed
    experts over e; the embedding table (and, for p = 1, also the LM head) sits on the busiest stage.
    """
    layers = math.ceil(arch.num_layers / pp)
    embed_one = arch.vocab_size * arch.hidden_size
    embed_on_stage = arch.embedding_params if pp == 1 else embed_one
    per_layer_nonexpert = (arch.non_expert_params - arch.embedding_params - arch.hidden_size) / arch.num_layers
    per_layer_expert = arch.routed_expert_params_total / arch.num_layers
    nonexpert = (layers * per_layer_nonexpert + embed_on_stage) / tp
    expert = layers * per_layer_expert / ep
    return nonexpert, expert


def dp_imbalance(*, tokens: float, num_seqs: int, dp: int, optimizer_steps: int = 1,
                 longest_seq_tokens: float = 0.0) -> float:
    """Busiest data-parallel rank's tokens / the average rank's, per optimizer step (>= 1).

    Megatron splits every global batch (num_seqs / optimizer_steps sequences) into dp equal sample counts s, so the
    rank that receives the longest sequence (``longest_seq_tokens``, prompt included) also receives s - 1 average
    ones; the others wait for it at the gradient all-reduce. With fewer sequences than ranks, s rounds up to 1.
    """
    if dp <= 1 or num_seqs <= 0 or tokens <= 0 or longest_seq_tokens <= 0:
        return 1.0
    mean = tokens / num_seqs
    per_rank = num_seqs / (optimizer_steps * dp)
    busiest = longest_seq_tokens + (max(1, math.ceil(per_rank)) - 1) * mean
    return max(1.0, busiest / (per_rank * mean))


@dataclass(frozen=True, kw_only=True)
class _LayoutTerms:
    """What ``train_step_time`` charges whatever the batch, for one layout (``TrainCostModel`` computes it once: the
    simulator prices a training step thousands of times per run, on a handful of layouts)."""

    tp: int
    pp: int
    dp: int
    ep: int
    cp: int
    dtype_bytes: float
    optimizer_steps: int
    calib: Calibration
    """Resolved for the accelerator."""
    devices: int
    cores_worth: float
    eta: float
    per_node: int
    layer_calls: int
    """Attention sub-layers, dense FFNs and MoE layers: the collectives of one microbatch's pass over the layers."""
    tp_link: tuple[float, float]
    """(bandwidth, efficiency) over the TP group (0s with tp = 1)."""
    ep_link: tuple[float, float]
    """The same over an EP group inside a node (0s with ep = 1 or beyond a node)."""
    pp_link: tuple[float, float]
    dp_s: float
    """One optimizer step's gradient reduce-scatter and parameter all-gather, before overlap."""
    optimizer_s: float


def _layout_terms(arch: ModelArch, acc: Accelerator, *, tp: int, pp: int, dp: int, ep: int, cp: int,
                  dtype_bytes: float, optimizer_steps: int, calib: Calibration,
                  accelerators_per_node: int | None) -> _LayoutTerms:
    _check(arch, tp, pp, dp, ep, cp)
    cores_worth = 1.0  # what the n devices' compute is worth beyond n: on `cpu`, n threads of one process
    if acc.name == "cpu" and tp * pp * dp * cp > 1:
        cores_worth = calib.cpu_train_parallel_efficiency or 1.0
    calib = calib.resolved_for(acc.name)
    per_node = accelerators_per_node or acc.default_accelerators_per_node

    def link(group: int, inner: int) -> tuple[float, float]:
        bw = group_link_bandwidth_bytes_per_s(acc, group_size=group, inner_size=inner, accelerators_per_node=per_node)
        eff = calib.scale_up_efficiency if group * inner <= per_node else calib.scale_out_efficiency
        return bw, eff

    nonexpert_dev, expert_dev = _shard_params(arch, tp=tp, pp=pp, ep=ep)
    dense_dp, expert_dp = dp * cp, dp * cp * tp // ep
    dp_s = 0.0
    for params, group, inner in ((nonexpert_dev, dense_dp, tp * cp), (expert_dev, expert_dp, ep)):
        if group > 1 and params > 0:
            bw, eff = link(group, inner)
            lat = calib.collective_latency_s
            dp_s += (ring_all_gather_s(params * GRAD_BYTES, group_size=group, bandwidth_bytes_per_s=bw,
                                       efficiency=eff, latency_s=lat)
                     + ring_all_gather_s(params * dtype_bytes, group_size=group, bandwidth_bytes_per_s=bw,
                                         efficiency=eff, latency_s=lat))
    local_params = nonexpert_dev / dense_dp + expert_dev / expert_dp
    return _LayoutTerms(
        tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, dtype_bytes=dtype_bytes, optimizer_steps=optimizer_steps,
        calib=calib, devices=tp * pp * dp * cp, cores_worth=cores_worth,
        eta=calib.train_mfu_moe if arch.is_moe else calib.train_mfu_dense, per_node=per_node,
        layer_calls=arch.num_attention_layers + arch.num_dense_ffns + arch.num_moe_layers,
        tp_link=link(tp, 1) if tp > 1 else (0.0, 0.0), ep_link=link(ep, 1) if 1 < ep <= per_node else (0.0, 0.0),
        pp_link=link(2, tp * cp * dp) if pp > 1 else (0.0, 0.0), dp_s=dp_s,
        optimizer_s=optimizer_steps * (ADAM_BYTES_PER_PARAM * local_params
                                       / (calib.hbm_bandwidth_efficiency * acc.hbm_bandwidth_bytes_per_s)))


def train_step_time(
    arch: ModelArch,
    acc: Accelerator,
    *,
    tp: int,
    pp: int,
    dp: int,
    ep: int = 1,
    cp: int = 1,
    tokens: float,
    seq_len_sum_sq: float,
    num_microbatches: int,
    extra_forward_passes: int = 0,
    recompute: Recompute = "none",
    dtype_bytes: float = 2,
    virtual_pipeline_stages: int = 1,
    optimizer_steps: int = 1,
    num_seqs: int = 0,
    longest_seq_tokens: float = 0.0,
    calib: Calibration = DEFAULT_CALIBRATION,
    accelerators_per_node: int | None = None,
) -> TrainStepTime:
    """Time of one step (see module docstring for every term)."""
    terms = _layout_terms(arch, acc, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, dtype_bytes=dtype_bytes,
                          optimizer_steps=optimizer_steps, calib=calib, accelerators_per_node=accelerators_per_node)
    return _step_time(arch, acc, terms, tokens=tokens, seq_len_sum_sq=seq_len_sum_sq,
                      num_microbatches=num_microbatches, extra_forward_passes=extra_forward_passes,
                      recompute=recompute, virtual_pipeline_stages=virtual_pipeline_stages, num_seqs=num_seqs,
                      longest_seq_tokens=longest_seq_tokens)


def _step_time(arch: ModelArch, acc: Accelerator, terms: _LayoutTerms, *, tokens: float, seq_len_sum_sq: float,
               num_microbatches: int, extra_forward_passes: int, recompute: Recompute, virtual_pipeline_stages: int,
               num_seqs: int, longest_seq_tokens: float) -> TrainStepTime:
    """``train_step_time`` of the layout whose batch-independent ``terms`` are given."""
    tp, pp, dp, ep, cp = terms.tp, terms.pp, terms.dp, terms.ep, terms.cp
    dtype_bytes, optimizer_steps = terms.dtype_bytes, terms.optimizer_steps
    if num_microbatches < 1 or virtual_pipeline_stages < 1 or optimizer_steps < 1:
        raise ValueError("num_microbatches, virtual_pipeline_stages and optimizer_steps must be >= 1")
    calib, n, eta = terms.calib, terms.devices, terms.eta
    model_flops, hw_flops = train_flops(arch, tokens=tokens, seq_len_sum_sq=seq_len_sum_sq,
                                        extra_forward_passes=extra_forward_passes, recompute=recompute)
    imbalance = dp_imbalance(tokens=tokens, num_seqs=num_seqs, dp=dp, optimizer_steps=optimizer_steps,
                             longest_seq_tokens=longest_seq_tokens)
    head_layers = 0.0
    if pp > 1:
        head_hw = (3 + extra_forward_passes) * lm_head_flops(arch, tokens=tokens)
        head_layers = lm_head_layers(arch, acc, layers_hw_flops=hw_flops - head_hw, tokens=tokens,
                                     extra_forward_passes=extra_forward_passes, eta_train=eta,
                                     hbm_efficiency=calib.hbm_bandwidth_efficiency)
    stages = pipeline_stage_imbalance(arch.num_layers, pp, head_layers)
    compute_s = imbalance * stages * hw_flops / (n * terms.cores_worth * acc.bf16_flops * eta)
    bubble_s = compute_s * (pp - 1) * optimizer_steps / (virtual_pipeline_stages * max(num_microbatches, optimizer_steps))

    # Passes over the layers: forward + backward (2 collectives' worth), +1 full recompute, +1 per extra forward.
    passes = 2 + (1 if recompute == "full" else 0) + extra_forward_passes
    replica_tokens = tokens / (dp * cp)  # tokens one pipeline replica processes
    calls_per_pass = num_microbatches * terms.layer_calls / pp

    tp_s = 0.0
    if tp > 1:
        bw, eff = terms.tp_link
        volume = replica_tokens * arch.hidden_size * dtype_bytes * calls_per_pass / num_microbatches
        tp_s = passes * (ring_all_reduce_s(volume, group_size=tp, bandwidth_bytes_per_s=bw, efficiency=eff,
                                           latency_s=0.0) + calls_per_pass * calib.collective_latency_s)
    ep_s = 0.0
    if ep > 1:
        per_rank = (replica_tokens / tp * arch.expected_routed_experts_per_token * arch.hidden_size * dtype_bytes
                    * calib.moe_imbalance_factor * arch.num_moe_layers / pp)
        if ep <= terms.per_node:
            bw, eff = terms.ep_link
            one = all_to_all_s(per_rank, group_size=ep, bandwidth_bytes_per_s=bw, efficiency=eff, latency_s=0.0)
        else:
            # Hierarchical: the (ep - per_node)/ep share bound for other nodes goes through the NIC, the rest
            # over NVLink, concurrently (DeepEP-style dispatch); the slower side sets the time.
            per_node = terms.per_node
            one = max(per_rank * (ep - per_node) / ep / (calib.scale_out_efficiency * acc.scale_out_bandwidth_bytes_per_s),
                      per_rank * (per_node - 1) / ep / (calib.scale_up_efficiency * acc.scale_up_bandwidth_bytes_per_s))
        # dispatch + combine in every pass over the layers
        ep_s = 2 * passes * (one + num_microbatches * arch.num_moe_layers / pp * calib.collective_latency_s)

    pp_s = 0.0
    if pp > 1:
        bw, eff = terms.pp_link
        pp_s = 2 * (replica_tokens / tp) * arch.hidden_size * dtype_bytes / (eff * bw)

    comm_s = ((1 - calib.tp_comm_overlap_fraction) * tp_s + (1 - calib.ep_comm_overlap_fraction) * ep_s
              + (1 - calib.dp_comm_overlap_fraction) * terms.dp_s * optimizer_steps + pp_s)
    optimizer_s = terms.optimizer_s
    overhead_s = calib.train_step_overhead_s
    total = compute_s + bubble_s + comm_s + optimizer_s + overhead_s
    return TrainStepTime(
        devices=n, model_flops=model_flops, hardware_flops=hw_flops, compute_s=compute_s, dp_imbalance=imbalance,
        stage_imbalance=stages, bubble_s=bubble_s,
        comm_s=comm_s, optimizer_s=optimizer_s, overhead_s=overhead_s, total_s=total,
        mfu=model_flops / (total * n * acc.bf16_flops), tflops_per_device=model_flops / total / n / 1e12,
    )


@dataclass(frozen=True, kw_only=True)
class TrainCostModel:
    """A fixed training layout; `train_step_s(tokens, sum_sq_seq_len, num_seqs)` for the simulator.

    Microbatches per DP rank: m = ceil(T / (d * micro_batch_tokens)) with sequence packing, else one sequence
    per microbatch, m = ceil(num_seqs / d).
    """

    arch: ModelArch
    acc: Accelerator
    tp: int
    pp: int
    dp: int
    ep: int = 1
    cp: int = 1
    micro_batch_tokens: int | None = None
    extra_forward_passes: int = 0
    recompute: Recompute = "none"
    dtype_bytes: float = 2
    virtual_pipeline_stages: int = 1
    optimizer_steps: int = 1
    """Optimizer steps per RL step (minibatches x PPO epochs)."""
    longest_seq_tokens: float = 0.0
    """Expected longest sequence (prompt + response) of one optimizer step's samples: sets the DP imbalance."""
    calib: Calibration = DEFAULT_CALIBRATION
    accelerators_per_node: int | None = None

    _terms: _LayoutTerms = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_terms", _layout_terms(
            self.arch, self.acc, tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, cp=self.cp,
            dtype_bytes=self.dtype_bytes, optimizer_steps=self.optimizer_steps, calib=self.calib,
            accelerators_per_node=self.accelerators_per_node))  # checks the layout (``_check``)

    def num_microbatches(self, tokens: float, num_seqs: int) -> int:
        if self.micro_batch_tokens:
            return max(1, math.ceil(tokens / (self.dp * self.micro_batch_tokens)))
        return max(1, math.ceil(num_seqs / self.dp))

    def train_step(self, tokens: float, sum_sq_seq_len: float, num_seqs: int) -> TrainStepTime:
        """``train_step_time`` of this layout, its batch-independent terms computed once."""
        return _step_time(
            self.arch, self.acc, self._terms, tokens=tokens, seq_len_sum_sq=sum_sq_seq_len,
            num_microbatches=self.num_microbatches(tokens, num_seqs), extra_forward_passes=self.extra_forward_passes,
            recompute=self.recompute, virtual_pipeline_stages=self.virtual_pipeline_stages, num_seqs=num_seqs,
            longest_seq_tokens=self.longest_seq_tokens)

    def train_step_s(self, tokens: float, sum_sq_seq_len: float, num_seqs: int) -> float:
        """Seconds for one step over `num_seqs` sequences totalling `tokens` (0 for an empty step)."""
        if tokens <= 0:
            return 0.0
        return self.train_step(tokens, sum_sq_seq_len, num_seqs).total_s


# ----- memory ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TrainMemory:
    """Memory of the busiest training device (bytes) and whether it fits."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    reserved_bytes: float
    total_bytes: float
    capacity_bytes: float
    fits: bool
    message: str


def activation_bytes_per_token_per_layer(arch: ModelArch, *, dtype_bytes: float = 2,
                                         recompute: Recompute = "none") -> float:
    """Saved activations per token per layer (bytes), averaged over the layers, before dividing by t.

    Derived for pre-norm SwiGLU blocks with flash attention (which keeps O and the fp32 log-sum-exp, never the
    s x s scores), in the spirit of Korthikanti et al. 2022 (arXiv 2205.05198):
        attention sub-layer  b*(2h + a*d_qk + kv*d_qk + kv*d_v + a*d_v) + 4a     (kv = a for MLA, expanded K/V)
        dense FFN            b*(2h + 3f)                                          (norm in/out, gate, up, gate*up)
        MoE FFN              b*(2h + k_real*(h + 3f_e) + S*3f_e) + 4(E + Z)       (permuted inputs, router)
    selective: drops the core-attention tensors (q, k, v, O);  full: keeps only the layer input, b*h.
    """
    b, h, a = dtype_bytes, arch.hidden_size, arch.num_attention_heads
    if recompute == "full":
        return b * h
    kv = a if arch.mla is not None else arch.num_kv_heads
    core = b * (a * arch.qk_head_dim + kv * arch.qk_head_dim + kv * arch.v_head_dim + a * arch.v_head_dim)
    attention = b * 2 * h + 4 * a + (0 if recompute == "selective" else core)
    ffn = b * (2 * h + 3 * arch.ffn_hidden_size)
    moe = 0.0
    if arch.is_moe:
        moe = (b * (2 * h + arch.expected_routed_experts_per_token * (h + 3 * arch.moe_ffn_hidden_size)
                    + arch.num_shared_experts * 3 * arch.moe_ffn_hidden_size)
               + 4 * (arch.num_experts + arch.num_zero_experts))
    total = (arch.num_attention_layers * attention + arch.num_dense_ffns * ffn + arch.num_moe_layers * moe)
    return total / arch.num_layers


_STATE_BYTES = {1: (6, 12), 2: (6, 12), 4: (8, 8)}
"""(params + grads, optimizer) bytes per parameter under the distributed optimizer, by parameter dtype size:
bf16 (and fp8 training, which keeps bf16 weights) 2 + 4 + 12/d; fp32 4 + 4 + 8/d (Megatron-LM distributed
optimizer docs)."""


def _adding_up_gib(total: float, parts: tuple[float, ...]) -> tuple[str, ...]:
    """``total`` and ``parts`` in GiB, at the fewest decimals (1 to 3) at which the printed parts add up to the printed
    total (157.4 printed beside parts that add up to 157.3 reads as an error)."""
    for decimals in (1, 2, 3):
        shown = [gib(x, decimals) for x in (total, *parts)]
        if round(sum(float(x) for x in shown[1:]), decimals) == float(shown[0]):
            break
    return tuple(shown)


def train_memory_per_device(
    arch: ModelArch,
    acc: Accelerator,
    *,
    tp: int,
    pp: int,
    dp: int,
    ep: int = 1,
    cp: int = 1,
    micro_batch_tokens: int,
    num_microbatches: int | None = None,
    recompute: Recompute = "none",
    dtype_bytes: float = 2,
    distributed_optimizer: bool = True,
    calib: Calibration = DEFAULT_CALIBRATION,
) -> TrainMemory:
    """Memory of the busiest device (bytes).

    params/grads/optimizer: P_ne*(s + o/d_ne) + P_e*(s + o/d_e) with (s, o) from `_STATE_BYTES`, d_ne = d*c and
        d_e = d*c*t/e; without the distributed optimizer o is not divided.
    activations: first stage holds min(p, m) microbatches in flight (1F1B):
        act = a_tok/t * ceil(L/p) * (mbt/c) * min(p, m)
    logits: the last stage keeps fp32 logits and their gradient, 8 * V/t bytes per token of one microbatch.
    fits iff total <= M - reserve.
    """
    _check(arch, tp, pp, dp, ep, cp)
    calib = calib.resolved_for(acc.name)
    state, opt = _STATE_BYTES.get(int(dtype_bytes), (6, 12))
    nonexpert, expert = _shard_params(arch, tp=tp, pp=pp, ep=ep)
    d_ne, d_e = dp * cp, dp * cp * tp // ep
    params = (nonexpert + expert) * (state - GRAD_BYTES)
    grads = (nonexpert + expert) * GRAD_BYTES
    optimizer = (nonexpert * opt / d_ne + expert * opt / d_e) if distributed_optimizer else (nonexpert + expert) * opt
    per_token_layer = activation_bytes_per_token_per_layer(arch, dtype_bytes=dtype_bytes, recompute=recompute) / tp
    layers = math.ceil(arch.num_layers / pp)
    local_tokens = micro_batch_tokens / cp
    in_flight = min(pp, num_microbatches or pp)
    first_stage = per_token_layer * layers * local_tokens * in_flight
    if recompute == "full":  # one layer's full activations exist while it is recomputed
        first_stage += activation_bytes_per_token_per_layer(arch, dtype_bytes=dtype_bytes) / tp * local_tokens
    logits = 8 * arch.vocab_size / tp * local_tokens
    last_stage = per_token_layer * layers * local_tokens + logits
    activations = first_stage + logits if pp == 1 else max(first_stage, last_stage)
    reserved = calib.train_reserved_bytes_per_device
    total = params + grads + optimizer + activations + reserved
    fits = total <= acc.hbm_bytes
    if fits:
        message = f"fits: {gib(total)} of {gib(acc.hbm_bytes)} GiB on {acc.name}"
    else:
        shown = _adding_up_gib(total, (params, grads, optimizer, activations, reserved))
        parts = " + ".join(f"{name} {value}" for name, value in zip(
            ("params", "grads", "optimizer", "activations", "reserve"), shown[1:], strict=True))
        message = (f"does not fit: needs {shown[0]} GiB, has {gib(acc.hbm_bytes)} GiB on {acc.name} "
                   f"({parts}); raise tp/pp/ep, shrink micro_batch_tokens or enable recompute")
    return TrainMemory(params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer,
                       activations_bytes=activations, reserved_bytes=reserved, total_bytes=total,
                       capacity_bytes=acc.hbm_bytes, fits=fits, message=message)
