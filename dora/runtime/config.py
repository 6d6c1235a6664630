"""The runtime config: everything `dora apply` (the runtime driver) reads from `launch/runtime.json`.

Lowering writes it (``dora.lower``); the driver reads it. It is pure Python on purpose — importing it must
not pull torch or ray — so the CLI, the lowering and the tests can use it anywhere. Field names mirror the spec's
(``dora.spec.models``) where a spec field exists, and the architecture fields mirror
``planner.architecture.ModelArch``.

``to_json`` is deterministic (sorted keys, fixed indentation, a trailing newline). ``from_json`` is strict: an
unknown or missing field, a value of the wrong type, or one out of its range (a count of 0, a negative rate)
raises ``RuntimeConfigError`` naming the dotted path of the field (``algorithm.tis_cap``), so a hand-edited or
stale file fails before any actor starts. (Whether the scheduling values fit together, e.g. a prompt group on one
engine, is the scheduling policy's check: the driver makes it before Ray starts.)
"""

from __future__ import annotations

import json
import math
import types
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from dora.runtime.vllm_cpu import VLLM_CPU_HEAD_DIMS, VLLM_INSTALL
from dora.spec.files import loads_json

FORMAT_VERSION = 4
"""Bump on a change an older driver could not read correctly (4: ``megatron``)."""


GPU_ENGINES_MISSING = (
    "dora's runtime runs its engines on the cpu accelerator only, so far: its torch engines, or vLLM's CPU backend "
    "(runtime.rollout_engine: vllm), with its torch trainer or, as a rehearsal of the Megatron path, runtime.trainer: "
    "megatron; runs on GPUs are not implemented yet. `dora plan SPEC --out DIR` still writes the launch arguments "
    "(DIR/launch/vllm/, DIR/launch/megatron/) for a launcher of your own (`dora examples local-tiny` is a CPU run)")
"""Why a run on GPUs stops before any actor starts."""


def check_engines(rc: RuntimeConfig) -> None:
    """Raise RuntimeConfigError unless ``rc`` runs engines the runtime has: on the cpu accelerator, torch rollout
    engines or vLLM's CPU backend (installed, one version per engine, a head size its kernels take), and the torch
    trainer or (megatron-core installed, the lowered config in ``rc.megatron``) the Megatron trainer."""
    if rc.accelerator != "cpu":
        raise RuntimeConfigError("accelerator", f"cluster.accelerator {rc.accelerator!r}: {GPU_ENGINES_MISSING}")
    if rc.rollout_engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise RuntimeConfigError("rollout_engine", f"runtime.rollout_engine 'vllm' needs vLLM: {VLLM_INSTALL}")
        if rc.model.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise RuntimeConfigError("model.head_dim", f"vLLM's CPU attention takes head_dim in {VLLM_CPU_HEAD_DIMS}, "
                                     f"the model has {rc.model.head_dim}")
        if rc.versions_per_engine != 1:
            raise RuntimeConfigError("versions_per_engine", f"a vLLM engine hosts one version, the plan puts "
                                     f"{rc.versions_per_engine} on each; re-run `dora plan`")
    if rc.trainer == "megatron":
        if rc.megatron is None:
            raise RuntimeConfigError("megatron", "runtime.trainer 'megatron' needs the lowered Megatron config; "
                                     "re-run `dora plan --out`")
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            raise RuntimeConfigError("trainer", "runtime.trainer 'megatron' needs megatron-core: "
                                     "pip install megatron-core==0.16.1 (the dev extra has it)") from None


