"""The Megatron trainer on CPU: megatron-core's real GPTModel built from dora's lowered config.json, packed
forward, GRPO steps, and the export to checkpoint (Hugging Face) names checked against an independent forward.

The GPU half (bf16, megatron-core's optimiser, transformers' own model classes) is tests/gpu/test_megatron_gpu.py.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_lower_plans import example_plan, load_example

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

from dora.lower.megatron import megatron_config  # noqa: E402
from dora.runtime.engines.base import FinishedTrajectory, ScoredTrajectory  # noqa: E402
from dora.runtime.engines.megatron_trainer import (  # noqa: E402
    MegatronTrainer,
    MegatronTrainerConfig,
    MegatronTrainerError,
    build_gpt_model,
    cu_seqlens,
    hf_weights,
    megatron_weights,
    moe_layers,
    packed_logits,
    token_logprob,
    trained_token_logprobs,
    unsupported,
)
from dora.runtime.engines.torch_trainer import GRPOSettings, pack, target_logprobs  # noqa: E402
from planner.architecture import arch_from_hf_config  # noqa: E402

VOCAB = 97


def tiny_hf_config(model_type: str = "qwen3", *, tied: bool = False, norm_topk: bool = True) -> dict:
    moe = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": norm_topk,
           "decoder_sparse_step": 1, "mlp_only_layers": []} if model_type == "qwen3_moe" else {}
    return {"model_type": model_type, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
            "max_position_embeddings": 4096, "rope_theta": 10_000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": tied, "hidden_act": "silu", **moe}


def lowered(model_type: str = "qwen3", *, tied: bool = False, norm_topk: bool = True,
            **train_changes: int) -> dict:
    """megatron/config.json of the dense-8b example re-planned onto one device with a tiny architecture
    (``qwen3_moe``: 8 experts, top-2)."""
    resolved = load_example("dense-8b-h800x64")
    plan = example_plan(resolved, "dense-8b-h800x64")
    plan = dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, **({"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "accelerators": 1} | train_changes)))
    arch = arch_from_hf_config(tiny_hf_config(model_type, tied=tied, norm_topk=norm_topk), name=f"tiny-{model_type}")
    return megatron_config(dataclasses.replace(resolved, arch=arch), plan)


SETTINGS = GRPOSettings(off_policy_correction="tis", is_weight_cap=2.0, ppo_clip_eps=0.2, num_minibatches=1,
                        temperature=1.0, pack_len=64)


def trainer(config: dict, **changes) -> MegatronTrainer:
    return MegatronTrainer(MegatronTrainerConfig(megatron=config, grpo=SETTINGS, device="cpu", seed=3), **changes)


# ---- an independent forward in Hugging Face Llama/Qwen3 terms, over the exported names ----

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _swiglu(w: dict[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    gate, up = h @ w[p + "gate_proj.weight"].T, h @ w[p + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[p + "down_proj.weight"].T


def reference_logits(w: dict[str, torch.Tensor], hf: dict, ids: list[int]) -> torch.Tensor:
    heads, kv, d, eps = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"], hf["rms_norm_eps"]
    n = len(ids)
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    inv = 1.0 / hf["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (h @ w[p + f"self_attn.{x}_proj.weight"].T + w.get(p + f"self_attn.{x}_proj.bias", 0.0)
                   for x in "qkv")
        q, k, v = q.view(n, heads, d), k.view(n, kv, d), v.view(n, kv, d)
        if hf["model_type"] in ("qwen3", "qwen3_moe"):
            q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if p + "mlp.gate.weight" not in w:
            x = x + _swiglu(w, p + "mlp.", h)
            continue
        # Qwen3-MoE: softmax over all experts, the top-k, renormalised over them where norm_topk_prob says
        probs = (h @ w[p + "mlp.gate.weight"].T).softmax(-1)
        top, chosen = probs.topk(hf["num_experts_per_tok"], dim=-1)
        if hf["norm_topk_prob"]:
            top = top / top.sum(-1, keepdim=True)
        for t in range(n):
            x[t] = x[t] + sum(top[t, j] * _swiglu(w, p + f"mlp.experts.{int(e)}.", h[t])
                              for j, e in enumerate(chosen[t]))
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


SEQS = [((5, 6, 7), (8, 9, 10, 11)), ((12,), (13, 14)), ((1, 2, 3, 4, 5, 6), (7, 8, 9)), ((40,), (41,))]


def randomize_biases(model) -> None:
    """megatron-core starts biases at zero, which would hide a misplaced one."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))


