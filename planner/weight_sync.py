"""Weight-sync cost model: publishing a new policy version from the trainer to the rollout instances.

Notation:
    N            model parameters;  b_s, b_d = bytes per weight on the trainer / in the rollout engine
    W_d = N*b_d  bytes of one rollout copy;  t_d = rollout TP size;  R = dst_devices / t_d rollout replicas
    n_s          trainer devices (senders);  t_s, p_s, e_s = trainer TP / PP / EP sizes
    B_out        scale-out NIC bytes/s per device;  BW = HBM bytes/s;  eta_* calibration efficiencies

t_sync = t_gather + t_convert + t_transfer + t_buckets + t_reload, with
    t_gather   trainer-side all-gather that turns t_s/e_s shards into the rollout layout (skipped when the
               layouts already match on colocated devices): ring all-gather of N*b_s/p_s over t_s (and of the
               routed experts over e_s) on scale-up links, plus the walk over the named tensors a device assembles
               (one gather and one bucket copy each): n_tensors * share * weight_publish_per_tensor_s, share = 1/p_s
               (broadcast) or t_s/n_s (point-to-point)
    t_convert  dtype change on the trainer (e.g. BF16 -> FP8): read W_s, write W_d per device, (W_s + W_d)/n_s
               / (eta_mem BW)
    t_transfer colocated: device-local copy of W_d/t_d (CUDA IPC), which reads and writes it: 2*W_d/t_d / (eta_mem BW).
               disaggregated: max(recv, send) with recv = (W_d/t_d) / (eta_out B_out) per rollout device and
               send = W_d * fan / n_s / (eta_out B_out) per trainer device, fan = 1 with relay broadcast (each
               byte leaves the trainer once and rollout ranks forward it) or R with point-to-point writes
    t_buckets  ceil(W_d / bucket) * per-bucket overhead (p2p: bytes of the busiest device / bucket)
    t_reload   fixed engine pause/resume + per-tensor load cost * named tensors (every rank walks all of them)
Seconds throughout. A rollout instance with attention data parallelism (d_d ranks, experts over all t_d * d_d
devices) holds W_d/t_d of the non-expert weights and W_d/(t_d d_d) of the experts per device
(``rollout_weight_bytes_per_device``): that, not W_d/t_d, is what a device receives and copies; R = dst_devices /
(t_d d_d).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.architecture import ModelArch
from planner.calibration import DEFAULT_CALIBRATION, Calibration
from planner.hardware import Accelerator, ring_all_gather_s

_MIB = 1024**2


@dataclass(frozen=True, kw_only=True)
class WeightSyncTime:
    """Breakdown of one weight publication (seconds) and its sizes."""

    bytes_per_replica: float
    num_replicas: int
    num_buckets: int
    gather_s: float
    convert_s: float
    transfer_s: float
    bucket_overhead_s: float
    reload_s: float
    total_s: float


def rollout_weight_bytes_per_device(arch: ModelArch, *, tp: int, dtype_bytes: float, dp: int = 1) -> float:
    """Weight bytes one device of a rollout instance holds: the non-expert weights split over its rank's ``tp``
    devices, the experts over all ``tp * dp`` (``N b / t`` without attention data parallelism)."""
    experts = arch.total_params - arch.non_expert_params
    return (arch.non_expert_params / tp + experts / (tp * dp)) * dtype_bytes


def weight_sync_time_s(
    arch: ModelArch,
    *,
    src_acc: Accelerator,
    dst_acc: Accelerator | None = None,
    src_devices: int,
    dst_devices: int,
    dst_tp: int,
    colocated: bool,
    src_tp: int = 1,
    src_pp: int = 1,
    src_ep: int = 1,
    dst_ep: int = 1,
    src_dtype_bytes: float = 2,
    dst_dtype_bytes: float = 2,
    bucket_bytes: float = 512 * _MIB,
    broadcast: bool = True,
    include_reload: bool = True,
    calib: Calibration = DEFAULT_CALIBRATION,
    dst_dp: int = 1,
) -> WeightSyncTime:
    """Time to publish one version (see module docstring for every term)."""
    dst_acc = dst_acc or src_acc
    if min(src_devices, dst_devices, dst_tp, src_tp, src_pp, src_ep, dst_ep, dst_dp) < 1 or bucket_bytes <= 0:
        raise ValueError("device counts and parallel sizes must be >= 1 and bucket_bytes > 0")
    if dst_devices % (dst_tp * dst_dp):
        raise ValueError(f"dst_devices ({dst_devices}) must be a multiple of an instance's devices "
                         f"({dst_tp * dst_dp})")
    if colocated and src_devices != dst_devices:
        raise ValueError(f"colocated sync needs src_devices == dst_devices, got {src_devices} != {dst_devices}")
    calib = calib.resolved_for(src_acc.name)
    replicas = dst_devices // (dst_tp * dst_dp)
    w_src = arch.total_params * src_dtype_bytes
    w_dst = arch.total_params * dst_dtype_bytes
    w_dst_device = rollout_weight_bytes_per_device(arch, tp=dst_tp, dp=dst_dp, dtype_bytes=dst_dtype_bytes)

    same_layout = colocated and src_tp == dst_tp and src_ep == dst_ep and src_pp == 1 and dst_dp == 1
    gather = 0.0
    if not same_layout:
        expert_bytes = arch.routed_expert_params_total * src_dtype_bytes
        kw = {"bandwidth_bytes_per_s": src_acc.scale_up_bandwidth_bytes_per_s,
              "efficiency": calib.scale_up_efficiency, "latency_s": calib.collective_latency_s}
        # Broadcast: each pipeline stage materialises its full tensors before sending (1/p_s of the model).
        # Point-to-point schedule: a device only assembles the tensors it sends itself, g/n_s of the model.
        dense_share = 1 / src_pp if broadcast else src_tp / src_devices
        expert_share = 1 / src_pp if broadcast else src_ep / src_devices
        gather = (ring_all_gather_s((w_src - expert_bytes) * dense_share, group_size=src_tp, **kw)
                  + ring_all_gather_s(expert_bytes * expert_share, group_size=src_ep, **kw)
                  + arch.num_weight_tensors * dense_share * calib.weight_publish_per_tensor_s)
    memory_rate = calib.hbm_bandwidth_efficiency * src_acc.hbm_bandwidth_bytes_per_s
    convert = (w_src + w_dst) / src_devices / memory_rate if src_dtype_bytes != dst_dtype_bytes else 0.0

    if colocated:
        transfer = 2 * w_dst_device / (calib.hbm_bandwidth_efficiency * dst_acc.hbm_bandwidth_bytes_per_s)
    else:
        recv = w_dst_device / (calib.scale_out_efficiency * dst_acc.scale_out_bandwidth_bytes_per_s)
        fan = 1 if broadcast else replicas
        send = w_dst * fan / src_devices / (calib.scale_out_efficiency * src_acc.scale_out_bandwidth_bytes_per_s)
        transfer = max(recv, send)
    if colocated or broadcast:
        # Every bucket is one collective (or IPC handle exchange) that all ranks take part in, one after another.
        buckets = math.ceil(w_dst / bucket_bytes)
    else:
        # Point-to-point: devices stream their own buckets in parallel; the busiest device sets the count.
        buckets = math.ceil(max(w_dst_device, w_dst * replicas / src_devices) / bucket_bytes)
    bucket_overhead = buckets * calib.weight_sync_bucket_overhead_s
    reload = 0.0
    if include_reload:
        reload = calib.weight_reload_fixed_s + arch.num_weight_tensors * calib.weight_reload_per_tensor_s
    total = gather + convert + transfer + bucket_overhead + reload
    return WeightSyncTime(bytes_per_replica=w_dst, num_replicas=replicas, num_buckets=buckets, gather_s=gather,
                          convert_s=convert, transfer_s=transfer, bucket_overhead_s=bucket_overhead,
                          reload_s=reload, total_s=total)


def extra_version_bytes_per_device(arch: ModelArch, *, tp: int, dtype_bytes: float, extra_versions: int) -> float:
    """Rollout memory for `extra_versions` additional resident policy versions: v * N * b / t bytes per device.

    Multi-version streaming rollout keeps older versions loaded while their tail trajectories finish; each one
    costs a full weight copy sharded over the instance's t devices (KV capacity shrinks by the same amount;
    see `rollout_cost.rollout_instance_memory(extra_versions=...)`).
    """
    if extra_versions < 0 or tp < 1:
        raise ValueError("extra_versions must be >= 0 and tp >= 1")
    return extra_versions * arch.total_params * dtype_bytes / tp


def host_link_s(acc: Accelerator, *, bytes_per_device: float, calib: Calibration = DEFAULT_CALIBRATION) -> float:
    """``bytes_per_device`` over the device <-> host link at ``host_link_efficiency``, every device of a group in
    parallel; 0 on an accelerator whose device memory is host memory (``cpu``)."""
    if acc.host_link_bandwidth_bytes_per_s is None:
        return 0.0
    calib = calib.resolved_for(acc.name)
    return bytes_per_device / (calib.host_link_efficiency * acc.host_link_bandwidth_bytes_per_s)


def host_swap_s(acc: Accelerator, *, bytes_per_device: float, calib: Calibration = DEFAULT_CALIBRATION) -> float:
    """One way of a suspended engine's move to or from host memory (colocated streaming): the engine's pause/resume,
    ``weight_reload_fixed_s``, plus ``bytes_per_device`` (its weights and KV cache) over the host link
    (``host_link_s``). On ``cpu`` nothing moves: the pause only."""
    return calib.resolved_for(acc.name).weight_reload_fixed_s + host_link_s(acc, bytes_per_device=bytes_per_device,
                                                                           calib=calib)


def trainer_swap_s(acc: Accelerator, *, state_bytes_per_device: float,
                   calib: Calibration = DEFAULT_CALIBRATION) -> float:
    """Colocated placements, per training step: the trainer's parameters, gradients and optimizer state
    (``state_bytes_per_device``) move to host memory after the step, which gives the engines their memory, and back
    before the next one, both over the host link (``host_link_s``): what verl's parameter/optimizer offload does."""
    return 2 * host_link_s(acc, bytes_per_device=state_bytes_per_device, calib=calib)
