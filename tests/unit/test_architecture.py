"""Model catalog: derived sizes against published totals and hand computations; HF config parsing."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from planner.architecture import (
    DTYPE_BYTES,
    MLA,
    MODEL_PRESETS,
    HFConfigError,
    ModelArch,
    arch_from_hf_config,
    catalog_fingerprint,
    get_preset,
)

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
CONTRACT_KEYS = {"qwen2.5-7b", "qwen2.5-32b", "qwen3-8b", "qwen3-32b", "qwen3-235b-a22b", "deepseek-v3",
                 "longcat-flash", "tiny-local"}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_contract_presets_exist():
    assert CONTRACT_KEYS <= set(MODEL_PRESETS)
    assert DTYPE_BYTES == {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


# Published totals: model cards (Qwen2.5: 7.61B / 32.5B; Qwen3: 8.2B / 32.8B / 30.5B-A3.3B / 235B-A22B),
# DeepSeek-V3 report (671B / 37B), Kimi K2 card (1T / 32B).
@pytest.mark.parametrize(
    ("name", "total_b", "active_b", "rel"),
    [
        ("qwen2.5-7b", 7.61, 7.61, 0.01),
        ("qwen2.5-32b", 32.5, 32.5, 0.01),
        ("qwen3-8b", 8.2, 8.2, 0.01),
        ("qwen3-32b", 32.8, 32.8, 0.01),
        ("qwen3-30b-a3b", 30.5, 3.3, 0.02),
        ("qwen3-235b-a22b", 235.0, 22.0, 0.02),
        ("deepseek-v3", 671.0, 37.0, 0.02),
        ("kimi-k2", 1040.0, 32.0, 0.03),
    ],
)
def test_derived_params_match_published(name, total_b, active_b, rel):
    arch = get_preset(name)
    assert arch.total_params / 1e9 == pytest.approx(total_b, rel=rel)
    assert arch.active_params / 1e9 == pytest.approx(active_b, rel=rel)


def test_longcat_flash_dynamic_activation_range():
    # arXiv 2509.01322: 560B total, 18.6B-31.3B active (27B average).  The paper's activation count appears to
    # include a single V*h embedding matrix (our count includes input and output, +0.8B), hence 4-5%.
    arch = get_preset("longcat-flash")
    assert arch.total_params / 1e9 == pytest.approx(560, rel=0.01)
    assert arch.active_params_with(0) / 1e9 == pytest.approx(18.6, rel=0.05)
    assert arch.active_params_with(arch.experts_top_k) / 1e9 == pytest.approx(31.3, rel=0.03)
    assert arch.active_params / 1e9 == pytest.approx(27.0, rel=0.04)
    assert arch.expected_routed_experts_per_token == pytest.approx(8.0)  # 12 * 512 / 768


@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("qwen2.5-7b", 57_344),      # 28 * 2 * 4 * 128 * 2
        ("qwen3-8b", 147_456),       # 36 * 2 * 8 * 128 * 2
        ("qwen3-32b", 262_144),      # 64 * 2 * 8 * 128 * 2
        ("qwen3-235b-a22b", 192_512),  # 94 * 2 * 4 * 128 * 2
        ("deepseek-v3", 70_272),     # 61 * (512 + 64) * 2
        ("longcat-flash", 64_512),   # 28 * 2 * (512 + 64) * 2
    ],
)
def test_kv_bytes_per_token_hand_computed(name, kv_bytes):
    assert get_preset(name).kv_bytes_per_token(2) == kv_bytes


def test_kv_per_device_shards_gqa_heads_and_replicates_mla():
    qwen = get_preset("qwen3-235b-a22b")  # 4 KV heads
    assert qwen.kv_bytes_per_token_per_device(2, tp=2) == 192_512 / 2
    # tp=8 > 4 KV heads: each device still holds one head.
    assert qwen.kv_bytes_per_token_per_device(2, tp=8) == 192_512 / 4
    ds = get_preset("deepseek-v3")
    assert ds.kv_bytes_per_token_per_device(2, tp=8) == ds.kv_bytes_per_token(2)


def test_tiny_local_hand_count():
    tiny = get_preset("tiny-local")
    attn = 4 * 64 * 64            # q, k, v, o each 64 x 64
    ffn = 3 * 64 * 256
    norms = 2 * 64 * 2 + 64       # two per layer plus final
    embed = 192 * 64              # tied (vocab 192)
    assert tiny.total_params == 2 * (attn + ffn) + norms + embed == 143_680
    assert tiny.kv_bytes_per_token(4) == 2 * 2 * 4 * 16 * 4
    assert tiny.matmul_params_per_token == tiny.total_params  # tied: LM head is the only use of the table


def test_attention_flops_per_query_key():
    q8 = get_preset("qwen3-8b")
    assert q8.attention_flops_per_query_key() == 36 * 2 * 32 * (128 + 128)
    ds = get_preset("deepseek-v3")
    assert ds.attention_flops_per_query_key() == 61 * 2 * 128 * (192 + 128)
    assert ds.attention_flops_per_query_key(absorbed_mla=True) == 61 * (2 * 128 * 576 + 2 * 128 * 512)


def test_matmul_params_exclude_only_input_embedding():
    q8 = get_preset("qwen3-8b")
    assert q8.matmul_params_per_token == q8.total_params - 151936 * 4096


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-235b-a22b", "deepseek-v3", "qwen2.5-7b"])
def test_hf_config_gives_the_preset(name):
    assert arch_from_hf_config(_config(name), name=name) == get_preset(name)


def test_hf_llama_config_matches_published_8b():
    arch = arch_from_hf_config(_config("llama-3.1-8b"), name="llama-3.1-8b")
    assert arch.head_dim == 128 and not arch.qkv_bias and not arch.is_moe
    assert arch.total_params / 1e9 == pytest.approx(8.03, rel=0.01)  # Meta model card: 8.03B
    assert arch.kv_bytes_per_token(2) == 32 * 2 * 8 * 128 * 2


def test_hf_config_context_limit_follows_vllms_rope_scaling_rule():
    llama = _config("llama-3.1-8b")  # rope_type llama3: max_position_embeddings is already the scaled length
    assert arch_from_hf_config(llama, name="l").max_context_tokens == 131072
    yarn = {**_config("qwen3-8b"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768}}
    assert arch_from_hf_config(yarn, name="q").max_context_tokens == 131072  # Qwen3's documented YaRN setting
    linear = {**_config("qwen3-8b"), "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert arch_from_hf_config(linear, name="q").max_context_tokens == 81920
    bare = {k: v for k, v in _config("qwen3-8b").items() if k != "max_position_embeddings"}
    assert arch_from_hf_config(bare, name="q").max_context_tokens == 32768  # Qwen3Config's default, as vLLM reads it


def test_hf_config_rope_and_norm_fields():
    """Older configs' rope_scaling ``type``, transformers 5's ``rope_parameters`` (its rope_theta before the class
    default), and the class defaults when both are left out."""
    ds = arch_from_hf_config(_config("deepseek-v3"), name="d")
    assert dict(ds.rope_scaling)["rope_type"] == "yarn" and (ds.rope_theta, ds.norm_eps) == (1e4, 1e-6)
    v5 = {k: v for k, v in _config("qwen3-8b").items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                             "original_max_position_embeddings": 32768}
    arch = arch_from_hf_config(v5, name="q")
    assert arch.rope_theta == 1e6 and arch.max_context_tokens == 131072
    assert arch.rope_scaling == (("factor", 4.0), ("original_max_position_embeddings", 32768), ("rope_type", "yarn"))
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert arch_from_hf_config(v5, name="q").rope_scaling == ()
    bare = {k: v for k, v in _config("qwen3-8b").items() if k not in ("rope_theta", "rms_norm_eps")}
    arch = arch_from_hf_config(bare, name="q")
    assert (arch.rope_theta, arch.norm_eps) == (1e4, 1e-6)  # Qwen3Config's defaults (transformers 5.23)
    mixtral = {"model_type": "mixtral", "hidden_size": 1024, "num_attention_heads": 32, "num_hidden_layers": 4,
               "vocab_size": 1000, "num_local_experts": 8, "num_experts_per_tok": 2}
    arch = arch_from_hf_config(mixtral | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, name="m")
    assert (arch.rope_theta, arch.norm_eps) == (5e5, 1e-5)  # rope_parameters' theta, MixtralConfig's epsilon
    assert arch_from_hf_config(mixtral, name="m").rope_theta == 1e6  # MixtralConfig's default_theta
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    both = mixtral | {"rope_scaling": llama3, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert arch_from_hf_config(both, name="m").rope_theta == 5e5  # a rope_scaling beside it hid rope_parameters'
    for key, bad in (("rope_theta", "1e6"), ("rope_theta", 0), ("rms_norm_eps", True)):
        with pytest.raises(HFConfigError, match=key):
            arch_from_hf_config({**_config("qwen3-8b"), key: bad}, name="q")


def test_hf_config_errors_name_the_key():
    cfg = _config("qwen3-8b")
    del cfg["num_hidden_layers"]
    with pytest.raises(HFConfigError, match="num_hidden_layers") as info:
        arch_from_hf_config(cfg, name="x")
    assert info.value.key == "num_hidden_layers"
    assert isinstance(info.value, ValueError)

    bad = _config("qwen3-8b") | {"hidden_size": "4096"}
    with pytest.raises(HFConfigError, match="must be an integer") as info:
        arch_from_hf_config(bad, name="x")
    assert info.value.key == "hidden_size"

    with pytest.raises(HFConfigError, match="unsupported value 'gpt2'") as info:
        arch_from_hf_config({"model_type": "gpt2"}, name="x")
    assert info.value.key == "model_type"

    moe = _config("qwen3-235b-a22b") | {"mlp_only_layers": [0, 1]}
    with pytest.raises(HFConfigError) as info:
        arch_from_hf_config(moe, name="x")
    assert info.value.key == "mlp_only_layers"

    uneven = _config("qwen3-8b") | {"num_key_value_heads": 5}
    with pytest.raises(HFConfigError, match=r"'num_key_value_heads': must divide num_attention_heads \(32\) into "
                       r"equal query groups, got 5$") as info:  # the config's key, not the cost model's field
        arch_from_hf_config(uneven, name="x")
    assert info.value.key == "num_key_value_heads"

    # odd values a hand-edited config may hold: each names its key instead of failing inside the cost model
    for key, value, message in (("model_type", ["qwen3"], r"unsupported value \['qwen3'\]"),
                                ("vocab_size", 10**400, "must be at most 1099511627776"),
                                ("rope_scaling", {"rope_type": "yarn", "factor": 1e300,
                                                  "original_max_position_embeddings": 4096}, "scales the context past")):
        with pytest.raises(HFConfigError, match=message) as info:
            arch_from_hf_config(_config("qwen3-8b") | {key: value}, name="x")
        assert info.value.key == key
    with pytest.raises(HFConfigError, match="must be an integer, got \\[\\]") as info:  # was read as "no q LoRA"
        arch_from_hf_config(_config("deepseek-v3") | {"q_lora_rank": []}, name="x")
    assert info.value.key == "q_lora_rank"


@pytest.mark.parametrize(("rope_scaling", "key", "message"), [
    ({"rope_type": "llama3"}, "rope_scaling.factor", "is required for rope_type 'llama3'"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0},
     "rope_scaling.high_freq_factor", "is required"),
    ({"type": "linear"}, "rope_scaling.factor", "is required for rope_type 'linear'"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": "32k"},
     "rope_scaling.original_max_position_embeddings", "must be an integer, got '32k'"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0},
     "rope_scaling.original_max_position_embeddings", "must be in 1.."),
    ({"rope_type": "yarn", "factor": 4, "beta_fast": "fast"}, "rope_scaling.beta_fast", "must be a number > 0"),
    ({"rope_type": "yarn", "factor": "4"}, "rope_scaling.factor", "must be a number > 0, got '4'"),
    ({"rope_type": "yarn", "factor": 0}, "rope_scaling.factor", "must be a number > 0, got 0"),
    ({"rope_type": "yarn", "factor": 4, "mscale": -1}, "rope_scaling.mscale", "must be a number >= 0"),
    ({"rope_type": "llama3", "factor": 10**400, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0}, "rope_scaling.factor", "at most 1099511627776"),
    ({"rope_type": "yarn", "factor": 4, "truncate": "no"}, "rope_scaling.truncate", "must be true or false"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": "x"}, "rope_scaling.long_factor", "list"),
    ({"rope_type": 4}, "rope_scaling.rope_type", "must be a string"),
    ({"factor": 4.0}, "rope_scaling.rope_type", "is required but missing"),
    ("yarn", "rope_scaling", "must be an object"),
])
def test_hf_config_rope_scaling_fields_are_checked(rope_scaling, key, message):
    """A RoPE scaling vLLM or the Megatron lowering could not read is refused when config.json is read, naming the
    field, instead of failing later (a KeyError or int() error while writing the launch files)."""
    with pytest.raises(HFConfigError, match=message) as info:
        arch_from_hf_config(_config("qwen3-8b") | {"rope_scaling": rope_scaling}, name="x")
    assert info.value.key == key
    v5 = {k: v for k, v in _config("qwen3-8b").items() if k != "rope_scaling"}
    if isinstance(rope_scaling, dict):  # transformers 5's name for it, checked alike
        with pytest.raises(HFConfigError, match=message) as info:
            arch_from_hf_config(v5 | {"rope_parameters": {**rope_scaling, "rope_theta": 1e6}}, name="x")
        assert info.value.key == key.replace("rope_scaling", "rope_parameters")


def test_hf_config_rope_scaling_that_is_complete_passes():
    for scaling in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "default"}, {"rope_type": "mrope"},
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0, "truncate": False, "attention_factor": None},
                    {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2, 3], "factor": 4.0}):
        arch_from_hf_config(_config("qwen3-8b") | {"rope_scaling": scaling}, name="x")


def test_invalid_arch_is_rejected():
    with pytest.raises(ValueError, match="experts_top_k"):
        ModelArch(name="x", num_layers=1, hidden_size=8, num_attention_heads=2, num_kv_heads=2, head_dim=4,
                  ffn_hidden_size=0, vocab_size=8, num_experts=4, experts_top_k=5, moe_ffn_hidden_size=4)
    with pytest.raises(KeyError, match="valid names"):
        get_preset("gpt-5")


def test_mla_without_q_lora():
    # DeepSeek-V2-Lite style: q projected directly.  q = h*a*(nope+rope); kv_a = h*(r+rope) + r; kv_b; o.
    mla = MLA(q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    arch = ModelArch(name="x", num_layers=1, hidden_size=16, num_attention_heads=2, num_kv_heads=2, head_dim=6,
                     ffn_hidden_size=32, vocab_size=10, mla=mla)
    assert arch.attention_params == 16 * 2 * 6 + (16 * 10 + 8) + 8 * 2 * 8 + 2 * 4 * 16


def test_catalog_fingerprint_stable():
    assert catalog_fingerprint() == catalog_fingerprint()
    assert len(catalog_fingerprint()) == 16


def test_hf_config_router_fields():
    ds = _config("deepseek-v3")
    arch = arch_from_hf_config(ds, name="d")
    assert (arch.router_score, arch.router_scaling, arch.router_groups, arch.router_group_topk,
            arch.router_expert_bias, arch.router_normalizes_topk) == ("sigmoid", 2.5, 8, 4, True, True)
    v2 = {**ds, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
          "topk_method": "group_limited_greedy", "scoring_func": "softmax"}
    del v2["norm_topk_prob"]
    arch = arch_from_hf_config(v2, name="v2")
    assert (arch.router_normalizes_topk, arch.router_expert_bias, arch.router_groups) == (False, False, 8)
    assert arch_from_hf_config(_config("qwen3-235b-a22b"), name="q").router_normalizes_topk is True
    # null reads as absent: DeepseekV3Config's 2.5
    assert arch_from_hf_config({**ds, "routed_scaling_factor": None}, name="d").router_scaling == 2.5
    for key, bad in (("topk_group", 9), ("routed_scaling_factor", -1),
                     ("routed_scaling_factor", 0)):  # 0 was read as absent (1.0)
        with pytest.raises(HFConfigError, match=key):
            arch_from_hf_config({**ds, key: bad}, name="d")
    with pytest.raises(HFConfigError, match="scoring_func"):
        arch_from_hf_config({**v2, "scoring_func": "relu"}, name="v2")
    with pytest.raises(HFConfigError, match="n_group") as info:  # DeepseekV2Config leaves it null: no grouping
        arch_from_hf_config({k: v for k, v in v2.items() if k != "n_group"}, name="v2")
    assert info.value.key == "n_group"


def test_deepseek_v3_routes_with_a_sigmoid_and_the_expert_bias_whatever_its_config_says():
    """transformers' DeepseekV3TopkRouter (5.23) always scores with a sigmoid, adds e_score_correction_bias and routes
    within n_group groups: scoring_func and topk_method are not read."""
    ds = _config("deepseek-v3") | {"scoring_func": "softmax", "topk_method": "greedy"}
    arch = arch_from_hf_config(ds, name="d")
    assert (arch.router_score, arch.router_expert_bias, arch.router_groups, arch.router_group_topk) == (
        "sigmoid", True, 8, 4)


@pytest.mark.parametrize(("preset", "key", "bad", "says"), [
    ("deepseek-v3", "first_k_dense_replace", 62, "must be below num_hidden_layers (61): at least one layer is MoE"),
    ("deepseek-v3", "first_k_dense_replace", 61, "got 61"),  # as model.architecture refuses an MoE without MoE layers
    ("deepseek-v3", "num_experts_per_tok", 257, "must be at most n_routed_experts (256), got 257"),
    ("qwen3-235b-a22b", "num_experts_per_tok", 129, "must be at most num_experts (128), got 129"),
])
def test_moe_counts_out_of_range_name_their_config_key(preset: str, key: str, bad: int, says: str) -> None:
    """These used to surface as ModelArch's own check, blamed on `model_type` and worded in its field names."""
    with pytest.raises(HFConfigError) as caught:
        arch_from_hf_config({**_config(preset), key: bad}, name="x")
    assert caught.value.key == key and says in str(caught.value)