@pytest.mark.parametrize(("model_type", "tied"), [("qwen3", False), ("llama", True), ("qwen2", False)])
def test_exported_weights_compute_the_same_logits_under_checkpoint_names(model_type: str, tied: bool) -> None:
    config = lowered(model_type, tied=tied)
    model = build_gpt_model(config, device="cpu", seed=1)
    assert config["transformer"]["add_qkv_bias"] is (model_type == "qwen2")
    randomize_biases(model)
    exported = hf_weights({k: v for k, v in model.state_dict().items() if "_extra_state" not in k}, config)
    assert ("lm_head.weight" in exported) is not tied
    assert ("model.layers.0.self_attn.q_norm.weight" in exported) is (model_type == "qwen3")
    hf = tiny_hf_config(model_type, tied=tied)
    for prompt, response in SEQS:
        ids = list(prompt + response)
        with torch.no_grad():
            ours = packed_logits(model, pack([(prompt, response)], 64))[0, : len(ids)]
        torch.testing.assert_close(ours, reference_logits(exported, hf, ids), rtol=1e-4, atol=1e-4)


def test_checkpoint_names_round_trip_and_load_as_version_zero() -> None:
    config = lowered()
    first = trainer(config)
    _, exported = first.export_weights()
    assert torch.equal(torch.stack([exported[k].sum() for k in sorted(exported)]),
                       torch.stack([hf_weights(megatron_weights(exported, config), config)[k].sum()
                                    for k in sorted(exported)]))
    other = MegatronTrainer(MegatronTrainerConfig(megatron=config, grpo=SETTINGS, device="cpu", seed=99),
                            initial_weights=exported)
    assert all(torch.equal(exported[k], v) for k, v in other.export_weights()[1].items())
    assert other.export_weights()[0] == 0
    with pytest.raises(MegatronTrainerError, match="lack .model.layers.1"):
        trainer(config, initial_weights={k: v for k, v in exported.items() if "layers.1." not in k})


def test_the_same_seed_builds_the_same_version_zero() -> None:
    config = lowered()
    a, b = trainer(config).export_weights()[1], trainer(config).export_weights()[1]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_packed_row_computes_what_each_sequence_computes_alone() -> None:
    model = build_gpt_model(lowered(), device="cpu", seed=2)
    packed = pack(list(SEQS), 16)
    assert packed.token_ids.shape[0] < len(SEQS)  # some row holds several sequences
    with torch.no_grad():
        together = packed_logits(model, packed).reshape(-1, VOCAB)[packed.logit_index]
        alone = torch.cat([packed_logits(model, pack([s], 16)).reshape(-1, VOCAB)[pack([s], 16).logit_index]
                           for s in SEQS])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def _batch(version: int = 0) -> list[ScoredTrajectory]:
    """Two groups; in each the first response is rewarded. Behaviour log-probs are set equal to the trainer's own
    so the step is on-policy (IS weight 1)."""
    out = []
    for g, (prompt, responses) in enumerate([((3, 4), [(10, 11, 12), (20, 21)]), ((5,), [(30, 31), (40, 41, 42)])]):
        for j, response in enumerate(responses):
            traj = FinishedTrajectory(request_id=f"{g}-{j}", prompt_ids=prompt, response_ids=response,
                                      behaviour_logprobs=(-math.log(VOCAB),) * len(response),
                                      version_spans=((version, len(response)),), finish_reason="stop")
            out.append(ScoredTrajectory(trajectory=traj, reward=1.0 if j == 0 else 0.0, group_id=str(g)))
    return out


def test_grpo_steps_raise_the_rewarded_responses_and_publish_versions() -> None:
    config = lowered()
    config["optimizer"]["lr"] = 1e-2  # the example's 1e-6 suits an 8B checkpoint, not 5 steps of a tiny model
    t = trainer(config)
    batch = _batch()
    rewarded = pack([(s.trajectory.prompt_ids, s.trajectory.response_ids) for s in batch if s.reward], 64)
    with torch.no_grad():
        before = float(t.logprobs(rewarded).mean())
    weights_before = t.export_weights()[1]
    metrics = [t.train_step(batch) for _ in range(5)]
    assert [m.version for m in metrics] == [1, 2, 3, 4, 5] and t.export_weights()[0] == 5
    assert metrics[0].num_trained_tokens == 10 and metrics[0].num_forward_tokens == 16
    assert all(math.isfinite(m.loss) and m.grad_norm > 0 for m in metrics)
    with torch.no_grad():
        assert float(t.logprobs(rewarded).mean()) > before + 0.5
    assert any(not torch.equal(weights_before[k], v) for k, v in t.export_weights()[1].items())


