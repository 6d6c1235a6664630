"""Training cost model: hand-computed FLOPs, step time terms and memory on a toy model, plus published anchors."""

import dataclasses

import pytest

from planner.architecture import ModelArch, get_preset
from planner.calibration import Calibration
from planner.hardware import get_accelerator
from planner.train_cost import (
    TrainCostModel,
    activation_bytes_per_token_per_layer,
    dp_imbalance,
    lm_head_flops,
    lm_head_layers,
    pipeline_stage_imbalance,
    pipeline_stage_layers,
    train_flops,
    train_memory_per_device,
    train_step_time,
)

# Same toy as the rollout tests: N_c = 1272 matmul params, 64 attention FLOPs per (q, k) pair.
TOY = ModelArch(name="toy", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                ffn_hidden_size=16, vocab_size=10)
DEV = dataclasses.replace(get_accelerator("h100"), name="toy-dev", bf16_flops=1e6, hbm_bytes=1e6,
                          hbm_bandwidth_bytes_per_s=1e4, scale_up_bandwidth_bytes_per_s=1e3)
IDEAL = Calibration(train_mfu_dense=1.0, train_mfu_moe=1.0, hbm_bandwidth_efficiency=1.0, scale_up_efficiency=1.0,
                    scale_out_efficiency=1.0, collective_latency_s=0.0, train_step_overhead_s=0.0,
                    dp_comm_overlap_fraction=0.0, train_reserved_bytes_per_device=0.0, moe_imbalance_factor=1.0)
# One 100-token sequence: causal pairs (1e4 + 100)/2 = 5050 -> attention fwd 323,200; matmul fwd 2*1272*100.
FWD = 2 * 1272 * 100 + 64 * 5050
# Its LM head: 2*V*h = 160 FLOP per token forward, run 3 times (forward, two backward matmuls) on the last stage, and
# the log-softmax's 52 B per logit over 100 tokens x 10 logits at DEV's 1e4 B/s (5.2 s). A layer's share of the rest
# of 3*FWD takes (3*FWD - 48,000)/2 / 1e6 = 0.8424 s, so the last stage carries H = 5.248/0.8424 layers' extra work.
HEAD = 2 * 10 * 8 * 100
TOY_H = (3 * HEAD / 1e6 + 52 * 100 * 10 / 1e4) / ((3 * FWD - 3 * HEAD) / 2 / 1e6)


def test_flops_hand_computed():
    assert train_flops(TOY, tokens=100, seq_len_sum_sq=1e4) == (3 * FWD, 3 * FWD)
    assert train_flops(TOY, tokens=100, seq_len_sum_sq=1e4, extra_forward_passes=2)[0] == 5 * FWD
    # full recompute runs the layers' forward again, not the LM head (megatron-core checkpoints the layers only)
    assert train_flops(TOY, tokens=100, seq_len_sum_sq=1e4, recompute="full")[1] == 4 * FWD - HEAD
    assert lm_head_flops(TOY, tokens=100) == HEAD
    assert train_flops(TOY, tokens=100, seq_len_sum_sq=1e4, recompute="selective")[1] == 3 * FWD + 64 * 5050
    # Non-causal (Megatron/verl MFU convention): 6*N*T + 12*L*a*d*S2 for GQA.
    non_causal = train_flops(TOY, tokens=100, seq_len_sum_sq=1e4, causal=False)[0]
    assert non_causal == 6 * 1272 * 100 + 12 * 2 * 2 * 4 * 1e4
    with pytest.raises(ValueError, match="recompute must be"):
        train_flops(TOY, tokens=1, seq_len_sum_sq=1, recompute="some")  # type: ignore[arg-type]


