"""Continuous generation under a staleness bound: ``bounded-async`` and ``partial-rollout``.

- bounded-async (AReaL's ``max_head_offpolicyness``, ROLL's ``async_generation_ratio``): engines
  generate without a batch barrier; admission is bounded so at most ``(latest + k + 1) * P``
  groups are ever admitted. At a weight update each engine either
  * drains: stops admitting, finishes its in-flight trajectories on the old version, then loads
    the new one (no mixing; the engine idles through its own tail), or
  * interrupts (only if version mixing is allowed): pauses, loads, and continues the in-flight
    trajectories on the new weights with their KV recomputed (recorded as version spans).
- partial-rollout (slime / Kimi k1.5 style): the same state machine with ``interrupt`` forced: every
  update interrupts every engine and the unfinished responses resume on the new weights.

The trainer consumes finished groups oldest version first (see ``planner.policies.base``).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.policies.base import NO_ACTIONS, PolicyBase
from planner.policies.config import PolicyConfig
from planner.policies.vocabulary import Action, LoadWeights


class ContinuousPolicy(PolicyBase):
    """``bounded-async`` (drain or interrupt) and ``partial-rollout`` (always interrupt)."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.interrupt = config.mode == "partial-rollout" or config.update == "interrupt"

    def start(self) -> Sequence[Action]:
        out: list[Action] = []
        for r in range(len(self.engine_version)):
            self._fill(r, out)
        return out

    def _after_finish(self, group_id: int, rollout_group: int, group_done: bool) -> Sequence[Action]:
        r = rollout_group
        behind = self.engine_version[r] != self.latest_version
        if not group_done and not behind and self.slots - self.engine_active[r] < self.spp:
            return NO_ACTIONS  # fast path: nothing can change
        out: list[Action] = []
        if behind:
            if not self.interrupt and self.engine_ready[r] and self.engine_active[r] == 0:
                self._load_latest(r, out)
        else:
            self._fill(r, out)
        if group_done:
            self._try_train_oldest_first(out)
        return out

    def on_weights_published(self, version: int) -> Sequence[Action]:
        self.latest_version = version
        out: list[Action] = []
        for r in range(len(self.engine_version)):
            if self.engine_ready[r] and (self.interrupt or self.engine_active[r] == 0):
                self._load_latest(r, out)
        self._try_train_oldest_first(out)
        return out

    def on_weights_loaded(self, rollout_group: int, version: int) -> Sequence[Action]:
        r = rollout_group
        self.engine_version[r] = version
        self.engine_ready[r] = True
        out: list[Action] = []
        if version != self.latest_version:
            if self.interrupt or self.engine_active[r] == 0:
                self._load_latest(r, out)
        else:
            self._fill(r, out)
        return out

    def _load_latest(self, r: int, out: list[Action]) -> None:
        self.engine_ready[r] = False
        out.append(
            LoadWeights(
                rollout_group=r,
                version=self.latest_version,
                source="trainer",
                resume_in_flight=self.interrupt and self.engine_active[r] > 0,
            )
        )

    def _fill(self, r: int, out: list[Action]) -> None:
        if not self.engine_ready[r] or self.engine_version[r] != self.latest_version:
            return
        budget = self._admission_budget()
        while budget > 0 and self.slots - self.engine_active[r] >= self.spp:
            self._admit(r, self.latest_version, out)
            budget -= 1
