"""One checker for simulated schedules and real runs: the three constraints, each with witnesses.

1. consistency -- every token of a trajectory comes from one version: a finished trajectory whose first span is not
   its admission version violates it, whatever the mixing policy; one with tokens from more than one version violates
   it too unless version mixing is allowed, and is then listed in ``mixed`` instead.
2. integrity -- every admitted trajectory is consumed by exactly one training step, after it finished, or is
   accounted for by ``discarded`` or ``unfinished_at_end`` (never both; a later ``regenerated`` supersedes either, and
   the new attempt must be used or accounted for again); nothing is consumed that was not admitted.
   The trace must also be possible: each attempt (an admission, or a ``regenerated`` and its admission) finishes at
   most once; admitted <= finished <= the consuming step's ``start_t`` (or the time it joined an early step, within
   the step, ``joined``); every version a trajectory is admitted,
   regenerated or finished on exists by then (version 0, or a ``train_step`` that produced it ended by then, and its
   ``weights_published``, if the trace has one, came by then); a step number is trained once; and
   ``unfinished_at_end``'s ``finished`` says whether the trajectory had finished since it was last (re)admitted.
3. staleness -- a trajectory of version v (the oldest span's version with mixing) consumed by the step producing v'
   satisfies ``0 <= v' - v - 1 <= k``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from planner.schedule.events import parse_trace
from planner.schedule.graph import consumed_by, graph_of_parsed

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


@dataclass(kw_only=True, slots=True)
class _Attempt:
    """One generation of a trajectory: from its admission, or from a ``regenerated`` event, to the next one."""

    begin_t: float | None
    """The ``regenerated`` event that began it (None for the first attempt)."""
    admitted_t: float | None = None
    """Its first ``admitted`` event."""
    finishes: list[float] = field(default_factory=list)

    @property
    def start_t(self) -> float | None:
        return self.admitted_t if self.admitted_t is not None else self.begin_t


@dataclass(kw_only=True, slots=True)
class _Life:
    """What the trace says happened to one trajectory, in time order (the graph keeps the outcome)."""

    attempts: list[_Attempt] = field(default_factory=list)
    version_uses: list[tuple[float, str, int]] = field(default_factory=list)
    """``(t, how, version)``: admitted / regenerated on a version, or finished with tokens from it."""
    consumptions: list[tuple[int, float]] = field(default_factory=list)
    """``(step, t)`` per ``train_step`` event listing it: its ``start_t``, or when it joined the step."""
    wrong_flags: list[tuple[float, bool, tuple[float, ...]]] = field(default_factory=list)
    """``unfinished_at_end`` events whose ``finished`` is wrong: ``(t, finished, finishes of the attempt)``."""

    def attempt(self) -> _Attempt:
        if not self.attempts:
            self.attempts.append(_Attempt(begin_t=None))
        return self.attempts[-1]


def mixes_versions(spans: Iterable[tuple[int, int]]) -> bool:
    """Whether a trajectory's ``(version, tokens)`` spans generate tokens on more than one version. An update that
    interrupts a request before its first token leaves an empty span: not a mix (the runtime's count of version-mixed
    trajectories uses this rule too)."""
    return len({v for v, tokens in spans if tokens > 0}) > 1


def _lives(events: list[dict[str, Any]]) -> dict[str, _Life]:
    lives: dict[str, _Life] = {}
    for e in events:
        etype, t = e["type"], e["t"]
        if etype == "admitted":
            life = lives.setdefault(e["traj"], _Life())
            attempt = life.attempt()
            if attempt.admitted_t is None:
                attempt.admitted_t = t
            life.version_uses.append((t, "was admitted on", e["version"]))
        elif etype == "regenerated":
            life = lives.setdefault(e["traj"], _Life())
            life.attempts.append(_Attempt(begin_t=t))
            life.version_uses.append((t, "was regenerated on", e["version"]))
        elif etype == "finished":
            life = lives.setdefault(e["traj"], _Life())
            life.attempt().finishes.append(t)
            for v in dict.fromkeys(v for v, _ in e["spans"]):
                life.version_uses.append((t, "finished with tokens of", v))
        elif etype == "train_step":
            joined = e.get("joined", {})
            for traj in e["consumed"]:
                lives.setdefault(traj, _Life()).consumptions.append((e["step"], joined.get(traj, e["start_t"])))
        elif etype == "unfinished_at_end":
            life = lives.setdefault(e["traj"], _Life())
            finishes = tuple(life.attempt().finishes)
            if e["finished"] != bool(finishes):
                life.wrong_flags.append((t, e["finished"], finishes))
    return lives


def _version_clock(events: list[dict[str, Any]]) -> Callable[[int, float], str | None]:
    """``missing(v, t)``: why version ``v`` did not exist at ``t`` (None if it did). Version 0 always exists; a
    version ``v > 0`` once a ``train_step`` producing it ended and, if the trace has a ``weights_published`` of it
    (a resumed run's first version has none when the kill came between its step's commit and its publish; the
    controller publishes it again at start-up, untraced), once that was published."""
    produced: dict[int, float] = {}
    published: dict[int, float] = {}
    for e in events:  # in time order: the first of each is the earliest
        if e["type"] == "train_step":
            produced.setdefault(e["produced_version"], e["t"])
        elif e["type"] == "weights_published":
            published.setdefault(e["version"], e["t"])

    def missing(v: int, t: float) -> str | None:
        if v == 0:
            return None
        if v not in produced:
            return f"no train_step produces v{v}"
        if produced[v] > t:
            return f"step {v}, which produces it, ended at t={produced[v]}"
        if published.get(v, t) > t:
            return f"v{v} was published at t={published[v]}"
        return None

    return missing


def _times(ts: Iterable[float]) -> str:
    return ", ".join(f"t={t}" for t in ts)


def check_trace(events: list[dict[str, Any]], *, k: int, allow_version_mixing: bool) -> CheckReport:
    """Validate ``events`` (raises ``TraceError`` if malformed) and check the three constraints."""
    parsed = parse_trace(events)
    graph = graph_of_parsed(parsed)
    lives = _lives(parsed)
    missing = _version_clock(parsed)
    violations: list[Violation] = []
    for s in sorted(n[1] for n in graph if n[0] == "step"):
        step_node = graph.nodes[("step", s)]
        if step_node["repeats"]:
            recorded = [(step_node["start_t"], step_node["t"]), *step_node["repeats"]]
            violations.append(Violation(
                constraint="integrity", traj="", versions=(s,), step=s,
                message=f"step {s} is recorded {len(recorded)} times: train_step "
                + " and ".join(f"start_t={a} t={b}" for a, b in recorded),
            ))
    mixed, unfinished, discarded = [], [], []
    staleness: Counter[int] = Counter()
    consumed_total = 0
    trajs = sorted((n[1] for n in graph if n[0] == "traj"), key=_traj_key)
    for traj in trajs:
        node = graph.nodes[("traj", traj)]
        life = lives.get(traj, _Life())
        admitted_v = node["admitted_version"]
        span_versions = tuple(dict.fromkeys(v for v, _ in node["spans"]))
        versions = span_versions or ((admitted_v,) if admitted_v is not None else ())
        # ---- consistency
        if span_versions and admitted_v is not None and span_versions[0] != admitted_v:
            violations.append(Violation(
                constraint="consistency", traj=traj, versions=(admitted_v, *span_versions), step=None,
                message=f"{traj} was admitted on v{admitted_v} but its first tokens come from v{span_versions[0]}",
            ))
        if mixes_versions(node["spans"]):
            if allow_version_mixing:
                mixed.append(traj)
            else:
                violations.append(Violation(
                    constraint="consistency", traj=traj, versions=span_versions, step=None,
                    message=f"{traj} mixes versions {list(span_versions)} (spans {node['spans']})",
                ))
        # ---- integrity
        def integrity(message: str, *, step: int | None = None, vs: tuple[int, ...] = versions, of: str = traj) -> None:
            violations.append(Violation(constraint="integrity", traj=of, versions=vs, step=step, message=message))

        uses = consumed_by(graph, traj)
        n_uses = sum(count for _, count in uses)
        steps = tuple(s for s, _ in uses)
        if node["discarded"] is not None:
            discarded.append(traj)
        if node["unfinished_at_end"] is not None:
            unfinished.append(traj)
        accounted = (node["discarded"] is not None) + (node["unfinished_at_end"] is not None)
        if node["admitted_t"] is None:
            integrity(f"{traj} appears (steps {list(steps)}) but was never admitted", step=steps[0] if steps else None)
        elif node["admissions"] > 1 + len(node["regenerated"]):
            integrity(f"{traj} was admitted {node['admissions']} times without a 'regenerated' event")
        for attempt in life.attempts:
            if len(attempt.finishes) > 1:
                integrity(f"{traj} finished {len(attempt.finishes)} times without a 'regenerated' between "
                          f"({_times(attempt.finishes)})")
            early = [f for f in attempt.finishes if attempt.start_t is not None and f < attempt.start_t]
            if early:
                how = "admitted" if attempt.admitted_t is not None else "regenerated"
                integrity(f"{traj} finished ({_times(early)}) before it was {how} (t={attempt.start_t})")
        for t, how, v in life.version_uses:
            why = missing(v, t)
            if why is not None:
                integrity(f"{traj} {how} v{v} at t={t}, before v{v} existed: {why}", vs=(v,))
        if n_uses + accounted == 0 and node["admitted_t"] is not None:
            integrity(f"{traj} was admitted on v{admitted_v} but never consumed, discarded or accounted for")
        elif n_uses + accounted > 1:
            how_used = [f"consumed by step {s}" + (f" x{c}" if c > 1 else "") for s, c in uses]
            if node["discarded"] is not None:
                how_used.append(f"discarded ({node['discarded']})")
            if node["unfinished_at_end"] is not None:
                how_used.append("unfinished_at_end")
            integrity(f"{traj} is used or accounted for {n_uses + accounted} times: {', '.join(how_used)}",
                      step=steps[-1] if steps else None)
        last = life.attempts[-1] if life.attempts else None
        for s, start in dict.fromkeys(life.consumptions):  # each train_step event against its own start
            if node["admitted_t"] is not None and last is not None and last.start_t is not None \
                    and last.start_t > start:
                integrity(f"{traj} consumed by step {s} at t={start} before it was admitted (t={last.start_t})",
                          step=s)
            if node["finished_t"] is None or node["finished_t"] > start:
                integrity(f"{traj} consumed by step {s} at t={start} before it finished"
                          + ("" if node["finished_t"] is None else f" (t={node['finished_t']})"), step=s)
        for t, flag, finishes in life.wrong_flags:
            integrity(f"{traj} is recorded unfinished_at_end at t={t} with finished={str(flag).lower()}, but "
                      + (f"it had finished ({_times(finishes)})" if finishes else
                         "it had not finished since it was last admitted"))
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