def next_step_after_restore(make, config: dict) -> tuple[dict, dict]:
    """Weights after a second step, of a trainer and of a fresh one restored from its state after the first."""
    a = make(config)
    a.train_step(_batch())
    b = make(config)
    b.load_state_dict(a.state_dict())
    a.train_step(_batch(1))
    b.train_step(_batch(1))
    assert a.version == b.version == 2
    return a.export_weights()[1], b.export_weights()[1]


def test_a_restored_trainer_takes_the_same_next_step() -> None:
    wa, wb = next_step_after_restore(trainer, lowered())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_kl_penalty_to_version_0_is_applied_and_survives_a_restore() -> None:
    """``algorithm.kl_coef`` on the Megatron trainer: the reference is a second model holding version 0's weights;
    the first step's KL is 0, later ones positive, and a restored trainer takes the same next step."""
    config = lowered()
    config["optimizer"]["lr"] = 1e-2
    kl = dataclasses.replace(SETTINGS, kl_coef=0.5)

    def make(cfg: dict) -> MegatronTrainer:
        return MegatronTrainer(MegatronTrainerConfig(megatron=cfg, grpo=kl, device="cpu", seed=3))

    t = make(config)
    first, second = t.train_step(_batch()), t.train_step(_batch())
    assert first.kl_mean == 0.0 and second.kl_mean > 0
    assert "reference" in t.state_dict()
    wa, wb = next_step_after_restore(make, config)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    plain = trainer(config)
    plain.train_step(_batch())
    plain.train_step(_batch())
    assert any(not torch.equal(t.export_weights()[1][k], v) for k, v in plain.export_weights()[1].items())


def test_what_the_trainer_does_not_run_is_refused_before_anything_is_built() -> None:
    biased = lowered()
    biased["transformer"]["add_bias_linear"] = True
    assert any("add_bias_linear" in p for p in unsupported(biased))
    config = lowered(tp=2, accelerators=2)
    assert unsupported(config) == ["tensor_model_parallel_size = 2 (this trainer runs one rank; multi-rank "
                                   "training needs torchrun and megatron-core's pipeline schedules, which dora "
                                   "does not launch yet)"]
    with pytest.raises(MegatronTrainerError, match="tensor_model_parallel_size = 2"):
        trainer(config)
    moe = lowered("qwen3_moe")
    assert unsupported(moe) == []
    moe["transformer"]["moe_shared_expert_intermediate_size"] = 64
    assert unsupported(moe) == ["moe_shared_expert_intermediate_size = 64 (shared experts are not written)"]
    with pytest.raises(MegatronTrainerError, match="MoE router runs on CUDA only"):
        trainer(lowered("qwen3_moe"))


def test_megatron_cores_router_linear_runs_without_transformer_engine() -> None:
    """megatron-core 0.16.1 names ``te_general_gemm`` only when TE imports; building an MoE model binds it to
    None so the router takes its torch path (which this CPU can run directly)."""
    from megatron.core.transformer.moe import moe_utils

    build_gpt_model(lowered("qwen3_moe"), device="cpu")
    assert moe_utils.HAVE_TE or moe_utils.te_general_gemm is None
    x = torch.randn(5, 64, requires_grad=True)
    w = torch.randn(8, 64, requires_grad=True)
    logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(logits, x @ w.T)
    logits.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(5, 64).detach())