def test_single_device_step_hand_computed():
    r = train_step_time(TOY, DEV, tp=1, pp=1, dp=1, tokens=100, seq_len_sum_sq=1e4, num_microbatches=1,
                        calib=IDEAL)
    # Local params: 2 layers * (1352 - 160 - 8)/2 + 160 = 1344; Adam streams 30 B each at 1e4 B/s.
    assert r.compute_s == pytest.approx(3 * FWD / 1e6)
    assert r.optimizer_s == pytest.approx(30 * 1344 / 1e4)
    assert r.bubble_s == 0 and r.comm_s == 0
    assert r.total_s == pytest.approx(3 * FWD / 1e6 + 4.032)
    assert r.mfu == pytest.approx(3 * FWD / (r.total_s * 1e6))


def test_pipeline_bubble_hand_computed():
    r = train_step_time(TOY, DEV, tp=1, pp=2, dp=1, tokens=100, seq_len_sum_sq=1e4, num_microbatches=4,
                        calib=IDEAL)
    # one layer per stage, the last also the head: 2*(1 + H)/(2 + H) of the mean stage
    assert r.stage_imbalance == pytest.approx(2 * (1 + TOY_H) / (2 + TOY_H))
    compute = r.stage_imbalance * 3 * FWD / 2e6
    assert r.compute_s == pytest.approx(compute)
    assert r.bubble_s == pytest.approx(compute / 4)                  # (p-1)/m of the ideal compute
    assert r.bubble_s / (r.compute_s + r.bubble_s) == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    # PP send/recv: activations + gradients of 100 tokens * 8 * 2 B over a 1e3 B/s link.
    assert r.comm_s == pytest.approx(3.2)
    virtual = train_step_time(TOY, DEV, tp=1, pp=2, dp=1, tokens=100, seq_len_sum_sq=1e4, num_microbatches=4,
                              virtual_pipeline_stages=2, calib=IDEAL)
    assert virtual.bubble_s == pytest.approx(compute / 8)


def test_tensor_parallel_comm_hand_computed():
    r = train_step_time(TOY, DEV, tp=2, pp=1, dp=1, tokens=100, seq_len_sum_sq=1e4, num_microbatches=1,
                        calib=IDEAL)
    # 4 collectives per pass (2 attention + 2 FFN), each on 100*8*2 = 1600 B: ring 2*(1/2)*6400/1e3 per pass;
    # forward + backward = 2 passes.
    assert r.comm_s == pytest.approx(2 * 6.4)


def test_data_parallel_comm_and_overlap():
    r = train_step_time(TOY, DEV, tp=1, pp=1, dp=2, tokens=100, seq_len_sum_sq=1e4, num_microbatches=1,
                        calib=IDEAL)
    # Reduce-scatter fp32 grads (1344*4 B) + all-gather bf16 params (1344*2 B), each (g-1)/g = 1/2 of it.
    assert r.comm_s == pytest.approx((1344 * 4 + 1344 * 2) / 2 / 1e3)
    hidden = train_step_time(TOY, DEV, tp=1, pp=1, dp=2, tokens=100, seq_len_sum_sq=1e4, num_microbatches=1,
                             calib=IDEAL.with_overrides(dp_comm_overlap_fraction=0.75))
    assert hidden.comm_s == pytest.approx(r.comm_s / 4)


def test_optimizer_steps_repeat_dp_sync_adam_and_pipeline_flush():
    """Each of o optimizer steps (minibatches) is a Megatron global batch: its own DP gradient sync, Adam update and
    pipeline flush (the bubble follows the m/o microbatches of one global batch); compute is unchanged."""
    one = train_step_time(TOY, DEV, tp=1, pp=2, dp=2, tokens=100, seq_len_sum_sq=1e4, num_microbatches=8,
                          calib=IDEAL)
    four = train_step_time(TOY, DEV, tp=1, pp=2, dp=2, tokens=100, seq_len_sum_sq=1e4, num_microbatches=8,
                           optimizer_steps=4, calib=IDEAL)
    assert four.compute_s == pytest.approx(one.compute_s)
    assert four.optimizer_s == pytest.approx(4 * one.optimizer_s)
    assert four.bubble_s == pytest.approx(one.compute_s * 1 / (8 / 4))  # (p-1)/(m/o) of the compute
    dp_sync = (1344 / 2 * 4 + 1344 / 2 * 2) / 2 / 1e3  # one reduce-scatter + all-gather of the stage's params
    assert four.comm_s - one.comm_s == pytest.approx(3 * dp_sync)
    with pytest.raises(ValueError, match="optimizer_steps"):
        train_step_time(TOY, DEV, tp=1, pp=1, dp=1, tokens=100, seq_len_sum_sq=1e4, num_microbatches=1,
                        optimizer_steps=0, calib=IDEAL)