class RuntimeConfigError(ValueError):
    """`runtime.json` is malformed; ``field`` is the dotted path of the offending field ('' = the document)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"runtime config: field '{field}': {message}" if field else f"runtime config: {message}")
        self.field = field


@dataclass(frozen=True, kw_only=True)
class LengthConfig:
    """A token-length distribution (mirrors the spec's LengthSpec, with a histogram's rows inlined)."""

    kind: Literal["lognormal", "empirical"]
    max_tokens: int
    """Hard cap (the generation limit for responses)."""
    min_tokens: int
    median_tokens: int | None
    """Lognormal only."""
    p99_tokens: int | None
    """Lognormal only."""
    histogram: tuple[tuple[int, int], ...] | None
    """Empirical only: ``(length_tokens, count)`` rows, ascending lengths, already clamped to the caps."""


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The verifiable task of the embedded CPU runtime (mirrors TaskSpec)."""

    name: Literal["count"]
    warmup_steps: int


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """All fields of the spec's AlgorithmSpec."""

    name: Literal["grpo", "ppo"]
    ppo_epochs: int
    minibatches_per_step: int
    off_policy_correction: Literal["none", "tis", "decoupled-ppo"]
    tis_cap: float
    clip_ratio: float
    learning_rate: float
    kl_coef: float
    temperature: float


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention ranks (planner.architecture.MLA)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy model: the architecture fields of planner.architecture.ModelArch (but its RoPE scaling and MoE
    routing, which only the Megatron config carries), dtype and checkpoint."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int
    experts_top_k: int
    num_shared_experts: int
    moe_ffn_hidden_size: int
    first_dense_layers: int
    mla: MLAConfig | None
    num_zero_experts: int
    attention_per_layer: int
    dense_ffns_per_moe_layer: int
    max_context_tokens: int | None
    rope_theta: float | None
    norm_eps: float | None
    dtype: Literal["bf16", "fp16", "fp32", "fp8"]
    checkpoint: str | None
    """Hugging Face id or cluster path of the weights; null = built in code (the tiny CPU model)."""


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """What the runtime driver executes: the plan's decisions plus the spec values the runtime needs."""

    format_version: int
    spec_hash: str
    """Binds the config to the spec it was lowered from; the driver refuses a mismatch."""
    spec_name: str
    mode: Literal["sync", "one-step-off", "bounded-async", "partial-rollout", "streaming"]
    max_version_lag: int
    allow_version_mixing: bool
    versions_per_engine: int
    consolidation_batch: int | None
    """streaming: the most requests a worker takes in when an older version is consolidated (the plan's)."""
    colocated: bool
    rollout_workers: int
    """Rollout engine replicas (rollout groups)."""
    max_num_seqs: int
    """Concurrent sequences per rollout worker."""
    max_model_len: int
    accelerator: str
    """Catalog name; `cpu` means one accelerator is one CPU core (a thread)."""
    accelerators_per_rollout_worker: int
    rollout_accelerators: int
    train_accelerators: int
    train_micro_batch_tokens: int
    train_num_microbatches: int
    prompts_per_step: int
    samples_per_prompt: int
    steps: int
    prompt_length: LengthConfig
    response_length: LengthConfig
    task: TaskConfig | None
    algorithm: AlgorithmConfig
    model: ModelConfig
    rollout_engine: Literal["torch", "vllm"]
    trainer: Literal["torch", "megatron"]
    megatron: dict[str, Any] | None
    """The lowered ``megatron/config.json`` where the runtime trains with it (trainer megatron beside the torch
    engines); None otherwise."""
    seed: int
    output_dir: str
    """Relative to the plan directory (the job's working directory)."""
    trace_file: str
    """Event trace (JSON lines) under output_dir, audited by the same checker as simulated schedules."""
    metrics_file: str
    checkpoint_dir: str
    """Under output_dir: the directory the runtime keeps its checkpoints in (``dora.runtime.checkpoint``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RuntimeConfig:
        """Parse and check ``runtime.json``; raise RuntimeConfigError naming the first bad field."""
        try:
            data = loads_json(text)
        except json.JSONDecodeError as exc:
            raise RuntimeConfigError("", f"not JSON: {exc.msg} at line {exc.lineno}") from None
        except ValueError as exc:  # nested too deeply, an integer beyond any float
            raise RuntimeConfigError("", f"not JSON dora reads: {exc}") from None
        config = _decode(cls, data, "")
        if config.format_version != FORMAT_VERSION:
            raise RuntimeConfigError("format_version", f"this dora reads version {FORMAT_VERSION}, "
                                     f"got {config.format_version}; re-run `dora plan --out`")
        _check_ranges(config)
        return config


# ----- value ranges ------------------------------------------------------------------------------------------
AT_LEAST_ONE = (
    "rollout_workers", "max_num_seqs", "max_model_len", "prompts_per_step", "samples_per_prompt", "steps",
    "versions_per_engine", "consolidation_batch", "accelerators_per_rollout_worker", "rollout_accelerators",
    "train_accelerators", "train_micro_batch_tokens", "train_num_microbatches",
    "prompt_length.max_tokens", "prompt_length.median_tokens", "prompt_length.p99_tokens",
    "response_length.max_tokens", "response_length.median_tokens", "response_length.p99_tokens",
    "algorithm.ppo_epochs", "algorithm.minibatches_per_step",
    "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.num_kv_heads", "model.head_dim",
    "model.ffn_hidden_size", "model.vocab_size",
)
"""Counts the runtime sizes things by (null, where a field may be, is not checked)."""
AT_LEAST_ZERO = ("max_version_lag", "seed", "task.warmup_steps", "prompt_length.min_tokens",
                 "response_length.min_tokens")
ABOVE_ZERO = ("algorithm.learning_rate", "algorithm.tis_cap", "algorithm.clip_ratio", "model.rope_theta",
              "model.norm_eps")
"""Numbers the runtime multiplies or divides by."""
NOT_NEGATIVE = ("algorithm.kl_coef", "algorithm.temperature")
"""``algorithm.temperature`` 0 samples greedily (``dora.runtime.engines.sampling``); its log-probs, in the
rollout and in training alike, are then under ``softmax(logits)``."""


def _check_ranges(config: RuntimeConfig) -> None:
    """Raise RuntimeConfigError naming the first value out of its range. Lowering never writes one (the spec's
    bounds are tighter), but a hand-edited file would otherwise get past the type checks and start Ray, then die
    with a traceback while the run starts (a count of 0), or train on nonsense (a rate of 0 or NaN)."""
    for path in AT_LEAST_ONE + AT_LEAST_ZERO + ABOVE_ZERO + NOT_NEGATIVE:
        value = _value(config, path)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise RuntimeConfigError(path, f"must be a finite number, got {value}")
        if path in AT_LEAST_ONE and value < 1:
            raise RuntimeConfigError(path, f"must be at least 1, got {value}")
        if path in AT_LEAST_ZERO and value < 0:
            raise RuntimeConfigError(path, f"must be at least 0, got {value}")
        if path in ABOVE_ZERO and not value > 0:
            raise RuntimeConfigError(path, f"must be above 0, got {value:g}")
        if path in NOT_NEGATIVE and value < 0:
            greedy = " (0 samples greedily)" if path == "algorithm.temperature" else ""
            raise RuntimeConfigError(path, f"must be at least 0{greedy}, got {value:g}")
    for lengths in ("prompt_length", "response_length"):
        dist: LengthConfig = getattr(config, lengths)
        if dist.min_tokens > dist.max_tokens:
            raise RuntimeConfigError(f"{lengths}.min_tokens", f"{dist.min_tokens} is above {lengths}.max_tokens "
                                     f"({dist.max_tokens})")


def _value(config: RuntimeConfig, path: str) -> Any:
    """The value at dotted ``path``; None where it or a parent is null."""
    node: Any = config
    for name in path.split("."):
        if node is None:
            return None
        node = getattr(node, name)
    return node


# ----- strict decoding ---------------------------------------------------------------------------------------
def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _decode(tp: Any, value: Any, where: str) -> Any:
    """Convert JSON ``value`` to type ``tp`` (dataclass, Literal, Optional, tuple, int, float, str, bool)."""
    origin = get_origin(tp)
    if isinstance(tp, type) and is_dataclass(tp):
        if not isinstance(value, dict):
            raise RuntimeConfigError(where, f"expected an object, got {_type_name(value)}")
        hints = get_type_hints(tp)
        names = [f.name for f in fields(tp)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise RuntimeConfigError(_join(where, unknown[0]), f"unknown field (known: {', '.join(sorted(names))})")
        missing = [n for n in names if n not in value]
        if missing:
            raise RuntimeConfigError(_join(where, missing[0]), "missing")
        return tp(**{n: _decode(hints[n], value[n], _join(where, n)) for n in names})
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise RuntimeConfigError(where, "must not be null")
        (inner,) = [o for o in options if o is not type(None)]
        return _decode(inner, value, where)
    if origin is dict:  # a JSON object passed through whole (the lowered Megatron config)
        if not isinstance(value, dict):
            raise RuntimeConfigError(where, f"expected an object, got {_type_name(value)}")
        return value
    if origin is Literal:
        if value not in get_args(tp) or isinstance(value, bool):
            allowed = ", ".join(repr(a) for a in get_args(tp))
            raise RuntimeConfigError(where, f"must be one of {allowed}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise RuntimeConfigError(where, f"expected a list, got {_type_name(value)}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise RuntimeConfigError(where, f"expected {len(args)} items, got {len(value)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    # bool is an int subclass in Python but never a valid count, and an int is never a valid flag.
    if tp is bool:
        if not isinstance(value, bool):
            raise RuntimeConfigError(where, f"expected true or false, got {_type_name(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RuntimeConfigError(where, f"expected an integer, got {_type_name(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RuntimeConfigError(where, f"expected a number, got {_type_name(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RuntimeConfigError(where, f"expected a string, got {_type_name(value)}")
        return value
    raise TypeError(f"runtime config: no decoder for type {tp!r} at '{where}'")  # a bug in this module