def test_hf_config_null_head_dim_and_kv_heads_are_derived_as_transformers_does():
    cfg = _config("llama-3.1-8b")
    derived = arch_from_hf_config(cfg | {"head_dim": None}, name="x")
    assert derived.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert arch_from_hf_config(cfg | {"num_key_value_heads": None}, name="x").num_kv_heads == cfg["num_attention_heads"]
    with pytest.raises(HFConfigError, match="is required but missing") as info:
        arch_from_hf_config(cfg | {"hidden_size": None}, name="x")
    assert info.value.key == "hidden_size"


@pytest.mark.parametrize(("config", "says"), [(_config("qwen3-8b"), "(not its default for qwen3, 32768) and vLLM"),
                                             ({"model_type": "qwen2_moe"}, "keeps the null and vLLM")])  # no default
def test_hf_config_null_context_is_refused_not_read_as_the_default(config: dict, says: str):
    """A null max_position_embeddings planned against transformers' default (32768 for qwen3), a context neither
    reader would hold --max-model-len to."""
    with pytest.raises(HFConfigError, match="is null: transformers keeps the null") as info:
        arch_from_hf_config(config | {"max_position_embeddings": None}, name="x")
    assert info.value.key == "max_position_embeddings" and says in info.value.reason


_MINIMAL = {"hidden_size": 1024, "num_attention_heads": 32, "num_hidden_layers": 5, "vocab_size": 1000}
_MLA_SHAPE = {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}


