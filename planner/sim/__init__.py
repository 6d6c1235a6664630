"""Discrete-event simulation of one RL post-training run under a scheduling policy.

``simulate(config, workload, timing, seed=..., record_events=...) -> SimResult`` drives the same
policy objects the runtime controller drives (``planner.policies``), with step times from a
``StepTiming`` (``planner.sim.timing``; built from the cost model by ``planner.sim.costmodel``).
Deterministic: events are ordered by ``(time, sequence)`` and all randomness comes from ``seed``.
"""

from __future__ import annotations

import math

from planner.policies import PolicyConfig
from planner.sim.result import SimResult, StepStats
from planner.sim.simulator import Simulator
from planner.sim.timing import LinearTiming, StepTiming
from planner.workload import Workload


def simulate(
    config: PolicyConfig,
    workload: Workload,
    timing: StepTiming,
    *,
    seed: int = 0,
    record_events: bool = True,
    accelerators_per_group: int = 1,
    train_accelerators: int = 1,
    kv_capacity_tokens: float = math.inf,
    attention_dp: int = 1,
) -> SimResult:
    """Run ``config.total_steps`` training steps and return the metrics (and the trace if recorded).

    ``record_events=False`` skips the per-trajectory trace (``SimResult.events is None``): use it for
    large specs and inside the plan search. ``accelerators_per_group`` and ``train_accelerators``
    only weight the utilisation/bubble metrics (with ``config.colocated`` the trainer uses the
    rollout pool's devices). ``kv_capacity_tokens`` is one replica's KV cache: sequences that outgrow it are
    preempted and recomputed, as vLLM does (unlimited by default: only the slots bound a replica). With
    ``attention_dp`` > 1 a replica is that many attention data-parallel ranks, each with its share of the slots and of
    the cache, and its own sequences (``planner.sim.simulator``'s module doc).
    """
    return Simulator(
        config=config,
        workload=workload,
        timing=timing,
        seed=seed,
        record_events=record_events,
        accelerators_per_group=accelerators_per_group,
        train_accelerators=train_accelerators,
        kv_capacity_tokens=kv_capacity_tokens,
        attention_dp=attention_dp,
    ).run()


__all__ = ["LinearTiming", "SimResult", "StepStats", "StepTiming", "simulate"]
