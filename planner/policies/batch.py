"""Batch-synchronous policies: ``sync`` (lag 0) and ``one-step-off`` (lag 1, verl's one-step-off).

Batch ``b`` (1-based) is prompt groups ``[(b-1)P, bP)``, all generated on version
``gen_version(b) = max(0, b - 1 - lag)``:

- sync: generate batch b on v = b-1, train step b on it, publish v = b, load it everywhere, repeat.
  Colocated or disaggregated is a matter of timing only (the driver charges the offload/reshard).
- one-step-off: batch b+1 is generated (on version b-1) while step b trains on batch b; weights
  are loaded only between batches, when every engine is idle, so no trajectory mixes versions and
  staleness is exactly 1 after the first batch.

Within a batch, groups are admitted as slots free up (continuous batching), always to the engine
whose trajectory just finished; the batch boundary is a barrier (the tail bubble sync suffers).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.policies.base import NO_ACTIONS, PolicyBase
from planner.policies.config import PolicyConfig
from planner.policies.vocabulary import Action, LoadWeights


class BatchPolicy(PolicyBase):
    """``sync`` when ``config.mode == "sync"``, else ``one-step-off``."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.lag = 0 if config.mode == "sync" else 1
        self.gen_batch = 0
        """Batch being generated (0 before the first)."""
        self.pending_groups = 0
        """Groups of ``gen_batch`` not admitted yet."""
        self.unfinished_groups = 0
        """Groups of ``gen_batch`` not finished yet."""
        self.loading = 0

    def gen_version(self, batch: int) -> int:
        return max(0, batch - 1 - self.lag)

    def start(self) -> Sequence[Action]:
        out: list[Action] = []
        self._maybe_next_batch(out)
        return out

    def _after_finish(self, group_id: int, rollout_group: int, group_done: bool) -> Sequence[Action]:
        if not group_done:
            if self.pending_groups and self.slots - self.engine_active[rollout_group] >= self.spp:
                out: list[Action] = []
                self._fill(rollout_group, out)
                return out
            return NO_ACTIONS
        out = []
        self.unfinished_groups -= 1
        if self.pending_groups:
            self._fill(rollout_group, out)
        self._try_train(out)
        if self.unfinished_groups == 0:
            self._maybe_next_batch(out)
        return out

    def on_weights_published(self, version: int) -> Sequence[Action]:
        self.latest_version = version
        out: list[Action] = []
        self._try_train(out)
        self._maybe_next_batch(out)
        return out

    def on_weights_loaded(self, rollout_group: int, version: int) -> Sequence[Action]:
        self.engine_version[rollout_group] = version
        self.engine_ready[rollout_group] = True
        self.loading -= 1
        out: list[Action] = []
        if self.loading == 0:
            self._maybe_next_batch(out)
        return out

    # ------------------------------------------------------------------ internals
    def _fill(self, r: int, out: list[Action]) -> None:
        v = self.gen_version(self.gen_batch)
        while self.pending_groups and self.slots - self.engine_active[r] >= self.spp:
            self.pending_groups -= 1
            self._admit(r, v, out)

    def _try_next_step(self, out: list[Action]) -> None:
        self._try_train(out)

    def _try_train(self, out: list[Action]) -> None:
        step = self.next_step
        if self.training or step > self.config.total_steps:
            return
        if self.config.colocated and self.latest_version != step - 1:
            return  # separate accelerators: the step may queue behind the last one's publish (PolicyBase)
        if step > self.gen_batch or (step == self.gen_batch and self.unfinished_groups):
            return  # batch `step` is not fully generated yet
        queue = self.finished_groups[self.gen_version(step)]
        chosen = [queue.popleft() for _ in range(self.prompts_per_step)]
        if not queue:
            del self.finished_groups[self.gen_version(step)]
        self._consume(step, chosen, out)

    def _maybe_next_batch(self, out: list[Action]) -> None:
        """Start generating the next batch once the engines are idle and serve its version."""
        nxt = self.gen_batch + 1
        if self.unfinished_groups or self.loading or nxt > self.config.total_steps:
            return
        want = self.gen_version(nxt)
        if want > self.latest_version:
            return  # its weights are not published yet
        stale = [r for r, v in enumerate(self.engine_version) if v != want]
        if stale:
            for r in stale:
                self.engine_ready[r] = False
                out.append(LoadWeights(rollout_group=r, version=want, source="trainer"))
            self.loading = len(stale)
            return
        self.gen_batch = nxt
        self.pending_groups = self.prompts_per_step
        self.unfinished_groups = self.prompts_per_step
        for r in range(len(self.engine_version)):
            if not self.pending_groups:
                break
            self._fill(r, out)