# What transformers 5.23 resolves for these minimal config.json files (AutoConfig.for_model, and the parameters of
# AutoModelForCausalLM.from_config on the meta device), as (num_kv_heads, head_dim, ffn_hidden_size,
# max_context_tokens, rope_theta, norm_eps, total_params). MLA types: head_dim is dora's d_nope + d_rope, and
# num_kv_heads the heads (MLA caches no KV heads; DeepseekV3Config says 128).
@pytest.mark.parametrize(("model_type", "keys", "expected"), [
    ("llama", {"intermediate_size": 512}, (32, 32, 512, 2048, 1e4, 1e-6, 30_895_104)),
    ("mistral", {"intermediate_size": 512, "sliding_window": None}, (8, 32, 512, 131072, 1e4, 1e-6, 23_030_784)),
    ("qwen2", {"intermediate_size": 512}, (32, 32, 512, 32768, 1e4, 1e-6, 30_910_464)),
    ("qwen3", {"intermediate_size": 512}, (32, 128, 512, 32768, 1e4, 1e-6, 93_810_944)),
    ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
     (4, 32, 6144, 32768, 1e4, 1e-6, 21_761_344)),
    ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2},
     (8, 32, 14336, 131072, 1e6, 1e-5, 1_776_815_104)),
    ("deepseek_v2", {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, **_MLA_SHAPE},
     (32, 48, 11008, 2048, 1e4, 1e-6, 37_907_264)),
    ("deepseek_v3", {"n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 64, **_MLA_SHAPE},
     (32, 48, 18432, 4096, 1e4, 1e-6, 204_622_656)),
])
def test_hf_config_absent_keys_take_transformers_defaults(model_type, keys, expected):
    """A key config.json leaves out is read as transformers' config class for its model_type gives it (vLLM and the
    trainer load the checkpoint so): dora used the heads for num_key_value_heads and head_dim, and "unknown" for the
    context, RoPE base and norm epsilon."""
    arch = arch_from_hf_config({"model_type": model_type, **_MINIMAL, **keys}, name="x")
    assert (arch.num_kv_heads, arch.head_dim, arch.ffn_hidden_size, arch.max_context_tokens, arch.rope_theta,
            arch.norm_eps, arch.total_params) == expected


