"""Adapter: build the simulator's ``StepTiming`` from the cost model (architecture, accelerators, layout).

Weight sync is split between the trainer and the engines (``planner.weight_sync`` terms):
    weight_publish_s       = gather + convert          (trainer busy; once per version)
    weight_load_trainer_s  = transfer + buckets + reload (one replica loading from the trainer)
    weight_load_peer_s     = (W_d / t_d) / (eta_out * B_out) + reload: one replica pulling its shard
                             from a peer replica over the scale-out NIC, each of its t_d devices in
                             parallel (DORA moves weights peer to peer between rollout groups)
KV migration: each of the t_d devices of a replica sends its KV shard over its own NIC,
    kv_migration_s_per_token = kv_bytes_per_token_per_device / (eta_out * B_out).
Suspending a colocated streaming replica (each way): swap_fixed_s = reload fixed, swap_s_per_version =
    (W_d / t_d) / (eta_host B_host), swap_s_per_token = kv_bytes_per_token_per_device / (eta_host B_host)
    (``weight_sync.host_swap_s``).
Colocated (sync or streaming), each training step also moves the trainer's state to host memory and back,
    train_swap_s = 2 (params + grads + optimizer per device) / (eta_host B_host) (``weight_sync.trainer_swap_s``).
MoE expert imbalance is charged inside ``RolloutCostModel.decode_step_s`` (calibration's
``moe_imbalance_factor``). Prefill of a prompt group is charged once (the samples share the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.architecture import ModelArch
from planner.calibration import DEFAULT_CALIBRATION, Calibration
from planner.hardware import Accelerator
from planner.rollout_cost import CPU_DECODE_INGEST_MAX_TOKENS, RolloutCostModel, make_rollout_cost_model
from planner.train_cost import TrainCostModel
from planner.weight_sync import (
    host_swap_s,
    rollout_weight_bytes_per_device,
    trainer_swap_s,
    weight_sync_time_s,
)


@dataclass(frozen=True, kw_only=True)
class CostModelTiming:
    """``StepTiming`` backed by the cost model (all seconds; see module docstring)."""

    rollout: RolloutCostModel
    train: TrainCostModel
    weight_publish_s: float
    weight_load_trainer_s: float
    weight_load_peer_s: float
    kv_migration_s_per_token: float
    weight_bytes_per_group: float
    extra_version_step_s: float
    """Multi-version engines: per extra hosted version with running requests, a decode step also reads that
    version's weights and pays ``Calibration.extra_version_step_s``."""
    rollout_contention: float = 1.0
    """A decode step takes this many times longer while the trainer runs (`Calibration.contention`)."""
    train_contention: float = 1.0
    """A training step started while rollout runs takes this many times longer."""
    engine_contention: float = 1.0
    """A decode step takes this many times longer while another replica decodes (`Calibration.engine_contention`;
    1 with one replica)."""
    train_swap_s: float = 0.0
    """Colocated placements: the trainer's state to host memory and back, charged on every training step
    (``weight_sync.trainer_swap_s``)."""
    swap_fixed_s: float = 0.0
    """Colocated streaming: one replica's pause or resume around a move to or from host memory (``host_swap_s``)."""
    swap_s_per_version: float = 0.0
    """One hosted version's weights over the host link, one way."""
    swap_s_per_token: float = 0.0
    """The same per context token of KV cache."""
    prompt_ingest_max_tokens: int = 0
    """Prompts up to this many tokens enter the decode batch directly (``CPU_DECODE_INGEST_MAX_TOKENS``), one token
    per step, instead of getting a prefill forward (the simulator charges those steps)."""
    report_round_trip_s: float = 0.0
    """The controller's round trip from a poll's reply to its admissions (``Calibration.controller_round_trip_s``)."""
    _per_batch: dict[int, tuple[float, ...]] = field(default_factory=dict, compare=False, repr=False)
    """batch size -> the terms of ``RolloutCostModel.decode_step_s`` that do not depend on the context (bytes, FLOPs,
    comm + overhead s), with the per-context-token rates and the roofline's two rates: the simulator calls
    decode_step_s ~10^6 times for few distinct batch sizes. Shared by the timings of equal cost models
    (``_batch_terms``)."""
    _per_ranks_batch: dict[int, tuple[float, ...]] = field(default_factory=dict, compare=False, repr=False)
    """``decode_step_ranks_s``'s terms that depend on the batch alone: batch size -> (bytes), with the per-context-token
    rates of one rank, the roofline's two rates, the experts' FLOPs, and the dense FLOPs and the collectives' time
    (with the step's fixed cost) as affine functions of the busiest rank's sequences."""
    def decode_step_s(self, batch_size: int, total_context_tokens: float) -> float:
        """Same value as ``RolloutCostModel.decode_step_s`` (a test checks it), with the batch-only terms cached."""
        terms = self._per_batch.get(batch_size)
        if terms is None:
            if batch_size <= 0:
                return 0.0
            r = self.rollout
            share = r.rank_share(batch_size)
            terms = (r.nonexpert_weight_bytes_per_device + r._expert_bytes(batch_size), r.matmul_flops(batch_size, share),
                     r._comm_s(batch_size, share) + r.step_overhead_s, r.kv_bytes_per_token_per_device * share,
                     r.decode_attn_flops_per_ctx_token_per_device * share, r.memory_rate_bytes_per_s,
                     r.decode_flops_per_s)
            self._per_batch[batch_size] = terms
        bytes_moved, flops, fixed_s, kv_bytes_per_token, attn_flops_per_token, memory_rate, flops_rate = terms
        memory_s = (bytes_moved + total_context_tokens * kv_bytes_per_token) / memory_rate
        compute_s = (flops + total_context_tokens * attn_flops_per_token) / flops_rate
        return (compute_s if compute_s > memory_s else memory_s) + fixed_s  # max(memory_s, compute_s)

    def decode_step_ranks_s(self, batch_size: int, busiest_batch: int, busiest_context_tokens: float) -> float:
        """Same value as ``RolloutCostModel.decode_step_ranks_s`` (a test checks it), with the batch-only terms
        cached."""
        terms = self._per_ranks_batch.get(batch_size)
        if terms is None:
            if batch_size <= 0:
                return 0.0
            r = self.rollout
            imbalance = r.ep_imbalance(batch_size)
            # the collectives are affine in the busiest rank's sequences (``RolloutCostModel.comm_rank_s``: latencies,
            # then bytes over bandwidth), as are the dense layers' FLOPs: two points give every busiest rank
            one = r.comm_rank_s(1, imbalance) + r.step_overhead_s
            terms = (r.nonexpert_weight_bytes_per_device + r._expert_bytes(batch_size),
                     r.kv_bytes_per_token_per_device * r.dp, r.decode_attn_flops_per_ctx_token_per_device * r.dp,
                     r.memory_rate_bytes_per_s, r.decode_flops_per_s, r.expert_flops(batch_size, imbalance),
                     r.dp * r.dense_flops_per_token_per_device, one,
                     r.comm_rank_s(2, imbalance) + r.step_overhead_s - one)
            self._per_ranks_batch[batch_size] = terms
        (bytes_moved, kv_bytes_per_token, attn_flops_per_token, memory_rate, flops_rate, expert_flops, rank_dense_flops,
         fixed_one_s, fixed_per_sequence_s) = terms
        # RolloutCostModel.matmul_flops and _comm_s at share = busiest_batch * dp / batch_size
        flops = busiest_batch * rank_dense_flops + expert_flops
        fixed_s = fixed_one_s + (busiest_batch - 1) * fixed_per_sequence_s
        memory_s = (bytes_moved + busiest_context_tokens * kv_bytes_per_token) / memory_rate
        compute_s = (flops + busiest_context_tokens * attn_flops_per_token) / flops_rate
        return (compute_s if compute_s > memory_s else memory_s) + fixed_s

    def prefill_s(self, num_tokens: int, sequences: int = 1) -> float:
        """The prefill of ``num_tokens`` tokens of ``sequences`` sequences (``RolloutCostModel.prefill_s``)."""
        return self.rollout.prefill_s(num_tokens, None, sequences) if num_tokens > 0 else 0.0

    def train_step_s(self, num_tokens: int, sum_sq_seq_len: float, num_seqs: int) -> float:
        return self.train.train_step_s(num_tokens, sum_sq_seq_len, num_seqs) + self.train_swap_s