def test_dp_imbalance_hand_computed():
    """The rank that gets the longest sequence carries it plus s-1 average ones (s = samples per rank per optimizer
    step); the others wait at the gradient sync."""
    # 64 sequences of mean 100 tokens, 4 ranks, 2 optimizer steps: 8 per rank; longest 1000 -> (1000 + 700) / 800
    assert dp_imbalance(tokens=6400, num_seqs=64, dp=4, optimizer_steps=2, longest_seq_tokens=1000) == 1700 / 800
    assert dp_imbalance(tokens=6400, num_seqs=64, dp=1, optimizer_steps=2, longest_seq_tokens=1000) == 1.0
    assert dp_imbalance(tokens=6400, num_seqs=64, dp=4, optimizer_steps=2, longest_seq_tokens=100) == 1.0
    # fewer sequences than ranks: the busiest holds the longest alone, the average rank half a sequence
    assert dp_imbalance(tokens=400, num_seqs=4, dp=8, longest_seq_tokens=100) == 100 / 50
    base = train_step_time(TOY, DEV, tp=1, pp=1, dp=4, tokens=6400, seq_len_sum_sq=6.4e5, num_microbatches=4,
                           optimizer_steps=2, calib=IDEAL)
    skewed = train_step_time(TOY, DEV, tp=1, pp=1, dp=4, tokens=6400, seq_len_sum_sq=6.4e5, num_microbatches=4,
                             optimizer_steps=2, num_seqs=64, longest_seq_tokens=1000, calib=IDEAL)
    assert skewed.dp_imbalance == 1700 / 800
    assert skewed.compute_s == pytest.approx(base.compute_s * 1700 / 800)
    assert skewed.comm_s == pytest.approx(base.comm_s) and skewed.optimizer_s == pytest.approx(base.optimizer_s)


