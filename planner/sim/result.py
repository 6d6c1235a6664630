"""SimResult: what one simulated run predicts (all times in seconds of simulated time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    step: int
    start_s: float
    end_s: float
    duration_s: float
    """``end_s`` minus the previous step's end (or minus 0 for step 1): the step's share of wall time."""
    trainer_wait_s: float
    """Trainer idle before this step started: start minus the previous version's publication."""
    num_samples: int
    num_tokens: int
    """Prompt + response tokens trained on."""
    mean_staleness: float
    """Mean of ``step - version - 1`` over the batch's trajectories."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """Metrics of one simulated run, plus its trace events when recorded.

    Throughput uses the steady-state step time ``step_time_s = (end_N - end_1) / (N - 1)`` (the first
    step includes the pipeline fill), or ``end_1`` when only one step ran.
    Fractions are of the run's wall time ``total_time_s``. ``bubble_fraction`` is the share of
    accelerator-seconds (rollout + training accelerators, or the shared pool when colocated) with no
    work at all: engines with no sequence or loading weights, the trainer waiting.
    """

    mode: str
    seed: int
    steps: tuple[StepStats, ...]
    total_time_s: float
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    rollout_busy_fraction: float
    """Engine-seconds with at least one running sequence (or a prefill) / (engines x wall)."""
    rollout_slot_occupancy: float
    """Time-averaged running sequences / (engines x slots)."""
    train_busy_fraction: float
    """Trainer seconds training or publishing / wall."""
    bubble_fraction: float
    staleness_histogram: tuple[tuple[int, int], ...]
    """(staleness, trajectories) over consumed trajectories."""
    live_versions: tuple[tuple[float, tuple[int, ...]], ...]
    """(time, live versions) each time the set changed."""
    max_live_versions: int
    max_engine_versions: int
    """Most distinct versions served by the engines at one instant."""
    weight_load_s_total: float
    """Engine-seconds spent loading weights (busy fractions, load and publish seconds count only up to the end of the
    run, the end of the last training step: the last publish, a load or a prefill still under way are cut there)."""
    weight_loads: int
    """Loads started."""
    weight_publish_s_total: float
    extra_weight_bytes_per_group: float
    """Memory for versions beyond the serving one on one replica ((versions per engine - 1) x weights)."""
    mixed_trajectories: int
    """Consumed or in-flight trajectories whose tokens span several versions."""
    migrated_trajectories: int
    unfinished_at_end: int
    num_sim_events: int
    events: tuple[dict[str, Any], ...] | None
    """The trace (``planner.schedule`` schema), or None when recording was off."""
    swap_s_total: float = 0.0
    """Colocated streaming: replica-seconds moving weights and KV cache to host memory and back (both ways)."""
    suspend_wall_s_total: float = 0.0
    """Colocated streaming: wall seconds from each suspension's start until every replica has moved out, and from each
    resumption's start until every one is back (the slowest replica each time: on the critical path)."""
    preemptions: int = 0
    """Sequences put back in their replica's queue because its KV cache was full (recomputed when they restart)."""
    recomputed_sequences: int = 0
    """Sequences that started again without their KV cache: preempted ones, and requests migrated to a replica whose
    cache could not hold them (they wait there without it)."""
    recomputed_tokens: float = 0.0
    """Prompt and response tokens prefilled again for them."""

    def summary(self) -> dict[str, Any]:
        """Scalar metrics as a plain dict (no per-step rows, no events)."""
        return {
            "mode": self.mode,
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "rollout_busy_fraction": self.rollout_busy_fraction,
            "rollout_slot_occupancy": self.rollout_slot_occupancy,
            "train_busy_fraction": self.train_busy_fraction,
            "bubble_fraction": self.bubble_fraction,
            "max_live_versions": self.max_live_versions,
            "weight_load_s_total": self.weight_load_s_total,
            "swap_s_total": self.swap_s_total,
            "suspend_wall_s_total": self.suspend_wall_s_total,
            "preemptions": self.preemptions,
            "recomputed_sequences": self.recomputed_sequences,
            "recomputed_tokens": self.recomputed_tokens,
            "mixed_trajectories": self.mixed_trajectories,
            "unfinished_at_end": self.unfinished_at_end,
        }
