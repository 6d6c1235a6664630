"""The spec language: strict, frozen pydantic models of a dora YAML spec.

Each field is documented by the docstring right below it (exported to JSON Schema for editors). Units are in
field names. Cross-field and cross-section rules that need the resolved model architecture live in
``dora.spec.checks`` so that every problem is reported at once, each at its own YAML path.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

# Catalog keys are repeated here (not imported) so that the JSON Schema lists them as an enum; a unit test
# checks they equal planner.hardware.ACCELERATORS / planner.architecture.MODEL_PRESETS.
AcceleratorName = Literal["h100", "h800", "h20", "h200", "a100-80g", "b200", "mi300x", "cpu"]
ModelPresetName = Literal[
    "qwen2.5-7b", "qwen2.5-32b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
    "kimi-k2", "longcat-flash", "tiny-local",
]
Mode = Literal["sync", "one-step-off", "bounded-async", "partial-rollout", "streaming"]
ALL_MODES: tuple[Mode, ...] = ("sync", "one-step-off", "bounded-async", "partial-rollout", "streaming")

# Upper bounds. Every numeric field has one, so that no product of fields (a step's tokens, its time, the job's cost)
# overflows a float, and a typo of a few extra digits is reported at its field instead of planning an absurd job.
# The planner-side limits are repeated here (not imported); a unit test checks they agree.
MAX_VERSION_LAG = 64
"""Largest staleness budget a spec may set."""
MAX_ACCELERATORS = 1 << 17
"""Largest cluster (nodes x accelerators per node), 131,072, and so largest pinned size:
planner.search.core.MAX_ACCELERATORS."""
MAX_BATCH_SAMPLES = 1_000_000
"""Largest batch (prompts x samples per step): planner.search.core.MAX_BATCH_SAMPLES."""
MAX_STEPS = 1_000_000
"""Most training (or warm-up) steps a spec may ask for; RL post-training runs take hundreds to a few thousand."""
MAX_TOKENS = 1 << 24
"""Longest prompt or response length, 16,777,216 tokens: above any released model's context (Llama 4 Scout's
10,485,760)."""
MAX_PPO_EPOCHS = 100
"""Most passes over one batch (PPO uses 1-4)."""
MAX_PRICE_USD = 10_000.0
"""Highest price of one accelerator-hour, USD (cloud GPUs rent for about 1-10)."""
MAX_ARCH_INT = 1 << 40
"""Largest architecture size (layers, widths, heads, experts, vocabulary): the bound config.json fields have
(planner.architecture.HF_INT_MAX)."""
MAX_ROPE_THETA = 1e12
"""Largest RoPE base (planner.architecture.MAX_ROPE_THETA, which config.json's rope_theta has too)."""
MAX_NORM_EPS = 1.0
"""Largest RMSNorm epsilon (planner.architecture.MAX_NORM_EPS, which config.json's rms_norm_eps has too)."""
ArchInt = Annotated[int, Field(gt=0, le=MAX_ARCH_INT)]
"""A positive architecture size, at most MAX_ARCH_INT."""
ArchCount = Annotated[int, Field(ge=0, le=MAX_ARCH_INT)]
"""A non-negative architecture count, at most MAX_ARCH_INT."""
Tokens = Annotated[int, Field(gt=0, le=MAX_TOKENS)]
"""A length in tokens, 1..MAX_TOKENS."""
ClusterSize = Annotated[int, Field(gt=0, le=MAX_ACCELERATORS)]
"""A number of nodes or accelerators (or a parallel size), 1..MAX_ACCELERATORS."""
BatchSize = Annotated[int, Field(gt=0, le=MAX_BATCH_SAMPLES)]
"""A number of prompts, samples or sequences per step, 1..MAX_BATCH_SAMPLES."""
Bandwidth = Annotated[float, Field(ge=0.001, le=1e6)]
MAX_HOST_MEMORY_GIB = 1 << 20
"""1 PiB of host memory per node: far above any server's (today's largest take tens of TiB)."""
HostMemory = Annotated[float, Field(ge=1, le=MAX_HOST_MEMORY_GIB)]
"""GB/s: from 1 MB/s (below it no plan is meaningful, and the cost model's arithmetic overflows) to 1 PB/s."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


# ----------------------------------------------------------------------------------------------- model
class MLASpec(StrictModel):
    """Multi-head latent attention ranks (DeepSeek-V3 style)."""

    q_lora_rank: ArchInt | None = None
    """Rank of the query down-projection; null for a full-rank query projection."""
    kv_lora_rank: ArchInt
    """Rank of the compressed KV latent that is cached (512 in DeepSeek-V3)."""
    qk_nope_head_dim: ArchInt
    """Per-head query/key dimension without rotary embedding."""
    qk_rope_head_dim: ArchInt
    """Per-head query/key dimension with rotary embedding (shared key part is cached)."""
    v_head_dim: ArchInt
    """Per-head value dimension."""


class ArchitectureSpec(StrictModel):
    """Explicit transformer architecture (instead of a preset or a Hugging Face config.json). Sizes and counts are
    at most 2**40, as in a config.json."""

    num_layers: ArchInt
    """Number of transformer layers."""
    hidden_size: ArchInt
    """Model (residual stream) width."""
    num_attention_heads: ArchInt
    """Attention (query) heads."""
    num_kv_heads: ArchInt | None = None
    """Key/value heads (GQA); defaults to num_attention_heads (MHA)."""
    head_dim: ArchInt | None = None
    """Per-head dimension; defaults to hidden_size / num_attention_heads."""
    ffn_hidden_size: ArchInt
    """Intermediate size of the dense (SwiGLU) feed-forward block."""
    vocab_size: ArchInt
    """Vocabulary size."""
    tie_embeddings: bool = False
    """Whether the output head shares the input embedding matrix."""
    qkv_bias: bool = False
    """Whether the QKV projections have biases (Qwen2.5)."""
    qk_norm: bool = False
    """Whether q and k get a per-head RMSNorm before attention (Qwen3)."""
    rope_theta: Annotated[float, Field(gt=0, le=MAX_ROPE_THETA)] | None = None
    """RoPE base frequency (config.json `rope_theta`, e.g. 1000000 for Qwen2.5/Qwen3). The planner does not need
    it; the Megatron config does (`rotary_base`): unset, megatron-core's default 10000 applies and the launch notes
    say so. At most 1e12 (released models use 1e4 to 1e7)."""
    norm_eps: Annotated[float, Field(gt=0, le=MAX_NORM_EPS)] | None = None
    """RMSNorm epsilon (config.json `rms_norm_eps`). Like rope_theta, only the Megatron config uses it
    (`layernorm_epsilon`; unset: megatron-core's 1e-5). At most 1."""
    num_experts: ArchCount = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_top_k: ArchCount = 0
    """Routed experts activated per token."""
    num_shared_experts: ArchCount = 0
    """Always-active shared experts per MoE layer."""
    moe_ffn_hidden_size: ArchCount = 0
    """Intermediate size of one expert."""
    first_dense_layers: ArchCount = 0
    """Leading layers that use the dense FFN in an MoE model (DeepSeek `first_k_dense_replace`)."""
    mla: MLASpec | None = None
    """Multi-head latent attention ranks; null for standard (GQA) attention."""


class ModelSpec(StrictModel):
    """The policy model: exactly one of `preset`, `hf_config` or `architecture`."""

    preset: ModelPresetName | None = None
    """A model from dora's catalog (`dora schema` lists them)."""
    hf_config: str | None = None
    """Path (relative to the spec file) to a Hugging Face config.json (Llama/Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3)."""
    architecture: ArchitectureSpec | None = None
    """Explicit architecture fields."""
    checkpoint: str | None = None
    """Weights the launch artifacts load: a Hugging Face model id or a path on the cluster. Not read by the planner."""
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    """Weight and activation dtype for rollout and training."""


# --------------------------------------------------------------------------------------------- cluster
class ClusterSpec(StrictModel):
    """The accelerators the job may use."""

    accelerator: AcceleratorName
    """Accelerator type from the hardware catalog (`cpu` = one CPU core, for the local default)."""
    nodes: ClusterSize
    """Number of nodes (with accelerators_per_node, at most 131,072 accelerators)."""
    accelerators_per_node: ClusterSize
    """Accelerators per node (GPUs; CPU cores for `cpu`)."""
    scale_up_bandwidth_gb_per_s: Bandwidth | None = None
    """Override the catalog's intra-node (NVLink) bandwidth per accelerator, GB/s one direction."""
    scale_out_bandwidth_gb_per_s: Bandwidth | None = None
    """Override the catalog's inter-node (NIC) bandwidth per accelerator, GB/s one direction."""
    host_memory_gib_per_node: HostMemory | None = None
    """Override the catalog's host memory (DRAM) per node, GiB (a server sold as "2 TB" has 2048). Colocated plans
    park the trainer's state there while the engines roll out, and the engines' weights and KV cache while the
    trainer trains."""
    price_per_accelerator_hour_usd: Annotated[float, Field(ge=0, le=MAX_PRICE_USD)] | None = None
    """Price of one accelerator-hour, to report cost (USD, at most 10,000)."""


# -------------------------------------------------------------------------------------------- workload
class LengthSpec(StrictModel):
    """A token-length distribution: lognormal (`median_tokens` + `p99_tokens`) or an empirical histogram file."""

    median_tokens: Tokens | None = None
    """Median length in tokens (lognormal)."""
    p99_tokens: Tokens | None = None
    """99th-percentile length in tokens (lognormal); must be >= median_tokens."""
    histogram_file: str | None = None
    """CSV of observed lengths, relative to the spec file: rows `length,count` (header and # comments allowed)."""
    max_tokens: Tokens
    """Hard cap: longer samples are truncated here (the generation limit). Every length is at most 16,777,216
    tokens."""
    min_tokens: Tokens = 1
    """Lower bound on a sampled length."""


class TaskSpec(StrictModel):
    """The verifiable task the embedded local runtime trains on."""

    name: Literal["count"] = "count"
    """Task name: `count` — count from a to b. The answer, the numbers a..b and EOS, is L = b - a + 2 tokens long; L is
    drawn from response_length (raised to 2, one number and EOS, and capped at max_tokens), once per prompt, so every
    sample of a prompt group has the same length (the planner simulates it so). Prompts are always 4 tokens
    ([BOS, a, b, SEP]): prompt_length must say so."""
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 500
    """Supervised warm-up steps from random init before RL (cached in the output directory); at most 1,000,000."""


class WorkloadSpec(StrictModel):
    """What one training step consumes, and for how many steps."""

    prompts_per_step: BatchSize
    """Prompt groups per training step (the batch). With samples_per_prompt, at most 1,000,000 trajectories per step
    (the planner simulates each candidate's steps)."""
    samples_per_prompt: BatchSize = 8
    """Responses sampled per prompt (the GRPO group size)."""
    prompt_length: LengthSpec
    """Prompt length distribution."""
    response_length: LengthSpec
    """Response length distribution; its long tail is what asynchronous modes hide."""
    steps: Annotated[int, Field(gt=0, le=MAX_STEPS)]
    """Training steps (policy versions produced), at most 1,000,000."""
    task: TaskSpec | None = None
    """The local task (only for the embedded CPU runtime)."""


# ------------------------------------------------------------------------------------------- algorithm
class AlgorithmSpec(StrictModel):
    """The RL algorithm."""

    name: Literal["grpo", "ppo"] = "grpo"
    """Policy-gradient family: `grpo` (group-normalised advantages, no critic) or `ppo` (with a critic)."""
    ppo_epochs: Annotated[int, Field(gt=0, le=MAX_PPO_EPOCHS)] = 1
    """Passes over each batch (at most 100)."""
    minibatches_per_step: BatchSize = 1
    """Optimizer steps per batch and epoch (at most 1,000,000)."""
    off_policy_correction: Literal["none", "tis", "decoupled-ppo"] = "tis"
    """Correction for stale samples using the recorded behaviour log-probs."""
    tis_cap: Annotated[float, Field(gt=0, le=1000)] = 2.0
    """Truncation cap C of the importance weight (tis); at most 1000."""
    clip_ratio: Annotated[float, Field(gt=0, le=10)] = 0.2
    """PPO clip epsilon; at most 10."""
    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-6
    """AdamW learning rate; at most 1."""
    kl_coef: Annotated[float, Field(ge=0, le=100)] = 0.0
    """KL penalty to the reference model; > 0 adds a reference forward pass per step. At most 100."""
    temperature: Annotated[float, Field(gt=0, le=100)] = 1.0
    """Sampling temperature for rollout; at most 100."""


class StalenessSpec(StrictModel):
    """How stale a trajectory may be, and which asynchronous modes the planner may choose."""

    max_version_lag: Annotated[int, Field(ge=0, le=MAX_VERSION_LAG)] = 1
    """Staleness budget k: a sample from version v trains the step producing v' only if v' - v - 1 <= k (at most 64:
    the planner weighs every k up to the budget, and systems run k of 1 to about 8)."""
    mode: Literal["auto", "sync", "one-step-off", "bounded-async", "partial-rollout", "streaming"] = "auto"
    """`auto` lets the planner pick among the modes that keep the constraints; or pin one."""
    allow_version_mixing: bool = False
    """Allow one trajectory to span several policy versions (needed by partial-rollout)."""


# ------------------------------------------------------------------------------------------- placement
class RolloutPlacement(StrictModel):
    """Pinned rollout side; unset fields are searched."""

    accelerators: ClusterSize | None = None
    """Accelerators for rollout."""
    tp: ClusterSize | None = None
    """Tensor-parallel size of one engine replica."""
    ep: ClusterSize | None = None
    """Expert-parallel size of one engine replica (MoE)."""
    versions_per_engine: Annotated[int, Field(gt=0, le=MAX_VERSION_LAG + 1)] | None = None
    """Policy versions one engine replica may hold at once (1 on GPUs; at most k + 1)."""
    max_num_seqs: BatchSize | None = None
    """The most sequences one engine replica runs at once (vLLM's ``max_num_seqs``; each attention data-parallel rank's
    of a replica that has several), fewer where its KV cache holds fewer. Unset: 256 on GPUs (vLLM's default), 64 on
    the `cpu` accelerator. Fewer slots than the rollout could fill
    keep a trainer-bound run's staleness down and its slots busy."""
    consolidation_batch: BatchSize | None = None
    """Streaming: the most sequences an engine takes in when an older version's requests are packed onto fewer
    engines (freeing engines for the newest version). Unset: the engine's batching knee, where per-sequence decode
    costs equal the fixed ones. A value at or above the engine's sequence slots packs engines full (DORA's paper)."""


class TrainPlacement(StrictModel):
    """Pinned training side; unset fields are searched."""

    accelerators: ClusterSize | None = None
    """Accelerators for training."""
    tp: ClusterSize | None = None
    """Tensor-parallel size."""
    pp: ClusterSize | None = None
    """Pipeline-parallel size."""
    ep: ClusterSize | None = None
    """Expert-parallel size (MoE)."""
    dp: ClusterSize | None = None
    """Data-parallel size."""
    cp: ClusterSize | None = None
    """Context-parallel size (long responses)."""


class PinnedPlacement(StrictModel):
    """A (partially) pinned placement."""

    colocated: bool | None = None
    """true: rollout and training time-share all accelerators; false: disjoint sets; null: search both."""
    rollout: RolloutPlacement = RolloutPlacement()
    """Rollout side."""
    train: TrainPlacement = TrainPlacement()
    """Training side."""


def _placement_tag(value: object) -> str:
    return "auto" if isinstance(value, str) else "pinned"


Placement = Annotated[
    Annotated[Literal["auto"], Tag("auto")] | Annotated[PinnedPlacement, Tag("pinned")],
    Discriminator(_placement_tag),
]
UNION_TAGS = frozenset({"auto", "pinned"})


# --------------------------------------------------------------------------------------------- runtime
class RuntimeSpec(StrictModel):
    """Where and with which engines `dora apply` runs the plan."""

    backend: Literal["local", "ray-cluster"] = "local"
    """`local`: start a Ray instance on this machine; `ray-cluster`: submit to `address`."""
    address: str | None = None
    """Ray dashboard address for `ray-cluster`, e.g. http://head:8265."""
    rollout_engine: Literal["torch", "vllm"] = "vllm"
    """Rollout engine: `torch` (CPU, embedded) or `vllm` (GPU)."""
    trainer: Literal["torch", "megatron"] = "megatron"
    """Trainer: `torch` (CPU, embedded) or `megatron` (megatron-core, GPU). On the cpu accelerator `megatron` is a
    rehearsal of the Megatron path: megatron-core trains the lowered config in fp32 beside the torch engines."""
    output_dir: str | None = None
    """Where runs write traces, metrics and checkpoints; defaults to runs/<slug of the name>: lower-case ASCII letters
    and digits, every other run of characters one '-', at most 48 characters (qwen2.5-32b... -> runs/qwen2-5-32b...)."""
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] = 0
    """Seed for data order, sampling and the simulator (an unsigned 64-bit integer, as torch takes it)."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Fraction of accelerator memory a rollout engine may use (vLLM's gpu_memory_utilization)."""


class Spec(StrictModel):
    """A dora spec: the model, the cluster, the workload and the staleness budget of an RL post-training job."""

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"\S")]
    """Job name (free text with at least one visible character; sanitised wherever it becomes an identifier)."""
    model: ModelSpec
    """The policy model."""
    cluster: ClusterSpec
    """The accelerators."""
    workload: WorkloadSpec
    """Batch, lengths and steps."""
    algorithm: AlgorithmSpec = AlgorithmSpec()
    """The RL algorithm."""
    staleness: StalenessSpec = StalenessSpec()
    """Staleness budget and mode."""
    placement: Placement = "auto"
    """`auto`, or pinned fields that restrict the planner's search."""
    runtime: RuntimeSpec = RuntimeSpec()
    """Engines and backend for `dora apply`."""
    objective: Literal["throughput", "cost", "time"] = "throughput"
    """What the planner ranks plans by: `throughput`, trained tokens/s in the steady state; `time`, the time to finish
    all steps (the first, while the pipeline fills, included); `cost`, dollars per sample, which ranks as `time`:
    every accelerator of the cluster is paid for the whole run."""

    @property
    def total_accelerators(self) -> int:
        return self.cluster.nodes * self.cluster.accelerators_per_node
