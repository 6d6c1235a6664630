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
        self._hosted: list[set[int]] = [{0} for _ in range(num_engines)]
        """Versions each engine holds loaded (one, or several on multi-version engines)."""
        self._serving: list[set[int]] = [{0} for _ in range(num_engines)]
        """Versions each engine serves: those it holds, but none while it loads new weights in their place."""
        self._engine_versions: Counter[int] = Counter({0: num_engines})
        """version -> engines serving it."""
        self.max_engine_versions = 1
        self._e_ahead: list[list[tuple[float, float]]] = [[] for _ in range(num_engines)]
        """Per engine: busy intervals charged when they start (prefills, KV sends) that may still end after ``now``;
        ``result`` takes off what lies past the end of the run."""
        self._train_ahead: list[tuple[float, float]] = []
        """The same for the trainer (training steps, publishes: the last publish starts as the run ends)."""
        self._last_publish = (0.0, 0.0)
        self._loading: dict[int, tuple[float, float]] = {}
        """engine -> (start, end) of the weight load in progress."""

    def engine_busy(self, engine: int, start: float, duration_s: float, now: float) -> None:
        """Charge engine work from ``start`` (>= ``now``) for ``duration_s`` (a prefill, a KV send)."""
        self.e_busy[engine] += duration_s
        ahead = self._e_ahead[engine]  # _charge_ahead, inlined: one call per admitted group
        if ahead and ahead[-1][1] <= now:
            ahead.clear()
        ahead.append((start, start + duration_s))

    def trainer_busy(self, start: float, duration_s: float) -> None:
        """Charge trainer work (a training step, a publish) from ``start``, which is now."""
        self.train_busy_s += duration_s
        _charge_ahead(self._train_ahead, start, duration_s, start)

    def train_retimed(self, end_s: float) -> None:
        """The running training step (the trainer's latest work) now ends at ``end_s``."""
        start, end = self._train_ahead[-1]
        self.train_busy_s += end_s - end
        self._train_ahead[-1] = (start, end_s)

    def train_idled(self, step: int, idle_s: float) -> None:
        """An early step's trainer waited ``idle_s`` until now for a group that joins it (counted as its wait)."""
        self._step_rows[step]["trainer_wait_s"] += idle_s

    def publish_started(self, start: float, duration_s: float) -> None:
        """The trainer publishes a version from ``start`` (now) for ``duration_s``."""
        self.trainer_busy(start, duration_s)
        self.publish_s_total += duration_s
        self._last_publish = (start, start + duration_s)

    def load_started(self, engine: int, start: float, duration_s: float) -> None:
        self.loads += 1
        self.load_s_total += duration_s
        self._loading[engine] = (start, start + duration_s)

    def load_finished(self, engine: int) -> None:
        self._loading.pop(engine, None)

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
        self.trainer_busy(now, duration_s)
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

    def engine_loaded(self, engine: int, version: int, keep_others: bool) -> None:
        """``engine`` serves ``version`` now, beside the versions it holds if ``keep_others`` (a multi-version engine
        that still decodes them), else instead of them."""
        hosted, serving, ev = self._hosted[engine], self._serving[engine], self._engine_versions
        if not keep_others:
            self.engine_unloading(engine)
            hosted.clear()
        hosted.add(version)
        if version not in serving:
            serving.add(version)
            ev[version] += 1
        self.max_engine_versions = max(self.max_engine_versions, len(ev))

    def engine_unloading(self, engine: int) -> None:
        """``engine`` pauses to load new weights in place of its versions: it serves none of them meanwhile (they
        stay in ``hosted_versions`` until the load ends)."""
        serving = self._serving[engine]
        for v in serving:
            self._drop(self._engine_versions, v)
        serving.clear()

    def hosted_versions(self, engine: int) -> int:
        """Versions whose weights ``engine`` holds now."""
        return len(self._hosted[engine])

    def engine_dropped(self, engine: int, version: int) -> None:
        """A multi-version engine freed ``version``'s weights."""
        self._hosted[engine].discard(version)
        serving = self._serving[engine]
        if version in serving:
            serving.discard(version)
            self._drop(self._engine_versions, version)

    @staticmethod
    def _drop(ev: Counter[int], version: int) -> None:
        ev[version] -= 1
        if ev[version] == 0:
            del ev[version]

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
        swap_s_total: float = 0.0,
        suspend_wall_s_total: float = 0.0,
        preemptions: int = 0,
        recomputed_sequences: int = 0,
        recomputed_tokens: float = 0.0,
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
        # work charged when it started counts only up to the end of the run
        busy = sum(self.e_busy) - sum(_past(ahead, end_s) for ahead in self._e_ahead)
        train_busy = min(self.train_busy_s - _past(self._train_ahead, end_s), wall)
        load_s = self.load_s_total - _past(list(self._loading.values()), end_s)
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
            weight_load_s_total=load_s,
            weight_loads=self.loads,
            weight_publish_s_total=self.publish_s_total - _past([self._last_publish], end_s),
            extra_weight_bytes_per_group=extra_weight_bytes_per_group,
            mixed_trajectories=mixed_trajectories,
            migrated_trajectories=migrated_trajectories,
            unfinished_at_end=unfinished_at_end,
            num_sim_events=self.num_events,
            events=events,
            swap_s_total=swap_s_total,
            suspend_wall_s_total=suspend_wall_s_total,
            preemptions=preemptions,
            recomputed_sequences=recomputed_sequences,
            recomputed_tokens=recomputed_tokens,
        )


def _charge_ahead(intervals: list[tuple[float, float]], start: float, duration_s: float, now: float) -> None:
    """Record one more interval of a sequence that does not overlap itself; forget the earlier ones once the latest has
    ended by ``now`` (the run cannot end before ``now``)."""
    if intervals and intervals[-1][1] <= now:
        intervals.clear()
    intervals.append((start, start + duration_s))


def _past(intervals: list[tuple[float, float]], end_s: float) -> float:
    """Seconds of ``intervals`` after ``end_s``."""
    return sum(e - max(s, end_s) for s, e in intervals if e > end_s)