def test_grouped_experts_compute_each_experts_swiglu_scaled_by_its_router_probability() -> None:
    """dora's GroupedExperts, both paths: one expert after another (here), and the two grouped GEMMs
    (``torch._grouped_mm``, whose forward this CPU runs too), against each expert's SwiGLU written out."""
    model = build_gpt_model(lowered("qwen3_moe"), device="cpu", seed=5)
    experts = model.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "GroupedExperts"
    counts = torch.tensor([3, 0, 5, 1, 0, 2, 4, 1])  # an expert may get no token
    hidden, probs = torch.randn(int(counts.sum()), 64), torch.rand(int(counts.sum()))
    want, start = [], 0
    for e, n in enumerate(counts.tolist()):
        gate, up = (hidden[start:start + n] @ experts.weight1[e].t()).chunk(2, dim=-1)
        want.append((F.silu(gate) * up * probs[start:start + n, None]) @ experts.weight2[e].t())
        start += n
    with torch.no_grad():
        out, bias = experts(hidden, counts, probs)
        offs = counts.cumsum(0).to(torch.int32)
        grouped = torch._grouped_mm(experts._activation(torch._grouped_mm(hidden, experts.weight1.transpose(1, 2),
                                                                           offs=offs), probs),
                                    experts.weight2.transpose(1, 2), offs=offs)
    assert bias is None
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, torch.cat(want), rtol=1e-5, atol=1e-5)


def test_an_moe_model_exports_each_expert_under_the_qwen_moe_checkpoint_names_and_back() -> None:
    config = lowered("qwen3_moe")
    config["transformer"]["moe_layer_freq"] = [0, 1]  # a dense first layer, as DeepSeek's first_k_dense_replace
    assert moe_layers(config["transformer"]) == [False, True]
    state = {k: v for k, v in build_gpt_model(config, device="cpu", seed=4).state_dict().items()
             if "_extra_state" not in k}
    exported = hf_weights(state, config)
    ffn = {"model.layers.0.mlp.gate_proj.weight": (96, 64), "model.layers.0.mlp.up_proj.weight": (96, 64),
           "model.layers.0.mlp.down_proj.weight": (64, 96), "model.layers.1.mlp.gate.weight": (8, 64)}
    for e in range(8):
        ffn |= {f"model.layers.1.mlp.experts.{e}.gate_proj.weight": (32, 64),
                f"model.layers.1.mlp.experts.{e}.up_proj.weight": (32, 64),
                f"model.layers.1.mlp.experts.{e}.down_proj.weight": (64, 32)}
    assert {k: tuple(v.shape) for k, v in exported.items() if ".mlp." in k} == ffn
    back = megatron_weights(exported, config)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert state["decoder.layers.1.mlp.experts.weight1"].shape == (8, 64, 64)  # [experts, gate + up, hidden]
    fc1 = state["decoder.layers.1.mlp.experts.weight1"][5]
    assert torch.equal(exported["model.layers.1.mlp.experts.5.gate_proj.weight"], fc1[:32])  # gate first
    assert moe_layers({"num_layers": 4, "num_moe_experts": 8, "moe_layer_freq": 2}) == [True, False, True, False]


def test_microbatches_accumulate_to_the_same_step_as_one_forward() -> None:
    """Gradients accumulated over microbatches of one packed row each give the step one forward of the whole
    minibatch gives (the loss is the token mean over the batch either way)."""
    config = lowered()
    config["optimizer"]["lr"] = 1e-2
    whole = trainer(config)
    micro = MegatronTrainer(MegatronTrainerConfig(
        megatron=config, grpo=dataclasses.replace(SETTINGS, pack_len=8, microbatch_rows=1), device="cpu", seed=3))
    w0 = whole.export_weights()[1]
    a, b = whole.train_step(_batch()), micro.train_step(_batch())
    assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    wa, wb = whole.export_weights()[1], micro.export_weights()[1]
    # Adam's first step moves each weight by about lr * sign(g), so a gradient element near zero may round
    # either way: compare the updates as a whole.
    apart = math.sqrt(sum(float((wa[k] - wb[k]).pow(2).sum()) for k in wa))
    moved = math.sqrt(sum(float((wa[k] - w0[k]).pow(2).sum()) for k in wa))
    assert moved > 0.1 and apart < 1e-3 * moved


def test_trained_token_log_probs_are_the_full_logits_log_softmax_at_the_trained_positions() -> None:
    model = build_gpt_model(lowered(), device="cpu", seed=4)
    packed = pack(list(SEQS), 16)
    with torch.no_grad():
        full = target_logprobs(packed_logits(model, packed), packed, 0.7)
        torch.testing.assert_close(trained_token_logprobs(model, packed, 0.7), full, rtol=1e-5, atol=1e-5)