BATCH_TERMS_CACHED = 32
"""How many rollout cost models' batch-term tables the process keeps (``_batch_terms``)."""
_BATCH_TERMS: dict[RolloutCostModel, tuple[dict[int, tuple[float, ...]], dict[int, tuple[float, ...]]]] = {}


def _batch_terms(rollout: RolloutCostModel) -> tuple[dict[int, tuple[float, ...]], dict[int, tuple[float, ...]]]:
    """The tables of ``CostModelTiming._per_batch`` and ``_per_ranks_batch`` for ``rollout``, shared by every timing
    built on an equal cost model: their terms are functions of the cost model and the batch size alone, and a plan
    search simulates each engine layout many times (its modes, k, splits and lengths; the 235B example's 74
    simulations computed 250K rows, a few engine layouts' worth of batch sizes each time). A memo, so the results are
    the same; the oldest tables go first past ``BATCH_TERMS_CACHED`` layouts."""
    tables = _BATCH_TERMS.get(rollout)
    if tables is None:
        if len(_BATCH_TERMS) >= BATCH_TERMS_CACHED:
            del _BATCH_TERMS[next(iter(_BATCH_TERMS))]
        tables = _BATCH_TERMS[rollout] = ({}, {})
    return tables


def cost_model_timing(
    arch: ModelArch,
    *,
    rollout_acc: Accelerator,
    train_acc: Accelerator,
    rollout_tp: int,
    rollout_ep: int = 1,
    num_rollout_groups: int,
    train_tp: int,
    train_pp: int,
    train_dp: int,
    train_ep: int = 1,
    train_cp: int = 1,
    train_recompute: str = "none",
    colocated: bool = False,
    dtype_bytes: float = 2,
    rollout_weight_bytes: float | None = None,
    micro_batch_tokens: int | None = 16384,
    extra_forward_passes: int = 1,
    optimizer_steps: int = 1,
    longest_seq_tokens: float = 0.0,
    calib: Calibration = DEFAULT_CALIBRATION,
    accelerators_per_node: int | None = None,
    train_state_bytes_per_device: float = 0.0,
    rollout_dp: int = 1,
) -> CostModelTiming:
    """Timing for ``num_rollout_groups`` replicas of ``rollout_tp x rollout_dp`` devices (``rollout_dp`` attention
    data-parallel ranks, ``rollout_cost.make_rollout_cost_model``) and a ``tp x pp x dp`` trainer.

    ``extra_forward_passes=1`` charges the old-logprob forward pass of GRPO-style training. Colocated, every training
    step also moves ``train_state_bytes_per_device`` (parameters, gradients, optimizer state) to host memory and back.
    """
    rollout_w = dtype_bytes if rollout_weight_bytes is None else rollout_weight_bytes
    rollout = make_rollout_cost_model(arch, rollout_acc, tp=rollout_tp, ep=rollout_ep, dtype_bytes=dtype_bytes,
                                      weight_dtype_bytes=rollout_w, calib=calib,
                                      accelerators_per_node=accelerators_per_node, dp=rollout_dp)
    train = TrainCostModel(arch=arch, acc=train_acc, tp=train_tp, pp=train_pp, dp=train_dp, ep=train_ep,
                           cp=train_cp, micro_batch_tokens=micro_batch_tokens,
                           extra_forward_passes=extra_forward_passes, recompute=train_recompute,  # type: ignore[arg-type]
                           optimizer_steps=optimizer_steps, longest_seq_tokens=longest_seq_tokens,
                           dtype_bytes=dtype_bytes, calib=calib,
                           accelerators_per_node=accelerators_per_node)
    sync = weight_sync_time_s(
        arch, src_acc=train_acc, dst_acc=rollout_acc, src_devices=train_tp * train_pp * train_dp * train_cp,
        dst_devices=num_rollout_groups * rollout_tp * rollout_dp, dst_tp=rollout_tp, colocated=colocated,
        src_tp=train_tp, src_pp=train_pp, src_ep=train_ep, dst_ep=rollout_ep, src_dtype_bytes=dtype_bytes,
        dst_dtype_bytes=rollout_w, calib=calib, dst_dp=rollout_dp,
    )
    calib_r = calib.resolved_for(rollout_acc.name)
    nic = calib_r.scale_out_efficiency * rollout_acc.scale_out_bandwidth_bytes_per_s
    bytes_per_device = rollout_weight_bytes_per_device(arch, tp=rollout_tp, dp=rollout_dp, dtype_bytes=rollout_w)
    extra_version = (rollout.nonexpert_weight_bytes_per_device / rollout.memory_rate_bytes_per_s
                     + calib.extra_version_step_s(rollout_acc.name))
    shared_host = rollout_acc.name == train_acc.name
    rollout_contention, train_contention = (
        calib.contention(rollout_acc.name, colocated=colocated) if shared_host else (1.0, 1.0))
    swap_fixed_s = host_swap_s(rollout_acc, bytes_per_device=0.0, calib=calib)
    swap_s_per_version = host_swap_s(rollout_acc, bytes_per_device=bytes_per_device, calib=calib) - swap_fixed_s
    swap_s_per_token = (host_swap_s(rollout_acc, bytes_per_device=rollout.kv_bytes_per_token_per_device, calib=calib)
                        - swap_fixed_s)
    per_batch, per_ranks_batch = _batch_terms(rollout)
    return CostModelTiming(
        rollout=rollout,
        train=train,
        _per_batch=per_batch,
        _per_ranks_batch=per_ranks_batch,
        weight_publish_s=sync.gather_s + sync.convert_s + calib.publish_fixed_s(train_acc.name),
        weight_load_trainer_s=sync.transfer_s + sync.bucket_overhead_s + sync.reload_s,
        weight_load_peer_s=bytes_per_device / nic + sync.reload_s,
        # a migration moves an engine's requests, spread over its ranks, which send in parallel
        kv_migration_s_per_token=rollout.kv_bytes_per_token_per_device / nic,
        weight_bytes_per_group=sync.bytes_per_replica,
        extra_version_step_s=extra_version,
        rollout_contention=rollout_contention,
        train_contention=train_contention,
        engine_contention=calib.engine_contention(rollout_acc.name) if num_rollout_groups > 1 else 1.0,
        prompt_ingest_max_tokens=CPU_DECODE_INGEST_MAX_TOKENS if rollout_acc.name == "cpu" else 0,
        train_swap_s=trainer_swap_s(train_acc, state_bytes_per_device=train_state_bytes_per_device, calib=calib)
        if colocated else 0.0,
        swap_fixed_s=swap_fixed_s,
        swap_s_per_version=swap_s_per_version,
        swap_s_per_token=swap_s_per_token,
        report_round_trip_s=calib.controller_round_trip_s(rollout_acc.name),
    )
