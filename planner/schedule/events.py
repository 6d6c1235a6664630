"""Trace event schema: plain dicts, one per line in a JSON-lines file, written by simulator and runtime.

Every event has ``t`` (seconds since the run started, a number >= 0) and ``type``. Trajectory ids are
strings ``"g{group}/{sample}"``, both numbers in ASCII digits without leading zeros (``g12/3``; not ``g012/3``
nor ``g１/3``), so that one trajectory has one id. Versions and steps are ints; version 0 is the initial weights
and training step ``s`` produces version ``s``.

=====================  ======================================================================
type                   fields (besides ``t``, ``type``)
=====================  ======================================================================
run_config             mode: str, k: int, allow_version_mixing: bool, num_rollout_groups: int >= 1,
                       slots_per_group: int >= 1  (optional header; exporters use it; with it, every
                       ``rollout_group``, ``src`` and ``dst`` must be < num_rollout_groups)
admitted               traj, version, rollout_group
finished               traj, num_tokens, spans: [[version, tokens], ...] (in generation order;
                       tokens sum to num_tokens), rollout_group
migrated               src, dst, trajs: [traj, ...]  (moved with their KV cache)
weights_published      version
weights_load_started   rollout_group, version, source ("trainer" | "peer")
weights_loaded         rollout_group, version
version_dropped        rollout_group, version  (multi-version engine freed a drained version)
train_step             step, start_t, consumed: [traj, ...], produced_version (== step);
                       ``t`` is when the step finished; optional joined: {traj: t} (an early step: those of
                       consumed still generating at start_t, each with when it joined the step, within
                       [start_t, t])
discarded              traj, reason: str  (dropped on purpose; never consumed)
regenerated            traj, version  (earlier tokens dropped; generation restarts on version; it
                       supersedes an earlier ``discarded`` or ``unfinished_at_end`` of traj: that attempt's
                       accounting, the new attempt must be consumed or accounted for again)
unfinished_at_end      traj, finished: bool  (admitted, not consumed when the run ended; finished: whether it
                       had finished since it was last admitted or regenerated)
resumed                step  (a new attempt continues the trace from its checkpoint after step ``step``)
worker_restarted       rollout_group, version  (the engine process died and was restarted on version)
rollout_suspended      (none)  colocated streaming: every engine has stopped, its in-flight requests kept
rollout_resumed        (none)  every engine serves again
=====================  ======================================================================

A run that stops and resumes keeps one append-only trace: the new attempt writes ``resumed``, then
``regenerated`` + ``admitted`` for every trajectory admitted before that no checkpointed step consumed.

``parse_trace`` validates an external trace and collects every problem before raising.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

_INT, _STR, _BOOL, _NUM, _SPANS, _IDS, _TRAJ = "int", "str", "bool", "number", "spans", "ids", "traj"

SCHEMA: dict[str, dict[str, str]] = {
    "run_config": {
        "mode": _STR, "k": _INT, "allow_version_mixing": _BOOL, "num_rollout_groups": _INT, "slots_per_group": _INT,
    },
    "admitted": {"traj": _TRAJ, "version": _INT, "rollout_group": _INT},
    "finished": {"traj": _TRAJ, "num_tokens": _INT, "spans": _SPANS, "rollout_group": _INT},
    "migrated": {"src": _INT, "dst": _INT, "trajs": _IDS},
    "weights_published": {"version": _INT},
    "weights_load_started": {"rollout_group": _INT, "version": _INT, "source": _STR},
    "weights_loaded": {"rollout_group": _INT, "version": _INT},
    "version_dropped": {"rollout_group": _INT, "version": _INT},
    "train_step": {"step": _INT, "start_t": _NUM, "consumed": _IDS, "produced_version": _INT},
    "discarded": {"traj": _TRAJ, "reason": _STR},
    "regenerated": {"traj": _TRAJ, "version": _INT},
    "unfinished_at_end": {"traj": _TRAJ, "finished": _BOOL},
    "resumed": {"step": _INT},
    "worker_restarted": {"rollout_group": _INT, "version": _INT},
    "rollout_suspended": {},
    "rollout_resumed": {},
}

_OPTIONAL = {("train_step", "joined")}
"""Fields an event may leave out (checked in ``event_problems``)."""


class TraceError(ValueError):
    """A malformed trace; ``problems`` lists every ``events[i]: ...`` message found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{len(problems)} problem(s) in trace:\n  {shown}{more}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool)) and math.isfinite(x)


_TRAJ_ID = re.compile(r"g(0|[1-9][0-9]*)/(0|[1-9][0-9]*)", re.ASCII)
"""A trajectory id: ASCII digits only (``str.isdigit`` also takes '²', '٣', '１'), no leading zeros (``g01/0`` would
alias ``g1/0`` wherever the numbers are parsed)."""
_TRAJ_FORM = "'g<group>/<sample>' (ASCII digits, no leading zeros)"
_POSITIVE = {("run_config", "num_rollout_groups"), ("run_config", "slots_per_group")}
"""Fields that must be >= 1: a run has at least one rollout group, and a group at least one slot."""
_GROUP_FIELDS = ("rollout_group", "src", "dst")


def _is_traj(x: Any) -> bool:
    return isinstance(x, str) and _TRAJ_ID.fullmatch(x) is not None


