"""What the search needs to know: a pure, frozen description of one planning problem.

The dora spec layer builds a ``SearchInputs`` from a resolved spec; the planner never sees YAML or files.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.architecture import ModelArch
from planner.calibration import DEFAULT_CALIBRATION, Calibration
from planner.hardware import Accelerator
from planner.plan import Objective
from planner.policies.config import Mode
from planner.workload import LengthDistribution


@dataclass(frozen=True, kw_only=True)
class Pins:
    """Placement fields the user pinned; None means 'search it'."""

    colocated: bool | None = None
    rollout_accelerators: int | None = None
    rollout_tp: int | None = None
    rollout_ep: int | None = None
    versions_per_engine: int | None = None
    consolidation_batch: int | None = None
    train_accelerators: int | None = None
    train_tp: int | None = None
    train_pp: int | None = None
    train_ep: int | None = None
    train_dp: int | None = None
    train_cp: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in self.__dict__.values())


@dataclass(frozen=True, kw_only=True)
class SearchInputs:
    arch: ModelArch
    accelerator: Accelerator
    """Catalog entry, with the spec's link-bandwidth overrides applied."""
    nodes: int
    accelerators_per_node: int
    dtype_bytes: float
    """Bytes per element of activations, the KV cache, messages and the trainer's weights (``ACTIVATION_BYTES``)."""
    rollout_weight_bytes: float
    """Bytes per weight in the rollout engines (``DTYPE_BYTES``: 1 for fp8, else ``dtype_bytes``)."""
    prompts_per_step: int
    samples_per_prompt: int
    prompt_lengths: LengthDistribution
    response_lengths: LengthDistribution
    steps: int
    max_version_lag: int
    """The staleness budget k."""
    modes: tuple[Mode, ...]
    """Modes the spec allows (all constraint-keeping ones for `auto`)."""
    allow_version_mixing: bool
    extra_forward_passes: int
    """Forward-pass equivalents per step beyond one forward+backward: proximal/old log-probs (1, only with several
    optimizer steps; with one they are the training forward's own), reference model (+1 with a KL term), more PPO
    epochs (+3 each), a same-size PPO critic (+4: its forward, backward and values)."""
    optimizer_steps: int
    """Optimizer steps per RL step (minibatches x PPO epochs): each pays the DP gradient sync, the Adam update and
    a pipeline flush."""
    early_steps: bool = True
    """Plans whose trainer can start a step early do (``planner.policies.early_steps_for``); False: every step waits
    for its whole batch (what ``bench/early_steps.py`` compares with)."""
    samples_per_minibatch: int
    """Samples per optimizer step (batch / minibatches): training data parallelism must divide it, as Megatron's
    global batch must be a multiple of dp."""
    gpu_memory_utilization: float
    max_num_seqs_cap: int
    """Upper bound on continuous-batching slots per engine: the spec's ``placement.rollout.max_num_seqs``, else
    vLLM's default (256), or 64 for the CPU engine."""
    pins: Pins
    price_per_accelerator_hour_usd: float | None
    objective: Objective
    seed: int
    calibration: Calibration = DEFAULT_CALIBRATION
    lengths_per_prompt: bool = False
    """The samples of a prompt group share one response length (``Workload.length_per_prompt``)."""
    rollout_engine: str = "torch"
    """The spec's ``runtime.rollout_engine``: "vllm" or dora's "torch" engine (``single_version_engines``; on ``cpu``
    the catalog's constants depend on it, ``planner.calibration.catalog_calibration``)."""

    @property
    def single_version_engines(self) -> bool:
        """The rollout engines host one policy version each (vLLM, on ``cpu`` too); False: on ``cpu``, dora's torch
        engines, which may host several (``Space.rollout_options``)."""
        return self.rollout_engine == "vllm"

    @property
    def total_accelerators(self) -> int:
        return self.nodes * self.accelerators_per_node

    @property
    def batch_samples(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def max_context_tokens(self) -> int:
        return self.prompt_lengths.max_tokens + self.response_lengths.max_tokens
