"""Bookkeeping shared by every policy: engines, prompt groups, versions, and the trainer's batch choice.

State (all plain lists/dicts, owned by one policy object, never shared):
    engine_version[r]   version engine r serves (or is loading, when not ready)
    engine_active[r]    in-flight trajectories on engine r (admitted, not finished, not migrated away)
    engine_ready[r]     r serves engine_version[r] and may receive admissions
    group_version[g]    version prompt group g was admitted on (all its samples use it)
    group_remaining[g]  samples of g not yet finished

Trainer rule shared by the asynchronous modes ("oldest version first"): step s takes P finished
groups in (version, finish order). It waits while that choice would leave, for some version v,
more unconsumed groups of versions <= v than steps s+1 .. v+k+1 can take, ``U(<=v) - P >
(v + k + 1 - s) * P`` -- in particular step s needs every group of version s - k - 1 finished.
Admission is bounded so that this is always satisfiable (AReaL's rule): groups admitted so far
<= (latest_version + k + 1) * P, hence U(<=v) <= (v + k + 1 - (s - 1)) * P before step s.
Early steps (``PolicyConfig.early_steps``, separate accelerators): a step held only by the unfinished groups of
version s - k - 1 (every one of which it must take) starts anyway, on P groups counting those: the trainer takes the
finished ones at once and each of those as it finishes (``StartTrainStep.joining``). The trainer's wait for the oldest
version's tail then overlaps the rest of the step's work. The batch, its versions and the bound are those the step
would have had by waiting.
Colocated (rollout and training take turns on the same accelerators): once a step is ready the policy first
suspends rollout (``SuspendRollout``), and chooses and starts the step when every engine has stopped.

On separate accelerators the next step may start as soon as the one before it finished, with its publish still
in flight: the driver queues the step behind the publish on the trainer (the simulator starts it when the publish
ends; the runtime's trainer actor runs its calls in order), so the trainer does not wait a controller round trip for
the publish's reply. Colocated policies keep waiting for the publish: the engines resume between two steps.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Sequence

from planner.policies.config import PolicyConfig
from planner.policies.vocabulary import (
    Action,
    Admit,
    Event,
    PublishWeights,
    RequestsMigrated,
    RolloutResumed,
    RolloutSuspended,
    StartTrainStep,
    SuspendRollout,
    TrainStepFinished,
    TrajectoryFinished,
    WeightsLoaded,
    WeightsPublished,
)

NO_ACTIONS: tuple[Action, ...] = ()
RUNNING, CHANGING, STOPPED = 0, 1, 2
"""``PolicyBase.suspended``: rollout runs; rollout is stopping or resuming; every engine has stopped."""


class PolicyBase:
    """Common state machine; subclasses decide admission, weight updates and the training batch."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.k = config.max_version_lag
        self.spp = config.samples_per_prompt
        self.prompts_per_step = config.prompts_per_step
        self.slots = config.slots_per_group
        n = config.num_rollout_groups
        self.engine_version = [0] * n
        self.engine_active = [0] * n
        self.engine_ready = [True] * n
        self.latest_version = 0
        self.group_version: list[int] = []
        self.group_remaining: list[int] = []
        self.finished_groups: dict[int, deque[int]] = {}
        """version -> finished, not yet consumed groups, in finish order."""
        self.unconsumed_groups: dict[int, int] = {}
        """version -> admitted, not yet consumed groups."""
        self.next_step = 1
        self.early_steps = config.early_steps
        self.joining: set[int] = set()
        """Groups a running early step took while they were still generating (their finish queues nothing)."""
        self.training = False
        self.steps_done = 0
        self.suspended = RUNNING
        """Colocated (rollout and training take turns on the same accelerators, ``_try_train_oldest_first``):
        ``RUNNING``; ``CHANGING`` from a ``SuspendRollout`` until ``RolloutSuspended``, and from a ``ResumeRollout``
        until ``RolloutResumed``; ``STOPPED`` in between, when the trainer may run. Not ``RUNNING``: no admission.
        (One attribute, not three: past 30 attributes CPython 3.11 stops sharing an instance's dict keys, and every
        attribute read on the hot path gets slower, +3.6% simulator instructions measured.)"""

    # ------------------------------------------------------------------ driver entry points
    def start(self) -> Sequence[Action]:
        """Initial actions (all engines serve version 0 from the start)."""
        raise NotImplementedError

    def handle(self, event: Event) -> Sequence[Action]:
        """Typed entry point: route one driver event to its handler."""
        if isinstance(event, TrajectoryFinished):
            return self.on_trajectory_finished(event.group_id, event.rollout_group)
        if isinstance(event, WeightsLoaded):
            return self.on_weights_loaded(event.rollout_group, event.version)
        if isinstance(event, TrainStepFinished):
            return self.on_train_step_finished(event.step)
        if isinstance(event, WeightsPublished):
            return self.on_weights_published(event.version)
        if isinstance(event, RequestsMigrated):
            return self.on_requests_migrated(event.src, event.moves)
        if isinstance(event, RolloutSuspended):
            return self.on_rollout_suspended()
        if isinstance(event, RolloutResumed):
            return self.on_rollout_resumed()
        raise TypeError(f"unknown event {event!r}")

    # Hot-path handlers; ``handle`` calls exactly these, so a driver may call them directly.
    def on_trajectory_finished(self, group_id: int, rollout_group: int) -> Sequence[Action]:
        self.engine_active[rollout_group] -= 1
        left = self.group_remaining[group_id] - 1
        self.group_remaining[group_id] = left
        if left == 0 and self.joining and group_id in self.joining:
            self.joining.discard(group_id)  # the running step takes it now
        elif left == 0:
            v = self.group_version[group_id]
            queue = self.finished_groups.get(v)
            if queue is None:
                queue = self.finished_groups[v] = deque()
            queue.append(group_id)
        return self._after_finish(group_id, rollout_group, left == 0)

    def on_weights_loaded(self, rollout_group: int, version: int) -> Sequence[Action]:
        raise NotImplementedError

    def on_weights_published(self, version: int) -> Sequence[Action]:
        raise NotImplementedError

    def on_requests_migrated(self, src: int, moves: tuple[tuple[int, int], ...]) -> Sequence[Action]:
        raise TypeError(f"{type(self).__name__} never migrates requests")

    def on_rollout_suspended(self) -> Sequence[Action]:
        if self.suspended != CHANGING:
            raise ValueError("RolloutSuspended without a SuspendRollout")
        self.suspended = STOPPED
        out: list[Action] = []
        self._try_train_oldest_first(out)
        return out

    def on_rollout_resumed(self) -> Sequence[Action]:
        raise TypeError(f"{type(self).__name__} never suspends rollout")

    def on_train_step_finished(self, step: int) -> Sequence[Action]:
        if not self.training or step != self.next_step - 1:
            raise ValueError(f"TrainStepFinished({step}) but the running step is {self.next_step - 1}")
        self.training = False
        self.steps_done = step
        out: list[Action] = [PublishWeights(version=step)]  # first: the next step queues behind it on the trainer
        if not self.config.colocated:
            self._try_next_step(out)
        return out

    def _try_next_step(self, out: list[Action]) -> None:
        """Start the next step if its batch is ready (this mode's trainer rule); the previous step's publish may
        still be in flight on separate accelerators."""
        self._try_train_oldest_first(out)

    # ------------------------------------------------------------------ queries
    @property
    def done(self) -> bool:
        """True once ``total_steps`` training steps finished."""
        return self.steps_done >= self.config.total_steps

    def live_versions(self) -> tuple[int, ...]:
        """Versions with unconsumed groups, plus the newest published version."""
        live = {v for v, n in self.unconsumed_groups.items() if n > 0}
        live.add(self.latest_version)
        return tuple(sorted(live))

    def engine_versions(self) -> tuple[int, ...]:
        return tuple(self.engine_version)

    # ------------------------------------------------------------------ helpers for subclasses
    def _after_finish(self, group_id: int, rollout_group: int, group_done: bool) -> Sequence[Action]:
        raise NotImplementedError

    def _admit(self, rollout_group: int, version: int, out: list[Action]) -> None:
        gid = len(self.group_version)
        self.group_version.append(version)
        self.group_remaining.append(self.spp)
        self.unconsumed_groups[version] = self.unconsumed_groups.get(version, 0) + 1
        self.engine_active[rollout_group] += self.spp
        out.append(Admit(group_id=gid, rollout_group=rollout_group, version=version, num_samples=self.spp))

    def _admission_budget(self) -> int:
        """Groups that may still be admitted under the staleness bound (AReaL's rule, see module doc)."""
        return (self.latest_version + self.k + 1) * self.prompts_per_step - len(self.group_version)

    def _consume(self, step: int, group_ids: list[int], out: list[Action], joining: tuple[int, ...] = ()) -> None:
        for gid in group_ids:
            v = self.group_version[gid]
            left = self.unconsumed_groups[v] - 1
            if left:
                self.unconsumed_groups[v] = left
            else:
                del self.unconsumed_groups[v]
        self.training = True
        self.next_step = step + 1
        out.append(StartTrainStep(step=step, group_ids=tuple(group_ids), joining=joining))

    def _try_train_oldest_first(self, out: list[Action]) -> None:
        """Start the next step if the forced groups are finished and P finished groups exist."""
        if self.training or self.next_step > self.config.total_steps:
            return
        if self.config.colocated and self.next_step - 1 != self.latest_version:
            return  # the previous step's weights are still being published (separate accelerators: see above)
        step = self.next_step
        per_step = self.prompts_per_step
        bound = step - self.k - 1  # the step takes every group of this version (none older is left)
        unconsumed_upto = finished_upto = joining = 0
        for v in sorted(self.unconsumed_groups):
            unconsumed_upto += self.unconsumed_groups[v]
            finished_upto += len(self.finished_groups.get(v, ()))
            # steps step+1 .. v+k+1 take at most (v + k + 1 - step) * P groups of versions <= v
            must_take = unconsumed_upto - (v + self.k + 1 - step) * per_step
            if must_take > per_step:
                raise AssertionError(f"versions <= {v} hold {unconsumed_upto} groups; step {step} cannot keep k")
            if finished_upto < must_take:
                if not self.early_steps or v != bound:
                    return  # the only allowed stall: waiting for an old version's tail at the bound
                joining = must_take - finished_upto  # an early step takes them as they finish (module doc)
                finished_upto = must_take
        if finished_upto < per_step:
            return
        if self.suspended != STOPPED and self.config.colocated:
            if self.suspended == RUNNING:  # the step is ready: the trainer needs the accelerators first
                self.suspended = CHANGING
                out.append(SuspendRollout())
            return
        need = per_step - joining  # the bound version's finished groups come first: all of them are taken
        chosen: list[int] = []
        for v in sorted(self.finished_groups):
            queue = self.finished_groups[v]
            while queue and len(chosen) < need:
                chosen.append(queue.popleft())
            if not queue:
                del self.finished_groups[v]
            if len(chosen) == need:
                break
        late: tuple[int, ...] = ()
        if joining:
            versions, remaining = self.group_version, self.group_remaining  # admitted in version order
            late = tuple(g for g in range(bisect_left(versions, bound), bisect_right(versions, bound)) if remaining[g])
            if len(late) != joining:
                raise AssertionError(f"step {step}: {len(late)} groups of v{bound} generating, {joining} expected")
            self.joining.update(late)
            chosen.extend(late)
        self._consume(step, chosen, out, late)
