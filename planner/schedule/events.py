"""Trace event schema: plain dicts, one per line in a JSON-lines file, written by simulator and runtime.

Every event has ``t`` (seconds since the run started, a number >= 0) and ``type``. Trajectory ids are
strings ``"g{group}/{sample}"``. Versions and steps are ints; version 0 is the initial weights and
training step ``s`` produces version ``s``.

=====================  ======================================================================
type                   fields (besides ``t``, ``type``)
=====================  ======================================================================
run_config             mode: str, k: int, allow_version_mixing: bool, num_rollout_groups: int,
                       slots_per_group: int  (optional header; exporters use it)
admitted               traj, version, rollout_group
finished               traj, num_tokens, spans: [[version, tokens], ...] (in generation order;
                       tokens sum to num_tokens), rollout_group
migrated               src, dst, trajs: [traj, ...]  (moved with their KV cache)
weights_published      version
weights_load_started   rollout_group, version, source ("trainer" | "peer")
weights_loaded         rollout_group, version
version_dropped        rollout_group, version  (multi-version engine freed a drained version)
train_step             step, start_t, consumed: [traj, ...], produced_version (== step);
                       ``t`` is when the step finished
discarded              traj, reason: str  (dropped on purpose; never consumed)
regenerated            traj, version  (earlier tokens dropped; generation restarts on version; it
                       supersedes an earlier ``unfinished_at_end`` of traj, from an attempt that stopped)
unfinished_at_end      traj, finished: bool  (admitted, not consumed when the run ended)
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


def _is_traj(x: Any) -> bool:
    if not isinstance(x, str) or not x.startswith("g") or x.count("/") != 1:
        return False
    group, sample = x[1:].split("/")
    return group.isdigit() and sample.isdigit()


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
        return None if _is_traj(value) else "must be a trajectory id 'g<group>/<sample>'"
    if kind == _IDS:
        if not isinstance(value, list | tuple):
            return "must be a list of trajectory ids"
        bad = [v for v in value if not _is_traj(v)]
        return f"has malformed trajectory ids {bad[:3]!r} (expected 'g<group>/<sample>')" if bad else None
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
        if problem:
            problems.append(f"{where} ({etype}): {name!r} {problem}, got {event[name]!r}")
    for name in event:
        if name not in fields and name not in ("t", "type"):
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
    if etype == "weights_load_started" and not problems and event["source"] not in ("trainer", "peer"):
        problems.append(f"{where} (weights_load_started): source must be 'trainer' or 'peer', got {event['source']!r}")
    return problems


def parse_trace(events: Iterable[Any]) -> list[dict[str, Any]]:
    """Validate a trace and return its events sorted by ``t`` (stable); raise ``TraceError`` listing all problems."""
    checked: list[dict[str, Any]] = []
    problems: list[str] = []
    for i, event in enumerate(events):
        found = event_problems(i, event)
        if found:
            problems.extend(found)
        else:
            checked.append(event)
    if problems:
        raise TraceError(problems)
    return sorted(checked, key=lambda e: e["t"])


def parse_traj_id(traj: str) -> tuple[int, int]:
    """``"g12/3" -> (12, 3)``."""
    group, sample = traj[1:].split("/")
    return int(group), int(sample)
