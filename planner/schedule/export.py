"""Exports of a schedule: JSON and Graphviz DOT of the graph, and a self-contained HTML timeline.

All functions return strings (no I/O here); ``dora`` or a bench script writes them to files.
The timeline has one row per rollout group (colour = the version most of its running requests use, opacity = slot
occupancy, grey = loading weights, or suspended for a colocated training step; a column only partly so is a lighter
grey, so every load shows however short) plus a trainer row (one box per training step) and dashed lines where a
version was published. It reads only the trace, so it draws simulated and real runs alike.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterator
from typing import Any

import networkx as nx

from planner.schedule.events import parse_trace, parse_traj_id

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac")


def _node_id(node: tuple[Any, Any]) -> str:
    kind, key = node
    return {"version": f"v{key}", "step": f"step{key}"}.get(kind, str(key))


def graph_to_json(graph: nx.DiGraph) -> str:
    """Deterministic compact JSON: ``{"nodes": [...], "edges": [...]}`` with string ids (``v3``, ``step2``,
    ``g1/0``), no trailing newline. Compact because an ``indent`` makes ``json`` skip its C encoder: a large run's
    graph then took 2-5x longer and 30% more bytes (``python -m json.tool`` indents it for reading)."""
    nodes = []
    for node in sorted(graph.nodes, key=lambda n: (n[0], str(n[1]))):
        attrs = {k: v for k, v in graph.nodes[node].items()}
        nodes.append({"id": _node_id(node), **attrs})
    edges = [
        {"src": _node_id(u), "dst": _node_id(v), **data}
        for u, v, data in sorted(graph.edges(data=True), key=lambda e: (_node_id(e[0]), _node_id(e[1])))
    ]
    return json.dumps({"run_config": graph.graph.get("run_config"), "nodes": nodes, "edges": edges},
                      sort_keys=True, separators=(",", ":"), default=list)


def _natural_key(node: tuple[Any, Any]) -> tuple[str, int, int, str]:
    """Versions and steps by number, trajectories by (group, sample): a node's place never depends on the order the
    trace mentioned it in."""
    kind, key = node
    if kind == "traj":
        try:
            group, sample = parse_traj_id(key)
        except ValueError:
            return kind, 1 << 62, 0, str(key)
        return kind, group, sample, str(key)
    return kind, key if isinstance(key, int) else 1 << 62, 0, str(key)


def graph_to_dot(graph: nx.DiGraph, *, max_trajectories: int = 2000) -> str:
    """Deterministic Graphviz DOT text; versions as boxes, steps as diamonds, trajectories as points (the first N by
    id: ``g<group>/<sample>`` in numeric order). Nodes and edges are sorted, so equivalent traces give the same text."""
    lines = ["digraph schedule {", "  rankdir=LR;", '  node [fontname="Helvetica"];']
    nodes = sorted(graph.nodes, key=_natural_key)
    trajs = [n for n in nodes if n[0] == "traj"][:max_trajectories]
    shown = set(trajs)
    for node in nodes:
        if node[0] == "version":
            lines.append(f'  "{_node_id(node)}" [shape=box, style=filled, fillcolor="{_PALETTE[node[1] % 10]}"];')
            shown.add(node)
        elif node[0] == "step":
            lines.append(f'  "{_node_id(node)}" [shape=diamond];')
            shown.add(node)
    for node in trajs:
        lines.append(f'  "{_node_id(node)}" [shape=point];')
    for u, v, data in sorted(graph.edges(data=True), key=lambda e: (_natural_key(e[0]), _natural_key(e[1]))):
        if u in shown and v in shown:
            lines.append(f'  "{_node_id(u)}" -> "{_node_id(v)}" [label="{data.get("kind", "")}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _occupancy_rows(events: list[dict[str, Any]], groups: int, end: float, columns: int):
    """Per rollout group and column: (time-averaged running sequences, version, loading fraction). While rollout is
    suspended for training (colocated streaming: ``rollout_suspended`` to ``rollout_resumed``) every group counts as
    loading, its requests kept but not running.

    A trajectory runs on the group that admitted it (or, after ``migrated``, on the destination) until it finishes,
    is regenerated (a restarted worker or a resumed run drops its tokens; its new admission counts again) or is left
    ``unfinished_at_end``. A column's version is the one most of the group's running trajectories belong to over it
    (time-weighted; a tie goes to the older): an engine hosting several versions serves the one its requests use,
    not the one it loaded last. An idle column has no running trajectory and keeps version 0 (drawn idle)."""
    width = end / columns
    area = [[0.0] * columns for _ in range(groups)]
    loading = [[0.0] * columns for _ in range(groups)]
    served: dict[tuple[int, int], dict[int, float]] = {}
    """(group, column) -> version -> running-trajectory seconds / width, for the columns where something ran."""
    active: list[dict[int, int]] = [{} for _ in range(groups)]
    """Per group: version -> trajectories of it running there now."""
    last_t = [0.0] * groups
    running: dict[str, tuple[int, int]] = {}
    """Trajectory -> (the group it runs on, its version)."""
    load_start: dict[int, float] = {}
    stopped_at: float | None = None

    def shares(t0: float, t1: float) -> Iterator[tuple[int, float]]:
        """``(column, fraction of the column)`` over [t0, t1) (the last column takes what runs past it). Column by
        column: stepping from edge to edge stalled where a float edge divided back into the column before."""
        if t1 <= t0:
            return
        for col in range(min(int(t0 / width), columns - 1), min(int(t1 / width), columns - 1) + 1):
            lo = max(t0, col * width)
            hi = t1 if col == columns - 1 else min(t1, (col + 1) * width)
            if hi > lo:
                yield col, (hi - lo) / width

    def move(r: int, t: float, version: int, delta: int) -> None:
        if stopped_at is None and active[r]:
            for col, share in shares(last_t[r], t):
                area[r][col] += share * sum(active[r].values())
                cell = served.setdefault((r, col), {})
                for v, n in active[r].items():
                    cell[v] = cell.get(v, 0.0) + share * n
        last_t[r] = t
        if delta:
            active[r][version] = active[r].get(version, 0) + delta
            if not active[r][version]:
                del active[r][version]

    def grey(r: int, t0: float, t1: float) -> None:
        for col, share in shares(t0, t1):
            loading[r][col] += share

    def release(traj: str, t: float) -> None:
        if traj in running:
            r, v = running.pop(traj)
            move(r, t, v, -1)

    for e in events:
        etype, t = e["type"], e["t"]
        if etype == "admitted":
            release(e["traj"], t)  # admitted again without a 'regenerated': it runs once, where admitted last
            running[e["traj"]] = (e["rollout_group"], e["version"])
            move(e["rollout_group"], t, e["version"], 1)
        elif etype in ("finished", "regenerated", "unfinished_at_end"):
            release(e["traj"], t)
        elif etype == "migrated":
            for traj in e["trajs"]:
                if traj in running:
                    v = running[traj][1]
                    release(traj, t)
                    running[traj] = (e["dst"], v)
                    move(e["dst"], t, v, 1)
        elif etype == "weights_load_started":
            load_start[e["rollout_group"]] = t
        elif etype == "weights_loaded":
            grey(e["rollout_group"], load_start.pop(e["rollout_group"], t), t)
        elif etype == "rollout_suspended":
            for r in range(groups):
                move(r, t, 0, 0)
            stopped_at = t
        elif etype == "rollout_resumed" and stopped_at is not None:
            for r in range(groups):
                grey(r, stopped_at, t)
                last_t[r] = t
            stopped_at = None
    for r in range(groups):
        move(r, end, 0, 0)
        if stopped_at is not None:  # suspended when the run ended
            grey(r, stopped_at, end)
    version = [[0] * columns for _ in range(groups)]
    for (r, col), by_version in served.items():
        version[r][col] = max(sorted(by_version), key=by_version.__getitem__)
    return area, version, loading


def timeline_html(events: list[dict[str, Any]], *, title: str = "dora schedule", columns: int = 600) -> str:
    """A self-contained HTML page with an inline SVG timeline of the trace."""
    evs = parse_trace(events)
    cfg = next((e for e in evs if e["type"] == "run_config"), None)
    end = max((e["t"] for e in evs), default=1.0) or 1.0
    # every group an event names has a row (parse_trace holds them to the header's num_rollout_groups, if any)
    named = max((e[f] for e in evs for f in ("rollout_group", "src", "dst") if f in e), default=-1)
    groups = max(cfg["num_rollout_groups"] if cfg else 1, named + 1)
    area, version, loading = _occupancy_rows(evs, groups, end, columns)
    slots = max(1.0, cfg["slots_per_group"] if cfg else max((max(row) for row in area), default=1.0))
    row_h, left, top, width = max(2, min(14, 560 // max(groups, 1))), 90, 40, 900
    col_w = width / columns
    train_y = top + groups * row_h + 12
    height = train_y + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
           'font-family="Helvetica" font-size="11">']
    for r in range(groups):
        y = top + r * row_h
        if r % max(1, groups // 8) == 0:
            out.append(f'<text x="{left - 6}" y="{y + row_h - 1}" text-anchor="end">rg {r}</text>')
        for c in range(columns):
            occ = area[r][c] / slots
            load = loading[r][c]
            x = left + c * col_w
            if occ > 0 and load < 1.0:
                fill = _PALETTE[version[r][c] % len(_PALETTE)]
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{col_w + 0.1:.1f}" height="{row_h - 1}" '
                           f'fill="{fill}" fill-opacity="{0.15 + 0.85 * min(1.0, occ):.2f}"/>')
            if load > 1e-9:  # every load shows, however short: a column partly loading is grey by its share
                opacity = "" if load >= 1.0 else f' fill-opacity="{0.35 + 0.65 * load:.2f}"'
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{col_w + 0.1:.1f}" height="{row_h - 1}" '
                           f'fill="#888"{opacity}/>')
    out.append(f'<text x="{left - 6}" y="{train_y + 14}" text-anchor="end">trainer</text>')
    for e in evs:
        if e["type"] == "train_step":
            x0 = left + e["start_t"] / end * width
            w = max(1.0, (e["t"] - e["start_t"]) / end * width)
            fill = _PALETTE[e["produced_version"] % len(_PALETTE)]
            out.append(f'<rect x="{x0:.1f}" y="{train_y}" width="{w:.1f}" height="20" fill="{fill}" stroke="#000"/>')
            out.append(f'<text x="{x0 + 2:.1f}" y="{train_y + 14}">s{e["step"]}</text>')
            for t in sorted(set(e.get("joined", {}).values())):  # an early step: a group joined it as it finished
                x = left + t / end * width
                out.append(f'<line class="joined" x1="{x:.1f}" y1="{train_y - 4}" x2="{x:.1f}" y2="{train_y + 24}" '
                           'stroke="#000" stroke-width="1.5"/>')
        elif e["type"] == "weights_published":
            x = left + e["t"] / end * width
            out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{train_y + 24}" stroke="#000" '
                       'stroke-dasharray="3,3" stroke-width="0.7"/>')
            out.append(f'<text x="{x + 2:.1f}" y="{top - 6}">v{e["version"]}</text>')
    # as many decimals as the tick spacing needs, so no two ticks read the same (0s, 0.4s, ... on a 2 s run)
    decimals = max(0, math.ceil(-math.log10(end / 5)))
    for i in range(6):
        x = left + i * width / 5
        out.append(f'<text x="{x:.1f}" y="{height - 8}" text-anchor="middle">{end * i / 5:.{decimals}f}s</text>')
    out.append("</svg>")
    legend = "".join(
        f'<span style="background:{_PALETTE[v % len(_PALETTE)]};padding:0 6px;margin-right:4px">v{v}</span>'
        for v in sorted({e["version"] for e in evs if e["type"] == "weights_published"} | {0})[:20]
    )
    head = html.escape(title)
    mode = html.escape(str(cfg["mode"])) if cfg else "?"
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + head + "</title></head>"
        "<body style=\"font-family:Helvetica\"><h3>" + head + f" — mode {mode}</h3>"
        "<p>Rows: rollout groups (colour = the version most running requests use, opacity = slot occupancy, grey = loading weights or "
        "suspended while a colocated step trains, lighter for part of a column); "
        "bottom: training steps (a tick on one: a group that joined it as it finished, an early step); dashed: version "
        "published.</p><p>" + legend + "</p>"
        + "".join(out) + "</body></html>\n"
    )