def test_cu_seqlens_mark_where_each_packed_sequence_and_row_tail_starts() -> None:
    packed = pack([((1, 2), (3,)), ((4,), (5, 6, 7)), ((8,), (9,))], 5)  # rows: [4 tokens, tail 1], [3 + 2]
    assert packed.segment_ids.tolist() == [[0, 0, 0, 0, -1], [0, 0, 0, 1, 1]]
    assert cu_seqlens(packed).tolist() == [0, 4, 5, 8, 10]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_one_copy_log_softmax_matches_autograd_cross_entropy(dtype: torch.dtype, temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 50, generator=gen) * 3).to(dtype).requires_grad_()
    targets = torch.tensor([0, 7, 49, 3, 3, 20])
    weights = torch.randn(6, generator=gen)
    before = logits.detach().clone()
    ours = token_logprob(logits, targets, temperature)
    assert torch.equal(logits.detach(), before)  # the fp32 copy is its own, even when the logits are fp32
    (ours * weights).sum().backward()
    ours_grad, logits.grad = logits.grad, None
    ref = -F.cross_entropy(logits.float() / temperature, targets, reduction="none")
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert ours_grad is not None and ours_grad.dtype == dtype
    torch.testing.assert_close(ours_grad, logits.grad)


@pytest.mark.parametrize("stem", ["qwen3-1.7b-h100x1", "qwen3-1.7b-short-h100x1", "qwen3-30b-a3b-4l-h100x1",
                                  "qwen3-30b-a3b-4l-long-h100x1"])
def test_the_gpu_bench_specs_plan_a_layout_this_trainer_runs(stem: str) -> None:
    """bench/megatron_train.py trains what these specs plan; the planner must keep giving it one rank."""
    from dora.planning import make_plan
    from dora.spec import load_spec

    specs = Path(__file__).resolve().parents[2] / "bench" / "specs"
    resolved = load_spec(str(specs / f"{stem}.yaml"))
    plan = make_plan(resolved).plan
    calibration = specs / f"{stem}.calibration.json"  # what bench/megatron_train.py --calibration-out wrote
    if calibration.exists():
        from dora.planning import load_calibration

        calib = load_calibration(str(calibration))
        fitted = calib.train_mfu_moe if resolved.arch.is_moe else calib.train_mfu_dense
        assert 0.2 < fitted < 0.5 and "megatron_train.py" in calib.source
        assert make_plan(resolved, calibration=calib).plan.train.accelerators == 1
    config = megatron_config(resolved, plan)
    assert unsupported(config) == []
    assert config["transformer"]["qk_layernorm"]
    moe = config["transformer"].get("num_moe_experts")
    assert moe == (128 if "a3b" in stem else None)
    assert config["gpt_model"]["share_embeddings_and_output_weights"] is not bool(moe)  # Qwen3-1.7B ties them
    assert next(m for m in plan.memory if m.side == "train").need_bytes < 80e9


@pytest.mark.parametrize("tied", [True, False])
def test_the_torch_engines_swiglu_model_computes_what_megatron_trains(tied: bool) -> None:
    """The torch rollout engine's model (``mlp="swiglu"``) loaded with the Megatron trainer's export computes the
    same logits as megatron-core's GPTModel: what a Megatron trainer publishes, a torch engine generates with."""
    from dora.runtime.engines.tiny_model import TinyModelConfig, TinyTransformer, tiny_weights

    config = lowered("llama", tied=tied)
    model = build_gpt_model(config, device="cpu", seed=11)
    hf = tiny_hf_config("llama", tied=tied)
    tiny_config = TinyModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                  ffn_size=96, vocab_size=VOCAB, tie_embeddings=tied, rope_theta=hf["rope_theta"],
                                  norm_eps=hf["rms_norm_eps"], mlp="swiglu")
    tiny = TinyTransformer(tiny_config)
    tiny.load_state_dict(tiny_weights(hf_weights({k: v for k, v in model.state_dict().items()
                                                  if "_extra_state" not in k}, config), tiny_config))
    packed = pack(list(SEQS), 16)
    with torch.no_grad():
        ours = tiny.forward_rows(packed.token_ids, packed.position_ids, packed.segment_ids)
        theirs = packed_logits(model, packed)
    real = packed.segment_ids >= 0
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4)