def test_deepseek_v3_without_its_optional_keys_is_deepseek_v3():
    """DeepseekV3Config's defaults (transformers 5.23): q_lora_rank 1536, n_shared_experts 1, first_k_dense_replace 3,
    routed_scaling_factor 2.5, n_group 8, topk_group 4. Without them dora counted 708.9B parameters, not 671B."""
    keep = ("model_type", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
            "moe_intermediate_size", "vocab_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "norm_topk_prob", "max_position_embeddings",
            "rope_theta", "rms_norm_eps", "rope_scaling")
    bare = {k: v for k, v in _config("deepseek-v3").items() if k in keep}
    assert arch_from_hf_config(bare, name="deepseek-v3") == get_preset("deepseek-v3")
    assert round(get_preset("deepseek-v3").total_params / 1e9, 1) == 671.0


def test_hf_config_defaults_a_model_cannot_run_with_name_the_key_and_the_default():
    """Mistral's absent sliding_window is MistralConfig's 4096 (refused, as an explicit 4096 is); DeepSeek-V3's absent
    first_k_dense_replace is 3, more than a 3-layer model has; Kimi K2 has no transformers class to default its
    routing keys."""
    mistral = {"model_type": "mistral", **_MINIMAL, "intermediate_size": 512}
    with pytest.raises(HFConfigError, match="4096-token sliding-window .* transformers' default for mistral, 4096") \
            as info:
        arch_from_hf_config(mistral, name="m")
    assert info.value.key == "sliding_window"
    ds = {"model_type": "deepseek_v3", **_MINIMAL, "num_hidden_layers": 3, "n_routed_experts": 16,
          "num_experts_per_tok": 2, "moe_intermediate_size": 64, **_MLA_SHAPE}
    with pytest.raises(HFConfigError, match="must be below num_hidden_layers .* default for deepseek_v3, 3") as info:
        arch_from_hf_config(ds, name="d")
    assert info.value.key == "first_k_dense_replace"
    assert arch_from_hf_config(ds | {"first_k_dense_replace": 1}, name="d").first_dense_layers == 1
    kimi = {k: v for k, v in _config("deepseek-v3").items() if k != "n_shared_experts"} | {"model_type": "kimi_k2"}
    with pytest.raises(HFConfigError, match="is required for model_type 'kimi_k2'") as info:
        arch_from_hf_config(kimi, name="k")
    assert info.value.key == "n_shared_experts"
    mixtral = {"model_type": "mixtral", **_MINIMAL, "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(HFConfigError, match="must be >= 1") as info:  # was blamed on model_type
        arch_from_hf_config(mixtral | {"intermediate_size": 0}, name="m")
    assert info.value.key == "intermediate_size"


def test_weight_tensors_count_the_routers_expert_bias():
    """A tiny DeepSeek-V3 (5 layers, 2 dense, 8 experts + 1 shared): transformers 5.23's DeepseekV3ForCausalLM has 141
    tensors once its fused experts are counted per expert, as the checkpoint names them; 3 are the MoE layers'
    e_score_correction_bias, which a weight reload also iterates over."""
    cfg = {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 5,
           "intermediate_size": 96, "moe_intermediate_size": 32, "vocab_size": 128, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 2, "q_lora_rank": 16,
           "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_group": 2,
           "topk_group": 1}
    arch = arch_from_hf_config(cfg, name="tiny-dsv3")
    assert arch.num_moe_layers == 3 and arch.num_weight_tensors == 141
    assert dataclasses.replace(arch, router_expert_bias=False).num_weight_tensors == 138


def test_hf_config_with_sliding_window_attention_is_refused():
    """Mistral-7B-v0.1 attends within 4096 tokens; the cost model and the Megatron lowering assume full attention,
    so the trainer would compute other log-probs than vLLM past the window. Qwen's switch off (or a window as long
    as the context) is full attention."""
    mistral = _config("llama-3.1-8b") | {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                         "sliding_window": 4096, "rope_scaling": None, "max_position_embeddings": 32768}
    with pytest.raises(HFConfigError, match="4096-token sliding-window attention is not supported") as info:
        arch_from_hf_config(mistral, name="m")
    assert info.value.key == "sliding_window"
    assert arch_from_hf_config(mistral | {"sliding_window": None}, name="m").num_layers == 32
    assert arch_from_hf_config(mistral | {"sliding_window": 32768}, name="m").num_layers == 32
    qwen = _config("qwen2.5-7b")
    assert (qwen["use_sliding_window"], qwen["sliding_window"]) == (False, 131072)
    arch_from_hf_config(qwen, name="q")
    with pytest.raises(HFConfigError, match="sliding-window"):
        arch_from_hf_config(qwen | {"use_sliding_window": True, "sliding_window": 4096}, name="q")
    with pytest.raises(HFConfigError, match="sliding-window"):
        arch_from_hf_config(_config("qwen3-8b") | {"use_sliding_window": True, "sliding_window": 4096}, name="q")


def test_longcat_routes_as_its_checkpoint_does():
    """transformers' LongcatFlashTopkRouter: top-k over softmax scores plus e_score_correction_bias, the weights not
    renormalised (it deletes norm_topk_prob); its context is max_position_embeddings 131072."""
    arch = get_preset("longcat-flash")
    assert (arch.router_score, arch.router_normalizes_topk, arch.router_expert_bias, arch.router_scaling) == (
        "softmax", False, True, 6.0)
    assert arch.max_context_tokens == 131072


_LITE_V3 = {"model_type": "deepseek_v3", **_MINIMAL, "n_routed_experts": 64, "num_experts_per_tok": 6,
            "moe_intermediate_size": 64, **_MLA_SHAPE}


@pytest.mark.parametrize(("base", "change", "key", "says"), [
    # a model other than the one the cost model prices and the Megatron lowering writes (--swiglu, no MLP biases)
    ("llama-3.1-8b", {"hidden_act": "gelu"}, "hidden_act", "must be silu"),
    ("llama-3.1-8b", {"mlp_bias": True}, "mlp_bias", "must be false"),
    # vLLM picks the model's code by the class, dora by model_type
    ("qwen3-8b", {"architectures": ["Qwen3MoeForCausalLM"]}, "architectures", "Qwen3MoeForCausalLM is a qwen3_moe"),
    ("qwen3-8b", {"architectures": "Qwen3ForCausalLM"}, "architectures", "must be a list of class names"),
    # RoPE rotates pairs of dimensions
    ("qwen3-8b", {"head_dim": 127}, "head_dim", "must be even"),
    (None, {**_LITE_V3, "qk_rope_head_dim": 15}, "qk_rope_head_dim", "must be even"),
    # scores reshape to [tokens, n_group, experts / n_group]
    (None, {**_LITE_V3, "n_group": 7, "topk_group": 4}, "n_group", "must divide n_routed_experts (64)"),
    (None, {**_LITE_V3, "n_group": 32, "topk_group": 1}, "num_experts_per_tok", "at most the 2 experts"),
    # transformers reads a non-empty string as true: the window would apply
    ("qwen3-235b-a22b", {"use_sliding_window": "true", "sliding_window": 4096}, "use_sliding_window",
     "must be true or false"),
    # two RoPE sources that disagree: readers differ on which one applies
    ("qwen3-8b", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                  "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_parameters", "scales RoPE differently from rope_scaling"),
    ("qwen3-8b", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                  "rope_parameters": {"rope_type": "yarn", "factor": -4.0}}, "rope_parameters.factor", "must be a number"),
    ("qwen3-8b", {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "rope_theta",
     "several RoPE bases"),
])
def test_hf_config_that_would_run_another_model_is_refused(base, change, key, says):
    """Keys that change the model were read past or resolved silently (a fuzzing pass): a GELU MLP planned and
    lowered as SwiGLU, a qwen3_moe class planned as dense, groups that do not divide the experts, a string switching
    a sliding window on, a second RoPE scaling never checked."""
    config = (_config(base) if base else {}) | change
    with pytest.raises(HFConfigError, match=re.escape(says)) as info:
        arch_from_hf_config(config, name="x")
    assert info.value.key == key


def test_hf_config_rope_sources_that_agree_are_accepted():
    """rope_scaling and rope_parameters with the same scaling, or a default-type rope_parameters carrying the base
    only beside a rope_scaling, are one RoPE: accepted."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    config = {k: v for k, v in _config("qwen3-8b").items() if k != "rope_theta"}
    arch = arch_from_hf_config(config | {"rope_scaling": yarn, "rope_parameters": {**yarn, "rope_theta": 1e6}}, name="q")
    assert dict(arch.rope_scaling)["rope_type"] == "yarn" and arch.rope_theta == 1e6
    assert arch_from_hf_config(config | {"rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e6}},
                               name="q").rope_theta == 1e6
    assert arch_from_hf_config(_config("qwen3-235b-a22b") | {"use_sliding_window": False}, name="q").num_experts == 128
