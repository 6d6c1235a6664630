"""The version-schedule: trace event schema, the version-schedule graph, its checker, and exports.

- ``events``: the trace schema (plain dicts, JSON-lines friendly) and ``parse_trace``.
- ``graph``: ``build_schedule_graph(events) -> networkx.DiGraph`` of versions, trajectories, steps.
- ``checker``: ``check_trace(events, k=, allow_version_mixing=) -> CheckReport`` (three constraints).
- ``export``: ``graph_to_json``, ``graph_to_dot``, ``timeline_html`` (self-contained HTML + SVG).

The simulator and the runtime both write this trace; the same checker audits both.
"""

from __future__ import annotations

from planner.schedule.checker import CheckReport, Violation, check_trace
from planner.schedule.events import SCHEMA, TraceError, parse_trace, parse_traj_id
from planner.schedule.export import graph_to_dot, graph_to_json, timeline_html
from planner.schedule.graph import build_schedule_graph

__all__ = [
    "SCHEMA",
    "CheckReport",
    "TraceError",
    "Violation",
    "build_schedule_graph",
    "check_trace",
    "graph_to_dot",
    "graph_to_json",
    "parse_trace",
    "parse_traj_id",
    "timeline_html",
]
