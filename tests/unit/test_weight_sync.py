"""Weight-sync model: hand-computed transfers on a toy device, layouts, buckets, reload, extra versions."""

import dataclasses

import pytest

from planner.architecture import ModelArch, get_preset
from planner.calibration import Calibration
from planner.hardware import get_accelerator
from planner.rollout_cost import rollout_instance_memory
from planner.weight_sync import extra_version_bytes_per_device, weight_sync_time_s

TOY = ModelArch(name="toy", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                ffn_hidden_size=16, vocab_size=10)  # N = 1352
DEV = dataclasses.replace(get_accelerator("h100"), name="toy-dev", hbm_bandwidth_bytes_per_s=1e4,
                          scale_up_bandwidth_bytes_per_s=1e3, scale_out_bandwidth_bytes_per_s=100.0)
IDEAL = Calibration(hbm_bandwidth_efficiency=1.0, scale_up_efficiency=1.0, scale_out_efficiency=1.0,
                    collective_latency_s=0.0, weight_sync_bucket_overhead_s=0.0, weight_reload_fixed_s=0.0,
                    weight_reload_per_tensor_s=0.0, weight_publish_per_tensor_s=0.0)


def test_disaggregated_broadcast_hand_computed():
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=2, dst_devices=4, dst_tp=2, colocated=False, calib=IDEAL)
    # W = 2704 B; each rollout device receives 1352 B at 100 B/s = 13.52 s; senders push 2704/2 = 13.52 s.
    assert r.num_replicas == 2 and r.bytes_per_replica == 2704
    assert r.transfer_s == pytest.approx(13.52)
    assert r.gather_s == 0 and r.convert_s == 0  # src_tp = src_ep = 1: nothing to gather
    assert r.total_s == pytest.approx(13.52)


def test_publishing_walks_the_named_tensors_each_sender_assembles():
    walk = dataclasses.replace(IDEAL, weight_publish_per_tensor_s=0.01)
    n = TOY.num_weight_tensors
    # broadcast: each of 2 pipeline stages assembles its half of the tensors, in parallel
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=2, dst_devices=4, dst_tp=2, src_pp=2, colocated=False,
                           calib=walk)
    assert r.gather_s == pytest.approx(n / 2 * 0.01)
    # point to point: each of 4 senders assembles the tensors it sends itself, a quarter
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=4, dst_devices=4, dst_tp=1, colocated=False,
                           broadcast=False, calib=walk)
    assert r.gather_s == pytest.approx(n / 4 * 0.01)
    # colocated in the same layout: nothing is assembled (the engine maps the trainer's own tensors)
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=2, dst_devices=2, dst_tp=2, src_tp=2, colocated=True,
                           calib=walk)
    assert r.gather_s == 0


def test_point_to_point_is_sender_bound():
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=1, dst_devices=4, dst_tp=1, colocated=False,
                           broadcast=False, calib=IDEAL)
    # Four replicas of 2704 B, all from one sender: 4 * 2704 / 100.
    assert r.transfer_s == pytest.approx(108.16)


def test_colocated_same_layout_is_a_local_copy():
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=2, dst_devices=2, dst_tp=2, src_tp=2, colocated=True,
                           calib=IDEAL)
    assert r.gather_s == 0
    assert r.transfer_s == pytest.approx(2 * 1352 / 1e4)  # the copy reads and writes each byte


def test_reshard_gather_and_dtype_conversion():
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=4, dst_devices=4, dst_tp=1, src_tp=4, colocated=True,
                           dst_dtype_bytes=1, calib=IDEAL)
    # All-gather of 2704 B over 4 ranks: 3/4 * 2704 / 1e3; BF16 -> FP8: (2704 + 1352) / 4 devices / 1e4.
    assert r.gather_s == pytest.approx(0.75 * 2704 / 1e3)
    assert r.convert_s == pytest.approx(4056 / 4 / 1e4)
    assert r.bytes_per_replica == 1352


def test_buckets_and_reload():
    calib = IDEAL.with_overrides(weight_sync_bucket_overhead_s=0.5, weight_reload_fixed_s=1.0,
                                 weight_reload_per_tensor_s=0.01)
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=1, dst_devices=1, dst_tp=1, colocated=True,
                           bucket_bytes=1000, calib=calib)
    assert r.num_buckets == 3 and r.bucket_overhead_s == pytest.approx(1.5)
    # Toy tensors: 2 layers * (4 proj + 2 norms) + 2 * 3 FFN + 2 embeddings + final norm = 21.
    assert TOY.num_weight_tensors == 21
    assert r.reload_s == pytest.approx(1.0 + 0.21)
    no_reload = weight_sync_time_s(TOY, src_acc=DEV, src_devices=1, dst_devices=1, dst_tp=1, colocated=True,
                                   bucket_bytes=1000, calib=calib, include_reload=False)
    assert no_reload.reload_s == 0


