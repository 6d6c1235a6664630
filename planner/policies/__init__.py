"""Scheduling policies: one small state machine per asynchronous mode, driven by any driver.

Modes: ``sync``, ``one-step-off`` (``BatchPolicy``), ``bounded-async``, ``partial-rollout``
(``ContinuousPolicy``), ``streaming`` (``StreamingPolicy``). Build one with ``make_policy(config)``.

A policy knows nothing about time. The driver -- the simulator in ``planner.sim`` or the runtime
controller -- reports events and executes the actions each call returns, in list order.

Actions (policy -> driver) and the event the driver must report after executing each one:

==================================================  ===============================================
action                                              driver reports
==================================================  ===============================================
``Admit(group_id, rollout_group, version, n)``      one ``TrajectoryFinished`` per trajectory
                                                    ``g{group_id}/{i}``, ``i < n``, when it finishes
``LoadWeights(rollout_group, version, source,       ``WeightsLoaded(rollout_group, version)``
peer, resume_in_flight, keep_loaded)``              (``keep_loaded``: add ``version``, keep the hosted
                                                    ones and their in-flight requests running)
``DropVersion(rollout_group, version)``             nothing (free the weights; no request uses them)
``MigrateRequests(src, capacity)``                  ``RequestsMigrated(src, moves)`` -- before any
                                                    ``TrajectoryFinished`` of a moved request and
                                                    before any later action on ``src``
``StartTrainStep(step, group_ids)``                 ``TrainStepFinished(step)``
``PublishWeights(version)``                         ``WeightsPublished(version)``
``SuspendRollout()`` (colocated streaming)          ``RolloutSuspended()`` once every engine stopped
                                                    (after any load or transfer in progress); finishes
                                                    from before the stop may still follow
``ResumeRollout()``                                 ``RolloutResumed()`` once every engine serves again
==================================================  ===============================================

Driver rules:
1. Call ``policy.start()`` once, then ``policy.handle(event)`` (or the equivalent hot-path method
   ``on_trajectory_finished`` / ``on_weights_loaded`` / ...) for every event, one at a time.
2. Execute returned actions in order. Events may be reported in any causal order, except the
   ``RequestsMigrated`` rule above.
3. ``TrajectoryFinished.rollout_group`` is the engine the trajectory finished on (after migration).
4. The run ends when ``policy.done`` (``total_steps`` steps finished); the driver then records every
   admitted, unconsumed trajectory with an ``unfinished_at_end`` trace event.
5. The driver, not the policy, writes the trace (``planner.schedule.events``).
"""

from __future__ import annotations

from planner.policies.base import PolicyBase
from planner.policies.batch import BatchPolicy
from planner.policies.config import (
    EARLY_STEP_MODES,
    MODES,
    POLL_LINGER_S,
    Mode,
    PolicyConfig,
    admission_queue_for,
    early_steps_for,
    poll_batching,
    update_for,
)
from planner.policies.continuous import ContinuousPolicy
from planner.policies.streaming import StreamingPolicy
from planner.policies.vocabulary import (
    Action,
    Admit,
    DropVersion,
    Event,
    LoadWeights,
    MigrateRequests,
    PublishWeights,
    RequestsMigrated,
    ResumeRollout,
    RolloutResumed,
    RolloutSuspended,
    StartTrainStep,
    SuspendRollout,
    TrainStepFinished,
    TrajectoryFinished,
    WeightsLoaded,
    WeightsPublished,
    trajectory_id,
)


def make_policy(config: PolicyConfig) -> PolicyBase:
    """The state machine for ``config.mode`` (a fresh object: policies are single-use)."""
    if config.mode in ("sync", "one-step-off"):
        return BatchPolicy(config)
    if config.mode in ("bounded-async", "partial-rollout"):
        return ContinuousPolicy(config)
    return StreamingPolicy(config)


__all__ = [
    "EARLY_STEP_MODES",
    "MODES",
    "POLL_LINGER_S",
    "Action",
    "Admit",
    "BatchPolicy",
    "ContinuousPolicy",
    "DropVersion",
    "Event",
    "LoadWeights",
    "MigrateRequests",
    "Mode",
    "PolicyBase",
    "PolicyConfig",
    "admission_queue_for",
    "early_steps_for",
    "poll_batching",
    "PublishWeights",
    "RequestsMigrated",
    "ResumeRollout",
    "RolloutResumed",
    "RolloutSuspended",
    "StartTrainStep",
    "StreamingPolicy",
    "SuspendRollout",
    "TrainStepFinished",
    "TrajectoryFinished",
    "WeightsLoaded",
    "WeightsPublished",
    "make_policy",
    "trajectory_id",
    "update_for",
]
