"""One checker for simulated schedules and real runs: the three constraints, each with witnesses.

1. consistency -- every token of a trajectory comes from one version: a finished trajectory with
   tokens from more than one version (or whose first span is not its admission version) violates it,
   unless version mixing is allowed; then it is listed in ``mixed`` instead.
2. integrity -- every admitted trajectory is consumed by exactly one training step, after it
   finished, or is accounted for by ``discarded`` or ``unfinished_at_end`` (never both); nothing is
   consumed that was not admitted.
3. staleness -- a trajectory of version v (the oldest span's version with mixing) consumed by the
   step producing v' satisfies ``0 <= v' - v - 1 <= k``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from planner.schedule.graph import build_schedule_graph, consumed_by

Constraint = Literal["consistency", "integrity", "staleness"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Violation:
    constraint: Constraint
    traj: str
    versions: tuple[int, ...]
    """Versions involved (the spans' versions, or the admitted version)."""
    step: int | None
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckReport:
    violations: tuple[Violation, ...]
    mixed: tuple[str, ...]
    """Trajectories spanning several versions, allowed because mixing is allowed."""
    unfinished_at_end: tuple[str, ...]
    discarded: tuple[str, ...]
    num_trajectories: int
    num_consumed: int
    staleness_histogram: tuple[tuple[int, int], ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    def of(self, constraint: Constraint) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.constraint == constraint)


def check_trace(events: list[dict[str, Any]], *, k: int, allow_version_mixing: bool) -> CheckReport:
    """Validate ``events`` (raises ``TraceError`` if malformed) and check the three constraints."""
    graph = build_schedule_graph(events)
    violations: list[Violation] = []
    mixed, unfinished, discarded = [], [], []
    staleness: Counter[int] = Counter()
    consumed_total = 0
    trajs = sorted((n[1] for n in graph if n[0] == "traj"), key=_traj_key)
    for traj in trajs:
        node = graph.nodes[("traj", traj)]
        admitted_v = node["admitted_version"]
        span_versions = tuple(dict.fromkeys(v for v, _ in node["spans"]))
        versions = span_versions or ((admitted_v,) if admitted_v is not None else ())
        # ---- consistency
        if span_versions and admitted_v is not None and span_versions[0] != admitted_v:
            violations.append(Violation(
                constraint="consistency", traj=traj, versions=(admitted_v, *span_versions), step=None,
                message=f"{traj} was admitted on v{admitted_v} but its first tokens come from v{span_versions[0]}",
            ))
        # an update that interrupts a request before its first token leaves an empty span: not a mix
        if len({v for v, tokens in node["spans"] if tokens > 0}) > 1:
            if allow_version_mixing:
                mixed.append(traj)
            else:
                violations.append(Violation(
                    constraint="consistency", traj=traj, versions=span_versions, step=None,
                    message=f"{traj} mixes versions {list(span_versions)} (spans {node['spans']})",
                ))
        # ---- integrity
        uses = consumed_by(graph, traj)
        n_uses = sum(count for _, count in uses)
        steps = tuple(s for s, _ in uses)
        if node["discarded"] is not None:
            discarded.append(traj)
        if node["unfinished_at_end"] is not None:
            unfinished.append(traj)
        accounted = (node["discarded"] is not None) + (node["unfinished_at_end"] is not None)
        if node["admitted_t"] is None:
            violations.append(Violation(
                constraint="integrity", traj=traj, versions=versions, step=steps[0] if steps else None,
                message=f"{traj} appears (steps {list(steps)}) but was never admitted",
            ))
        elif node["admissions"] > 1 + len(node["regenerated"]):
            violations.append(Violation(
                constraint="integrity", traj=traj, versions=versions, step=None,
                message=f"{traj} was admitted {node['admissions']} times without a 'regenerated' event",
            ))
        if n_uses + accounted == 0 and node["admitted_t"] is not None:
            violations.append(Violation(
                constraint="integrity", traj=traj, versions=versions, step=None,
                message=f"{traj} was admitted on v{admitted_v} but never consumed, discarded or accounted for",
            ))
        elif n_uses + accounted > 1:
            how = [f"consumed by step {s}" + (f" x{c}" if c > 1 else "") for s, c in uses]
            if node["discarded"] is not None:
                how.append(f"discarded ({node['discarded']})")
            if node["unfinished_at_end"] is not None:
                how.append("unfinished_at_end")
            violations.append(Violation(
                constraint="integrity", traj=traj, versions=versions, step=steps[-1] if steps else None,
                message=f"{traj} is used or accounted for {n_uses + accounted} times: {', '.join(how)}",
            ))
        for s in steps:
            start = graph.nodes[("step", s)]["start_t"]
            if node["finished_t"] is None or node["finished_t"] > start:
                violations.append(Violation(
                    constraint="integrity", traj=traj, versions=versions, step=s,
                    message=f"{traj} consumed by step {s} at t={start} before it finished"
                    + ("" if node["finished_t"] is None else f" (t={node['finished_t']})"),
                ))
        # ---- staleness
        oldest = min(versions) if versions else None
        for s in steps:
            consumed_total += 1
            if oldest is None:
                continue
            produced = graph.nodes[("step", s)]["produced_version"]
            lag = produced - oldest - 1
            staleness[lag] += 1
            if lag > k or lag < 0:
                why = f"exceeds k={k}" if lag > k else "is negative (generated by weights the step had not produced)"
                violations.append(Violation(
                    constraint="staleness", traj=traj, versions=versions, step=s,
                    message=f"{traj} of v{oldest} consumed by step {s} producing v{produced}: lag {lag} {why}",
                ))
    return CheckReport(
        violations=tuple(violations),
        mixed=tuple(mixed),
        unfinished_at_end=tuple(unfinished),
        discarded=tuple(discarded),
        num_trajectories=len(trajs),
        num_consumed=consumed_total,
        staleness_histogram=tuple(sorted(staleness.items())),
    )


def _traj_key(traj: str) -> tuple[int, int, str]:
    try:
        group, sample = traj[1:].split("/")
        return int(group), int(sample), traj
    except ValueError:
        return (1 << 62, 0, traj)