def test_moe_tensor_count_dominates_reload():
    # 48 layers * 128 experts * 3 projections: ~18k tensors, the reason colocated MoE syncs take seconds.
    assert get_preset("qwen3-30b-a3b").num_weight_tensors > 18_000


def test_rejects_bad_layouts():
    with pytest.raises(ValueError, match="multiple of an instance's devices"):
        weight_sync_time_s(TOY, src_acc=DEV, src_devices=2, dst_devices=3, dst_tp=2, colocated=False)
    with pytest.raises(ValueError, match="colocated sync needs src_devices == dst_devices"):
        weight_sync_time_s(TOY, src_acc=DEV, src_devices=2, dst_devices=4, dst_tp=2, colocated=True)


def test_extra_versions_memory_matches_rollout_memory():
    arch, acc = get_preset("qwen3-8b"), get_accelerator("h100")
    extra = extra_version_bytes_per_device(arch, tp=2, dtype_bytes=2, extra_versions=3)
    assert extra == 3 * arch.total_params * 2 / 2
    mem = rollout_instance_memory(arch, acc, tp=2, dtype_bytes=2, extra_versions=3)
    assert mem.extra_version_bytes_per_device == pytest.approx(extra)
    with pytest.raises(ValueError):
        extra_version_bytes_per_device(arch, tp=0, dtype_bytes=2, extra_versions=1)


def test_point_to_point_buckets_count_the_busiest_device():
    r = weight_sync_time_s(TOY, src_acc=DEV, src_devices=1, dst_devices=4, dst_tp=1, colocated=False,
                           broadcast=False, bucket_bytes=1000, calib=IDEAL)
    # The single sender pushes 4 replicas * 2704 B = 10816 B -> 11 buckets; a broadcast needs only 3.
    assert r.num_buckets == 11
    b = weight_sync_time_s(TOY, src_acc=DEV, src_devices=1, dst_devices=4, dst_tp=1, colocated=False,
                           bucket_bytes=1000, calib=IDEAL)
    assert b.num_buckets == 3


def test_host_moves_go_over_the_host_link_and_cost_nothing_where_device_memory_is_host_memory():
    from planner.weight_sync import host_link_s, host_swap_s, trainer_swap_s

    link = dataclasses.replace(DEV, host_link_bandwidth_bytes_per_s=1000.0)
    calib = dataclasses.replace(IDEAL, host_link_efficiency=0.5, weight_reload_fixed_s=0.25)
    # 1000 B at 0.5 x 1000 B/s = 2 s; an engine's move adds its pause; the trainer's state goes out and back
    assert host_link_s(link, bytes_per_device=1000.0, calib=calib) == pytest.approx(2.0)
    assert host_swap_s(link, bytes_per_device=1000.0, calib=calib) == pytest.approx(2.25)
    assert trainer_swap_s(link, state_bytes_per_device=1000.0, calib=calib) == pytest.approx(4.0)
    cpu = get_accelerator("cpu")
    assert cpu.host_link_bandwidth_bytes_per_s is None
    assert host_link_s(cpu, bytes_per_device=1e12) == 0.0 == trainer_swap_s(cpu, state_bytes_per_device=1e12)
    # every GPU entry has a host link: PCIe Gen5 x16 (Gen4 on A100), one direction
    assert get_accelerator("h800").host_link_bandwidth_bytes_per_s == 64e9
    assert get_accelerator("a100-80g").host_link_bandwidth_bytes_per_s == 32e9


def test_an_attention_data_parallel_rank_receives_its_experts_only():
    """A rollout device of a dp-attention instance holds the non-expert weights and 1/(t dp) of the routed experts:
    that is what it receives, not the whole model as one tp-1 instance would."""
    from planner.weight_sync import rollout_weight_bytes_per_device

    moe = get_preset("qwen3-235b-a22b")
    acc = get_accelerator("h800")
    per_device = rollout_weight_bytes_per_device(moe, tp=1, dp=32, dtype_bytes=2)
    assert per_device == pytest.approx((moe.non_expert_params + moe.routed_expert_params_total / 32) * 2)
    assert rollout_weight_bytes_per_device(moe, tp=16, dtype_bytes=2) == pytest.approx(moe.total_params * 2 / 16)
    dp = weight_sync_time_s(moe, src_acc=acc, src_devices=64, dst_devices=64, dst_tp=1, dst_dp=32, dst_ep=32,
                            colocated=False, calib=IDEAL)
    whole = weight_sync_time_s(moe, src_acc=acc, src_devices=64, dst_devices=64, dst_tp=1, colocated=False,
                               calib=IDEAL)
    assert dp.num_replicas == 2 and whole.num_replicas == 64
    assert dp.transfer_s < whole.transfer_s / 4