def test_pipeline_stage_layers_follow_megatrons_uneven_split():
    """Middle stages equal at ceil(L/p), the first and last share the rest, the last (which also runs the LM head and
    the loss) as few as it may; None when an end would get no layer."""
    assert pipeline_stage_layers(64, 8) == (8, 8, 8)  # even
    assert pipeline_stage_layers(64, 3) == (22, 22, 20)  # 22 + 22 + 20 = 64
    assert pipeline_stage_layers(64, 6) == (11, 11, 9)  # 11 + 4*11 + 9
    assert pipeline_stage_layers(36, 8) == (5, 5, 1)  # Megatron's docs split it 3-5-5-5-5-5-5-3
    assert pipeline_stage_layers(94, 32) == (3, 3, 1)  # Qwen3-235B at pp 32: 3 + 30*3 + 1
    assert pipeline_stage_layers(7, 2) == (4, 4, 3)
    assert pipeline_stage_layers(36, 11) is None  # 9 middle stages of 4 take all 36
    assert pipeline_stage_layers(64, 65) is None and pipeline_stage_layers(64, 0) is None
    for layers in range(1, 100):
        for pp in range(1, layers + 1):
            split = pipeline_stage_layers(layers, pp)
            if split is not None:
                first, middle, last = split
                assert middle == -(-layers // pp) and 1 <= last <= first <= middle
                assert (first + (pp - 2) * middle + last == layers) if pp > 1 else first == layers
                if pp > 1:  # never slower than sharing the rest evenly between the ends, whatever the head costs
                    rest = layers - (pp - 2) * middle
                    for head in (0.0, 0.5, 2.0, 5.0):
                        even_ends = max(-(-rest // 2), middle, rest // 2 + head)
                        assert max(first, middle, last + head) <= even_ends
    assert pipeline_stage_imbalance(64, 8) == 1.0 and pipeline_stage_imbalance(64, 6) == 6 * 11 / 64


def test_lm_head_and_loss_load_the_last_stage():
    """The last stage runs its layers plus the LM head (3 x 2*V*h*T FLOPs) and the log-softmax over T*V logits
    (memory-bound): H layers' worth, and every stage waits for it."""
    # TOY on DEV, hand-computed above the tests: 5.248 s of head and loss against a layer's 0.8424 s.
    assert TOY_H == pytest.approx(5.248 / 0.8424)
    h = lm_head_layers(TOY, DEV, layers_hw_flops=3 * FWD - 3 * HEAD, tokens=100, extra_forward_passes=0,
                       eta_train=1.0, hbm_efficiency=1.0)
    assert h == pytest.approx(TOY_H)
    # An extra forward pass (old log-probs): the head once more (4 x 16,000 FLOP: 0.064 s) and the forward of the
    # log-softmax, 38 B per logit (52 + 38 = 90 B x 1000 logits at 1e4 B/s: 9 s); a layer (4*FWD - 64,000)/2 FLOP.
    h1 = lm_head_layers(TOY, DEV, layers_hw_flops=4 * FWD - 4 * HEAD, tokens=100, extra_forward_passes=1,
                        eta_train=1.0, hbm_efficiency=1.0)
    assert h1 == pytest.approx((0.064 + 9.0) / ((4 * FWD - 4 * HEAD) / 2 / 1e6))
    # busiest stage / mean stage, the mean carrying (L + H)/p layers
    assert pipeline_stage_imbalance(28, 28, 0.84) == pytest.approx(28 * 1.84 / 28.84)  # every stage 1 layer
    assert pipeline_stage_imbalance(64, 16, 2.0) == pytest.approx(16 * 6 / 66)  # 4 + 2 on the last
    assert pipeline_stage_imbalance(36, 8, 2.0) == pytest.approx(8 * 5 / 38)  # (5, 5, 1): 1 + 2 fits under 5
    assert pipeline_stage_imbalance(36, 1, 5.0) == 1.0  # one stage: the calibrated efficiency covers it all


def test_longcat_last_stage_at_pp_28():
    """LongCat-Flash at pp = L = 28 (the 560B example's old plan): the last stage's layer plus the head is 1.85x the
    mean stage's work, where charging ceil(L/p) layers said 1.0. At 4096-token sequences a layer does
    2*0.9409 G matmul FLOPs + 81,920 per (q, k) pair * 2048.5 pairs = 2.0496 GFLOP per token, the head
    2*131072*6144 = 1.6106 G (0.786 layers); the loss's 52 B x 131072 logits at 0.8 x 3.35 TB/s against the layer's
    3 x 2.0496 GFLOP at 0.3 x 989.5 TFLOP/s per token adds 0.123 layers."""
    arch, acc = get_preset("longcat-flash"), get_accelerator("h800")
    layer = 2 * (arch.matmul_params_per_token - 131072 * 6144) / 28 + 81920 * (4096 + 1) / 2
    assert layer / 1e9 == pytest.approx(2.0496, abs=1e-4)
    head = 1.6106e9 / layer + (52 * 131072 / (0.8 * 3.35e12)) / (3 * layer / (0.3 * 989.5e12))
    assert head == pytest.approx(0.909, abs=1e-3)
    kw = dict(tokens=32768 * 4096, seq_len_sum_sq=32768 * 4096**2, num_microbatches=64)
    one = train_step_time(arch, acc, tp=4, pp=1, dp=1, ep=8, cp=8, **kw)
    r = train_step_time(arch, acc, tp=4, pp=28, dp=1, ep=8, cp=8, **kw)
    assert r.stage_imbalance == pytest.approx(28 * (1 + head) / (28 + head), rel=1e-3)  # 1.849
    assert r.compute_s == pytest.approx(one.compute_s / 28 * r.stage_imbalance)


def test_uneven_pipeline_charges_the_busiest_stage():
    """Every stage runs at the pace of the busiest, ceil(L/p) layers or the last stage's layers plus the LM head
    and loss: compute scales by p*max(f, m, l + H)/(L + H)."""
    arch = dataclasses.replace(TOY, num_layers=3)
    # Fast memory: the loss is 52 B x 64,000 logits / 1e12 B/s = 3.3 us; the head 3 x 160 x 6400 = 3.072 MFLOP
    # against a layer's (3*fwd - 3.072e6)/3, fwd = 2*1864*6400 + 96*323,200 (3 layers of 576 matmul params and
    # 56 norm weights, 32 attention FLOPs per pair each): H = 3.072e6 / 53.8624e6 = 0.0570 layers.
    fast = dataclasses.replace(DEV, hbm_bandwidth_bytes_per_s=1e12)
    kw = {"tp": 1, "dp": 1, "tokens": 6400, "seq_len_sum_sq": 6.4e5, "num_microbatches": 4, "calib": IDEAL}
    head = (3.072 + 3.328e-6) / 53.8624
    one = train_step_time(arch, fast, pp=1, **kw)
    two = train_step_time(arch, fast, pp=2, **kw)  # stages of 2 and 1 + H layers: the busiest does 2/((3 + H)/2)
    assert two.stage_imbalance == pytest.approx(4 / (3 + head)) and one.stage_imbalance == 1.0
    assert two.compute_s == pytest.approx(one.compute_s / 2 * two.stage_imbalance)  # twice the devices
    three = train_step_time(arch, fast, pp=3, **kw)  # 1, 1, 1 + H
    assert three.stage_imbalance == pytest.approx(3 * (1 + head) / (3 + head))
    assert three.compute_s == pytest.approx(one.compute_s / 3 * three.stage_imbalance)
    with pytest.raises(ValueError, match="cannot split 36 layers"):
        train_step_time(dataclasses.replace(TOY, num_layers=36), DEV, pp=11, **kw)


def test_memory_hand_computed():
    mem = train_memory_per_device(TOY, DEV, tp=1, pp=1, dp=1, micro_batch_tokens=100, calib=IDEAL)
    assert mem.params_bytes == 1344 * 2 and mem.grads_bytes == 1344 * 4 and mem.optimizer_bytes == 1344 * 12
    # Per token per layer: attention 2*2*8 + 4*2 + 2*(8 + 4 + 4 + 8) = 88; FFN 2*(2*8 + 3*16) = 128.
    assert activation_bytes_per_token_per_layer(TOY) == 216
    # 216 * 2 layers * 100 tokens + fp32 logits and their grad 8 * 10 * 100.
    assert mem.activations_bytes == 216 * 2 * 100 + 8000
    assert mem.total_bytes == 2688 + 5376 + 16128 + 51200
    assert mem.fits


def test_distributed_optimizer_matches_megatron_table():
    arch, acc = get_preset("qwen3-8b"), get_accelerator("h100")
    mem = train_memory_per_device(arch, acc, tp=1, pp=1, dp=8, micro_batch_tokens=1)
    per_param = (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes) / (arch.total_params - arch.hidden_size)
    assert per_param == pytest.approx(6 + 12 / 8)  # Megatron-LM docs: bf16 params, fp32 grads: 6 + 12/d
    plain = train_memory_per_device(arch, acc, tp=1, pp=1, dp=8, micro_batch_tokens=1, distributed_optimizer=False)
    assert plain.optimizer_bytes == pytest.approx(8 * mem.optimizer_bytes)


def test_does_not_fit_message_and_recompute_helps():
    arch, acc = get_preset("qwen3-32b"), get_accelerator("h100")
    big = train_memory_per_device(arch, acc, tp=1, pp=1, dp=8, micro_batch_tokens=16384)
    assert not big.fits
    assert big.message.startswith("does not fit: needs ") and "GiB, has 79.6 GiB" in big.message
    sharded = train_memory_per_device(arch, acc, tp=8, pp=1, dp=1, micro_batch_tokens=16384, recompute="full")
    assert sharded.fits and sharded.total_bytes < big.total_bytes


def test_megatron_modelzoo_flops_accounting():
    # Megatron-MoE-ModelZoo best_practice/Qwen3: 256 H100, GBS 2048 x 4096 tokens, 19.7 s/step at 245 TF/GPU
    # -> 1.236e18 FLOP per step.  Our causal count must agree with the one Megatron reports throughput with.
    model_flops, _ = train_flops(get_preset("qwen3-235b-a22b"), tokens=2048 * 4096, seq_len_sum_sq=2048 * 4096**2)
    assert model_flops == pytest.approx(245e12 * 256 * 19.7, rel=0.02)


def test_moe_expert_parallel_costs_time_and_checks_layout():
    arch, acc = get_preset("qwen3-235b-a22b"), get_accelerator("h100")
    kw = dict(tokens=1024 * 4096, seq_len_sum_sq=1024 * 4096**2, num_microbatches=64)
    intra = train_step_time(arch, acc, tp=2, pp=8, dp=16, ep=8, **kw)
    cross = train_step_time(arch, acc, tp=2, pp=8, dp=16, ep=32, **kw)
    assert cross.comm_s > intra.comm_s
    assert 0.05 < intra.mfu < 0.35
    with pytest.raises(ValueError, match=r"ep \(64\) must divide tp\*cp\*dp = 2\*1\*16 = 32"):
        train_step_time(arch, acc, tp=2, pp=8, dp=16, ep=64, **kw)
    with pytest.raises(ValueError, match="needs an MoE model"):
        train_step_time(get_preset("qwen3-8b"), acc, tp=1, pp=1, dp=8, ep=2, **kw)


def test_cost_model_object_matches_function():
    model = TrainCostModel(arch=TOY, acc=DEV, tp=1, pp=2, dp=1, micro_batch_tokens=25, calib=IDEAL)
    assert model.num_microbatches(100, 1) == 4
    assert model.train_step_s(100, 1e4, 1) == pytest.approx(
        train_step_time(TOY, DEV, tp=1, pp=2, dp=1, tokens=100, seq_len_sum_sq=1e4, num_microbatches=4,
                        calib=IDEAL).total_s)
    assert model.train_step_s(0, 0, 0) == 0.0
    per_seq = TrainCostModel(arch=TOY, acc=DEV, tp=1, pp=1, dp=2, calib=IDEAL)
    assert per_seq.num_microbatches(1000, 7) == 4


def test_a_does_not_fit_message_adds_up():
    """The parts printed must add up to the total printed: '157.4 GiB (15.3 + 30.5 + 91.5 + 16.0 + 4.0)' added to
    157.3, a reader's first suspicion of a bug."""
    import re
    from decimal import Decimal

    from planner.architecture import get_preset
    from planner.hardware import get_accelerator
    from planner.train_cost import train_memory_per_device

    arch, h800 = get_preset("qwen3-8b"), get_accelerator("h800")
    checked = 0
    for tp, mbt in ((1, 8192), (2, 8192), (4, 8192), (1, 32768), (4, 32768), (2, 65536), (8, 131072)):
        memory = train_memory_per_device(arch, h800, tp=tp, pp=1, dp=1, ep=1, micro_batch_tokens=mbt)
        if memory.fits:
            continue
        found = re.search(r"needs ([\d.]+) GiB.*\(params ([\d.]+) \+ grads ([\d.]+) \+ optimizer ([\d.]+) \+ "
                          r"activations ([\d.]+) \+ reserve ([\d.]+)\)", memory.message)
        assert found is not None, memory.message
        total, *parts = found.groups()
        assert Decimal(total) == sum(Decimal(p) for p in parts), memory.message
        assert abs(float(total) - memory.total_bytes / 2**30) <= 0.5 * 10.0 ** Decimal(total).as_tuple().exponent
        checked += 1
    assert checked >= 3
