"""RunMetrics: the accumulators one simulation fills in, and their reduction into a SimResult."""

from __future__ import annotations

from collections import Counter
from typing import Any

from planner.sim.result import SimResult, StepStats


class RunMetrics:
    """Mutable during one run only; ``result`` turns it into the frozen ``SimResult``."""

    def __init__(
        self, *, num_engines: int, slots: int, accelerators_per_group: int, train_accelerators: int, colocated: bool
    ) -> None:
        self.num_engines = num_engines
        self.slots = slots
        self.accelerators_per_group = accelerators_per_group
        self.train_accelerators = train_accelerators
        self.colocated = colocated
        self.e_busy = [0.0] * num_engines
        self.e_slot_time = [0.0] * num_engines
        self.train_busy_s = 0.0
        self.publish_s_total = 0.0
        self.load_s_total = 0.0
        self.loads = 0
        self.num_events = 0
        self.consumed_groups: list[list[int]] = []
        self.staleness: Counter[int] = Counter()
        self._step_rows: dict[int, dict[str, Any]] = {}
        self._published_at: dict[int, float] = {0: 0.0}
        self.live_timeline: list[tuple[float, tuple[int, ...]]] = []
        self._engine_versions: Counter[int] = Counter({0: num_engines})
        self.max_engine_versions = 1

    def train_started(
        self,
        *,
        step: int,
        now: float,
        duration_s: float,
        group_ids: tuple[int, ...],
        versions: list[int],
        spp: int,
        tokens: int,
    ) -> None:
        self.train_busy_s += duration_s
        stale = [step - v - 1 for v in versions]
        for s in stale:
            self.staleness[s] += spp
        self.consumed_groups.append(list(group_ids))
        self._step_rows[step] = {
            "start_s": now,
            "trainer_wait_s": now - self._published_at.get(step - 1, 0.0),
            "num_samples": len(versions) * spp,
            "num_tokens": tokens,
            "mean_staleness": sum(stale) / len(stale) if stale else 0.0,
        }

    def train_finished(self, step: int, now: float) -> None:
        self._step_rows[step]["end_s"] = now

    def published(self, version: int, now: float) -> None:
        self._published_at[version] = now

    def live_versions_changed(self, now: float, live: tuple[int, ...]) -> None:
        if not self.live_timeline or self.live_timeline[-1][1] != live:
            self.live_timeline.append((now, live))

    def engine_version_change(self, old: int, new: int) -> None:
        if old == new:
            return
        ev = self._engine_versions
        ev[old] -= 1
        if ev[old] == 0:
            del ev[old]
        ev[new] += 1
        self.max_engine_versions = max(self.max_engine_versions, len(ev))

    def result(
        self,
        *,
        mode: str,
        seed: int,
        end_s: float,
        batch_samples: int,
        extra_weight_bytes_per_group: float,
        mixed_trajectories: int,
        migrated_trajectories: int,
        unfinished_at_end: int,
        events: tuple[dict[str, Any], ...] | None,
    ) -> SimResult:
        steps: list[StepStats] = []
        prev_end = 0.0
        for step in sorted(self._step_rows):
            row = self._step_rows[step]
            if "end_s" not in row:
                continue
            steps.append(StepStats(step=step, duration_s=row["end_s"] - prev_end, **row))
            prev_end = row["end_s"]
        if len(steps) >= 2:
            step_time = (steps[-1].end_s - steps[0].end_s) / (len(steps) - 1)
            tokens = sum(s.num_tokens for s in steps[1:]) / (len(steps) - 1)
        elif steps:
            step_time, tokens = steps[0].end_s, float(steps[0].num_tokens)
        else:
            step_time, tokens = end_s, 0.0
        wall = end_s if end_s > 0 else 1.0
        n, apg = self.num_engines, self.accelerators_per_group
        busy = sum(self.e_busy)
        train_busy = min(self.train_busy_s, wall)
        if self.colocated:
            # one pool of n * apg devices, alternately generating and training
            used = apg * busy + n * apg * train_busy
            total = n * apg * wall
        else:
            used = apg * busy + self.train_accelerators * train_busy
            total = (n * apg + self.train_accelerators) * wall
        live_max = max((len(v) for _, v in self.live_timeline), default=1)
        return SimResult(
            mode=mode,
            seed=seed,
            steps=tuple(steps),
            total_time_s=end_s,
            step_time_s=step_time,
            samples_per_s=batch_samples / step_time if step_time > 0 else 0.0,
            tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
            rollout_busy_fraction=busy / (n * wall),
            rollout_slot_occupancy=sum(self.e_slot_time) / (n * self.slots * wall),
            train_busy_fraction=train_busy / wall,
            bubble_fraction=max(0.0, 1.0 - used / total),
            staleness_histogram=tuple(sorted(self.staleness.items())),
            live_versions=tuple(self.live_timeline),
            max_live_versions=live_max,
            max_engine_versions=self.max_engine_versions,
            weight_load_s_total=self.load_s_total,
            weight_loads=self.loads,
            weight_publish_s_total=self.publish_s_total,
            extra_weight_bytes_per_group=extra_weight_bytes_per_group,
            mixed_trajectories=mixed_trajectories,
            migrated_trajectories=migrated_trajectories,
            unfinished_at_end=unfinished_at_end,
            num_sim_events=self.num_events,
            events=events,
        )
