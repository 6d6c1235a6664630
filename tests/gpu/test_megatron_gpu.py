"""The Megatron trainer on a GPU: bf16 weights, megatron-core's DDP and optimizer (fp32 main weights), and the
exported weights loaded into transformers' own model classes (where transformers is installed). MoE models run
here only: megatron-core's router needs CUDA.

The CPU half (the same model in fp32, an independent reference forward, packing, microbatches, restore) is
tests/unit/test_megatron_trainer.py, which runs everywhere megatron-core is installed.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

from test_megatron_trainer import (  # noqa: E402
    SEQS,
    SETTINGS,
    VOCAB,
    _batch,
    lowered,
    next_step_after_restore,
    randomize_biases,
    reference_logits,
    tiny_hf_config,
)

from dora.runtime.engines.megatron_trainer import (  # noqa: E402
    MegatronTrainer,
    MegatronTrainerConfig,
    build_gpt_model,
    hf_weights,
    packed_logits,
)
from dora.runtime.engines.torch_trainer import pack  # noqa: E402


def gpu_trainer(config: dict, **changes) -> MegatronTrainer:
    return MegatronTrainer(MegatronTrainerConfig(megatron=config, grpo=SETTINGS, device="cuda", seed=3), **changes)


def test_the_gpu_model_in_bf16_computes_what_the_cpu_model_computes_in_fp32() -> None:
    config = lowered()
    cpu = build_gpt_model(config, device="cpu", seed=5)
    gpu = build_gpt_model(config, device="cuda", seed=5)
    assert next(gpu.parameters()).dtype == torch.bfloat16
    packed = pack(list(SEQS), 16)
    with torch.no_grad():
        a = torch.log_softmax(packed_logits(cpu, packed).float(), -1)
        b = torch.log_softmax(packed_logits(gpu, packed).float().cpu(), -1)
    real = packed.segment_ids >= 0  # not the unfilled row tails, whose attention differs by design
    torch.testing.assert_close(b[real], a[real], rtol=0.0, atol=0.05)


def test_variable_length_flash_attention_computes_what_the_masked_attention_computes(monkeypatch) -> None:
    from dora.runtime.engines import megatron_trainer

    assert megatron_trainer._varlen_attention() is not None, "torch.nn.attention.varlen missing"
    gpu = build_gpt_model(lowered(), device="cuda", seed=6)
    packed = pack(list(SEQS), 16)
    with torch.no_grad():
        flash = torch.log_softmax(packed_logits(gpu, packed).float(), -1)
        monkeypatch.setattr(megatron_trainer, "_varlen_attention", lambda: None)
        masked = torch.log_softmax(packed_logits(gpu, packed).float(), -1)
    real = packed.segment_ids >= 0  # the unfilled row tails differ (masked: each attends to itself)
    torch.testing.assert_close(flash[real.cuda()], masked[real.cuda()], rtol=0.0, atol=0.03)


@pytest.mark.parametrize(("model_type", "tied"), [("qwen3", False), ("llama", True), ("qwen2", False)])
def test_transformers_loads_the_export_and_computes_the_same_logits(model_type: str, tied: bool) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers not installed (the reference model classes)")
    config = lowered(model_type, tied=tied)
    trainer = MegatronTrainer(MegatronTrainerConfig(megatron=config, grpo=SETTINGS, device="cpu", seed=7))
    randomize_biases(trainer.model)
    _, weights = trainer.export_weights()
    hf = tiny_hf_config(model_type, tied=tied)
    classes = {"qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "llama": ("LlamaForCausalLM", "LlamaConfig"),
               "qwen2": ("Qwen2ForCausalLM", "Qwen2Config")}
    cls, conf_cls = (getattr(transformers, name) for name in classes[model_type])
    extra = {} if model_type == "qwen2" else {"attention_bias": False}  # Qwen2 always has q/k/v biases
    model = cls(conf_cls(**{k: v for k, v in hf.items() if k != "model_type"}, **extra)).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in k or (tied and k == "lm_head.weight") for k in missing)
    for prompt, response in SEQS:
        ids = list(prompt + response)
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0]
            ours = packed_logits(trainer.model, pack([(prompt, response)], 64))[0, : len(ids)]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def fp32_moe(norm_topk: bool = True) -> dict:
    """The tiny Qwen3-MoE config with fp32 weights (an exact comparison; flash attention takes 16-bit only)."""
    config = lowered("qwen3_moe", norm_topk=norm_topk)
    config["model_parallel"].update(bf16=False, params_dtype="float32")
    return config


@pytest.mark.parametrize("norm_topk", [True, False])
def test_an_moe_model_computes_what_the_reference_computes_from_its_export(norm_topk: bool, monkeypatch) -> None:
    from dora.runtime.engines import megatron_trainer

    monkeypatch.setattr(megatron_trainer, "_varlen_attention", lambda: None)
    config = fp32_moe(norm_topk)
    assert config["transformer"]["moe_router_pre_softmax"] is not norm_topk
    model = build_gpt_model(config, device="cuda", seed=8)
    assert next(model.parameters()).dtype == torch.float32
    exported = hf_weights({k: v for k, v in model.state_dict().items() if "_extra_state" not in k}, config)
    hf = tiny_hf_config("qwen3_moe", norm_topk=norm_topk)
    packed = pack(list(SEQS), 16)
    with torch.no_grad():
        for prompt, response in SEQS:
            ids = list(prompt + response)
            ours = packed_logits(model, pack([(prompt, response)], 64))[0, : len(ids)].cpu()
            torch.testing.assert_close(ours, reference_logits(exported, hf, ids), rtol=1e-4, atol=1e-4)
        together = packed_logits(model, packed).reshape(-1, VOCAB)[packed.logit_index.cuda()]
        alone = torch.cat([packed_logits(model, pack([s], 16)).reshape(-1, VOCAB)[pack([s], 16).logit_index.cuda()]
                           for s in SEQS])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)  # routing is per token: packing changes nothing


def test_transformers_loads_the_moe_export_from_a_checkpoint_and_computes_the_same_logits(tmp_path, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers not installed (the reference model classes)")
    from safetensors.torch import save_file

    from dora.runtime.engines import megatron_trainer

    monkeypatch.setattr(megatron_trainer, "_varlen_attention", lambda: None)
    config = fp32_moe()
    model = build_gpt_model(config, device="cuda", seed=9)
    exported = hf_weights({k: v for k, v in model.state_dict().items() if "_extra_state" not in k}, config)
    save_file(exported, str(tmp_path / "model.safetensors"))
    hf = tiny_hf_config("qwen3_moe")
    transformers.Qwen3MoeConfig(**{k: v for k, v in hf.items() if k != "model_type"}).save_pretrained(tmp_path)
    theirs_model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, torch_dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for prompt, response in SEQS:
        ids = list(prompt + response)
        with torch.no_grad():
            theirs = theirs_model.eval()(torch.tensor([ids])).logits[0]
            ours = packed_logits(model, pack([(prompt, response)], 64))[0, : len(ids)].cpu()
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_grouped_experts_in_bf16_match_one_expert_after_another_in_fp32() -> None:
    """GroupedExperts' two grouped GEMMs (bf16 on a GPU), forward and weight gradients, against its per-expert
    path on an fp32 copy of the same weights."""
    import copy

    experts = build_gpt_model(lowered("qwen3_moe"), device="cuda", seed=5).decoder.layers[0].mlp.experts
    reference = copy.deepcopy(experts).float()
    counts = torch.tensor([24, 0, 40, 8, 0, 16, 32, 8], device="cuda")  # an expert may get no token
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(int(counts.sum()), 64, device="cuda", generator=gen)
    probs = torch.rand(int(counts.sum()), device="cuda", generator=gen)
    weights = torch.randn(int(counts.sum()), 64, device="cuda", generator=gen)
    out, _ = experts(hidden.bfloat16(), counts, probs)
    ref, _ = reference(hidden, counts, probs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.02)
    (out.float() * weights).sum().backward()
    (ref * weights).sum().backward()
    for name in ("weight1", "weight2"):
        ours, theirs = getattr(experts, name).grad.float(), getattr(reference, name).grad
        assert float((ours - theirs).norm() / theirs.norm()) < 0.02, name


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_megatron_optimizer_steps_raise_the_rewarded_responses(model_type: str) -> None:
    config = lowered(model_type)
    config["optimizer"]["lr"] = 1e-2
    t = gpu_trainer(config)
    batch = _batch()
    rewarded = pack([(s.trajectory.prompt_ids, s.trajectory.response_ids) for s in batch if s.reward], 64)
    with torch.no_grad():
        before = float(t.logprobs(rewarded).mean())
    metrics = [t.train_step(batch) for _ in range(5)]
    assert [m.version for m in metrics] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(m.loss) and m.grad_norm > 0 for m in metrics)
    with torch.no_grad():
        assert float(t.logprobs(rewarded).mean()) > before + 0.5
    version, weights = t.export_weights()
    assert version == 5 and all(w.device.type == "cpu" and w.dtype == torch.bfloat16 for w in weights.values())


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_a_restored_gpu_trainer_takes_the_same_next_step(model_type: str) -> None:
    config = lowered(model_type)
    config["optimizer"]["lr"] = 1e-3
    wa, wb = next_step_after_restore(gpu_trainer, config)
    for k in wa:
        torch.testing.assert_close(wa[k].float(), wb[k].float(), rtol=0, atol=1e-2)