def test_the_runtimes_trainer_actor_trains_with_megatron_and_restores_what_it_saved(tmp_path: Path) -> None:
    """TrainerActor with the lowered Megatron config (no Ray here): version 0 is the torch trainer's (warm-up)
    weights through the checkpoint's names, steps are megatron-core's, published weights come back in the torch
    engines' names, and a checkpoint restores the same version and weights."""
    from dora.runtime.actors import TrainerActor
    from dora.runtime.engines.tiny_model import TinyModelConfig, export_weights
    from dora.runtime.engines.torch_trainer import TrainerConfig
    from dora.runtime.tasks import TaskConfig
    from planner.workload import LengthDistribution

    config = lowered("llama")
    config["optimizer"]["lr"] = 1e-2
    model = TinyModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_size=96,
                            vocab_size=VOCAB, tie_embeddings=False, mlp="swiglu")

    def actor() -> TrainerActor:
        return TrainerActor(TrainerConfig(model=model), task=TaskConfig(), seed=0, warmup_learning_rate=1e-3,
                            lengths=LengthDistribution.lognormal(median=4, p99=20, max_tokens=24), megatron=config)

    a = actor()
    torch_v0 = export_weights(a._trainer.model)
    _, v0 = a.publish(0)
    assert v0.keys() == torch_v0.keys() and all(torch.equal(v0[k], torch_v0[k]) for k in v0)
    metrics = a.train_step(_batch())
    assert metrics.version == 1 and type(a._megatron).__name__ == "MegatronTrainer"
    assert a.save_state(str(tmp_path / "trainer.pt")) == 1
    b = actor()
    assert b.load_state(str(tmp_path / "trainer.pt")) == 1
    (_, wa), (_, wb) = a.publish(1), b.publish(1)
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and not torch.equal(wa["layers.0.qkv.weight"],
                                                                          v0["layers.0.qkv.weight"])


def test_the_driver_refuses_megatron_for_a_model_the_torch_engines_do_not_compute() -> None:
    """A q/k-norm model (Qwen3): megatron-core would train norms the torch engines' model lacks."""
    import json as _json

    from dora.runtime.config import RuntimeConfig, RuntimeConfigError
    from dora.runtime.driver import _megatron_for_torch_engines

    golden = Path(__file__).resolve().parents[1] / "golden" / "launch" / "local-tiny" / "launch" / "runtime.json"
    data = _json.loads(golden.read_text())
    data.update(trainer="megatron", megatron=lowered("llama"))
    assert _megatron_for_torch_engines(RuntimeConfig.from_json(_json.dumps(data)), 50)["gpt_model"]["vocab_size"] == 50
    data["model"]["qk_norm"] = True
    with pytest.raises(RuntimeConfigError, match="model.qk_norm"):
        _megatron_for_torch_engines(RuntimeConfig.from_json(_json.dumps(data)), 50)


def _gradients_at_the_optimizer_step(t: MegatronTrainer) -> list[list[torch.Tensor]]:
    """Record every parameter's gradient as the trainer's optimizer step begins (before clipping and the update): what
    a step in parts must make equal to the whole batch's."""
    seen: list[list[torch.Tensor]] = []
    apply = t.apply_gradients

    def recording() -> float:
        seen.append([p.grad.detach().clone() for p in t.model.parameters() if p.grad is not None])
        return apply()

    t.apply_gradients = recording  # type: ignore[method-assign]
    return seen


def test_a_step_in_parts_takes_the_whole_batch_step() -> None:
    """megatron-core's trainer takes an early step's batch in parts (``torch_trainer.StepInParts``) as it takes it
    whole: the same gradients at the optimizer step, to float precision. (Weights are compared after the torch
    trainer's steps; here Adam's first update, about lr * sign(g), turns the rounding of near-zero gradients of this
    tiny model into differences of up to 2% of a step.)"""
    config = lowered()
    config["optimizer"]["lr"] = 1e-2
    whole, parted = trainer(config), trainer(config)
    g_whole, g_parted = _gradients_at_the_optimizer_step(whole), _gradients_at_the_optimizer_step(parted)
    batch = _batch()
    for _ in range(2):
        expected = whole.train_step(batch)
        parted.train_part([s for s in batch if s.group_id == "0"])
        got = parted.train_step([s for s in batch if s.group_id == "1"])
        assert got.version == expected.version
        assert got.loss == pytest.approx(expected.loss, rel=1e-5)
        assert got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-4)
    first_whole, first_parted = g_whole[0], g_parted[0]  # the same weights before: the same gradients
    assert len(first_whole) == len(first_parted) > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(first_whole, first_parted, strict=True))