def _field_problem(kind: str, value: Any) -> str | None:
    if kind == _INT:
        return None if _is_int(value) and value >= 0 else "must be an integer >= 0"
    if kind == _NUM:
        return None if _is_num(value) and value >= 0 else "must be a finite number >= 0"
    if kind == _BOOL:
        return None if isinstance(value, bool) else "must be true or false"
    if kind == _STR:
        return None if isinstance(value, str) and value else "must be a non-empty string"
    if kind == _TRAJ:
        return None if _is_traj(value) else f"must be a trajectory id {_TRAJ_FORM}"
    if kind == _IDS:
        if not isinstance(value, list | tuple):
            return "must be a list of trajectory ids"
        bad = [v for v in value if not _is_traj(v)]
        return f"has malformed trajectory ids {bad[:3]!r} (expected {_TRAJ_FORM})" if bad else None
    if kind == _SPANS:
        if not isinstance(value, list | tuple) or not value:
            return "must be a non-empty list of [version, tokens] pairs"
        for span in value:
            if not (isinstance(span, list | tuple) and len(span) == 2 and all(_is_int(x) and x >= 0 for x in span)):
                return f"has a malformed span {span!r} (expected [version, tokens] with ints >= 0)"
        return None
    raise AssertionError(kind)


def event_problems(index: int, event: Any) -> list[str]:
    """Every schema problem of one event (empty when it is valid)."""
    where = f"events[{index}]"
    if not isinstance(event, dict):
        return [f"{where}: must be an object, got {type(event).__name__}"]
    problems = []
    etype = event.get("type")
    if etype not in SCHEMA:
        return [f"{where}: unknown type {etype!r}; expected one of {', '.join(sorted(SCHEMA))}"]
    if "t" not in event or not _is_num(event["t"]) or event["t"] < 0:
        problems.append(f"{where} ({etype}): 't' must be a finite number of seconds >= 0, got {event.get('t')!r}")
    fields = SCHEMA[etype]
    for name, kind in fields.items():
        if name not in event:
            problems.append(f"{where} ({etype}): missing field {name!r}")
            continue
        problem = _field_problem(kind, event[name])
        if problem is None and (etype, name) in _POSITIVE and event[name] < 1:
            problem = "must be an integer >= 1"
        if problem:
            problems.append(f"{where} ({etype}): {name!r} {problem}, got {event[name]!r}")
    for name in event:
        if name not in fields and name not in ("t", "type") and (etype, name) not in _OPTIONAL:
            problems.append(f"{where} ({etype}): unknown field {name!r}; allowed: {', '.join(sorted(fields))}")
    if etype == "finished" and not problems:
        total = sum(tokens for _, tokens in event["spans"])
        if total != event["num_tokens"]:
            problems.append(f"{where} (finished): spans sum to {total} tokens but num_tokens is {event['num_tokens']}")
    if etype == "train_step" and not problems:
        if event["produced_version"] != event["step"]:
            problems.append(
                f"{where} (train_step): step {event['step']} must produce version {event['step']}, "
                f"not {event['produced_version']}"
            )
        if event["start_t"] > event["t"]:
            problems.append(f"{where} (train_step): start_t {event['start_t']} is after t {event['t']}")
        joined = event.get("joined", {})
        if not isinstance(joined, dict) or not all(isinstance(k, str) and _is_num(v) for k, v in joined.items()):
            problems.append(f"{where} (train_step): 'joined' must map trajectory ids to times, got {joined!r}")
        else:
            consumed = set(event["consumed"])
            for traj, t in joined.items():
                if traj not in consumed:
                    problems.append(f"{where} (train_step): {traj} joined step {event['step']} but is not consumed")
                elif not event["start_t"] <= t <= event["t"]:
                    problems.append(f"{where} (train_step): {traj} joined at t={t}, outside the step "
                                    f"[{event['start_t']}, {event['t']}]")
    if etype == "weights_load_started" and not problems and event["source"] not in ("trainer", "peer"):
        problems.append(f"{where} (weights_load_started): source must be 'trainer' or 'peer', got {event['source']!r}")
    return problems


def parse_trace(events: Iterable[Any]) -> list[dict[str, Any]]:
    """Validate a trace and return its events sorted by ``t`` (stable); raise ``TraceError`` listing all problems."""
    checked: list[tuple[int, dict[str, Any]]] = []
    problems: list[str] = []
    for i, event in enumerate(events):
        found = event_problems(i, event)
        if found:
            problems.extend(found)
        else:
            checked.append((i, event))
    problems.extend(_group_problems(checked))
    if problems:
        raise TraceError(problems)
    return sorted((event for _, event in checked), key=lambda e: e["t"])


def _group_problems(checked: list[tuple[int, dict[str, Any]]]) -> list[str]:
    """With a ``run_config`` header (the first by time, as the exporters read it), every rollout group an event names
    must be one of its ``num_rollout_groups``. ``checked``: ``(index in the trace, valid event)``, in trace order."""
    configs = [(e["t"], i, e["num_rollout_groups"]) for i, e in checked if e["type"] == "run_config"]
    if not configs:
        return []
    _, index, groups = min(configs)
    return [
        f"events[{i}] ({e['type']}): {name!r} {e[name]} is not a rollout group of the run: events[{index}] "
        f"(run_config) has num_rollout_groups {groups} (groups 0..{groups - 1})"
        for i, e in checked for name in _GROUP_FIELDS if name in e and e[name] >= groups
    ]


def parse_traj_id(traj: str) -> tuple[int, int]:
    """``"g12/3" -> (12, 3)``; raises ``TraceError`` for anything but ``g<group>/<sample>`` in ASCII digits."""
    match = _TRAJ_ID.fullmatch(traj) if isinstance(traj, str) else None
    if match is None:
        raise TraceError([f"trajectory id {traj!r} is not of the form {_TRAJ_FORM}"])
    return int(match[1]), int(match[2])
