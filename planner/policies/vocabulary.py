"""The action/event vocabulary between a scheduling policy and the driver that executes it.

A *driver* (the discrete-event simulator, or the Ray runtime controller) owns time and engines; a
*policy* owns decisions. The driver reports :data:`Event` objects to ``policy.handle(event)`` and
executes the returned :data:`Action` objects in list order. See ``planner.policies`` for the contract.

Ids: ``group_id`` is an int (prompt group); its trajectories are named ``f"g{group_id}/{sample}"``
for ``sample in range(num_samples)``. ``rollout_group`` is the index (0-based) of one data-parallel
engine replica. Versions are ints; version 0 is the initial weights and training step ``s``
(1-based) produces version ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True, kw_only=True, slots=True)
class Admit:
    """Start ``num_samples`` trajectories of prompt group ``group_id`` on ``rollout_group``.

    The engine already serves ``version`` (the policy only admits after ``WeightsLoaded``).
    Driver reports one ``TrajectoryFinished`` per trajectory.
    """

    group_id: int
    rollout_group: int
    version: int
    num_samples: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadWeights:
    """Load ``version`` on ``rollout_group``, from the trainer or from ``peer`` (an engine serving it).

    ``resume_in_flight=False``: the engine has no in-flight requests (drained or migrated away).
    ``keep_loaded=True`` (streaming with ``max_versions_per_engine > 1``): the engine keeps the versions it
    hosts, and their in-flight requests continue on them; ``version`` is added alongside (the policy keeps
    at most ``max_versions_per_engine`` hosted). Otherwise every other hosted version is dropped.
    ``resume_in_flight=True``: in-flight requests pause, and continue on ``version`` after the load
    with their KV recomputed -- their later tokens form a new version span (version mixing).
    Driver reports ``WeightsLoaded`` once the engine serves ``version``.
    """

    rollout_group: int
    version: int
    source: Literal["trainer", "peer"]
    peer: int | None = None
    resume_in_flight: bool = False
    keep_loaded: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class DropVersion:
    """Free ``version``'s weights on ``rollout_group``: no request of it remains there (multi-version engines).

    Never the version the engine admits on. The driver reports nothing back.
    """

    rollout_group: int
    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrateRequests:
    """Move every in-flight request of ``src`` to engines serving the same version, KV cache included.

    ``capacity``: ``(dst, max_requests)`` pairs; their sum covers ``src``'s in-flight count at
    decision time. Requests keep their generated tokens (never re-generated) and their version.
    Driver reports ``RequestsMigrated`` before executing any later action on ``src``.
    """

    src: int
    capacity: tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class StartTrainStep:
    """Run training step ``step`` on the finished trajectories of these prompt groups (whole groups).

    ``joining`` (``PolicyConfig.early_steps``): those of ``group_ids`` still generating when the step starts. The
    trainer takes the others at once and each of these when its last trajectory finishes (one optimizer step at the
    end). Driver reports ``TrainStepFinished(step)`` once the trainer holds version ``step``.
    """

    step: int
    group_ids: tuple[int, ...]
    joining: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishWeights:
    """Make the trainer's ``version`` loadable by rollout engines (gather/reshard to the transfer format).

    Driver reports ``WeightsPublished(version)``.
    """

    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SuspendRollout:
    """Colocated streaming: stop every engine so the trainer can have the accelerators.

    Each engine finishes a weight load or KV transfer in progress, stops decoding, and moves its in-flight
    requests' KV cache and its weights to host memory (on ``cpu`` they already are: it only stops). Requests keep
    their generated tokens and their version. Driver reports ``RolloutSuspended`` once every engine has; a
    ``TrajectoryFinished`` that happened before an engine stopped may still arrive after it.
    """


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeRollout:
    """Colocated streaming: every engine reloads the weights and KV cache it moved to host memory and continues its
    in-flight requests on the version they started with. Driver reports ``RolloutResumed`` once every engine has."""


Action = Admit | LoadWeights | DropVersion | MigrateRequests | StartTrainStep | PublishWeights | SuspendRollout | \
    ResumeRollout

# ----------------------------------------------------------------------------- events


@dataclass(frozen=True, kw_only=True, slots=True)
class TrajectoryFinished:
    """Trajectory ``g{group_id}/{sample}`` finished on ``rollout_group`` with ``num_tokens`` response tokens."""

    group_id: int
    sample: int
    rollout_group: int
    num_tokens: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestsMigrated:
    """``moves``: ``(dst, count)`` pairs actually moved off ``src`` for a ``MigrateRequests``."""

    src: int
    moves: tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightsLoaded:
    rollout_group: int
    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainStepFinished:
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightsPublished:
    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSuspended:
    """Every engine stopped for a ``SuspendRollout``: the trainer has the accelerators."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutResumed:
    """Every engine serves again after a ``ResumeRollout``."""


Event = TrajectoryFinished | RequestsMigrated | WeightsLoaded | TrainStepFinished | WeightsPublished | \
    RolloutSuspended | RolloutResumed


def trajectory_id(group_id: int, sample: int) -> str:
    """The string id of one trajectory, ``"g{group_id}/{sample}"`` (ids are strings everywhere)."""
    return f"g{group_id}/{sample}"
