"""Exports of a schedule: JSON and Graphviz DOT of the graph, and a self-contained HTML timeline.

All functions return strings (no I/O here); ``dora`` or a bench script writes them to files.
The timeline has one row per rollout group (colour = version served, opacity = slot occupancy,
grey = loading weights, or suspended for a colocated training step) plus a trainer row (one box per training step) and dashed lines where a
version was published. It reads only the trace, so it draws simulated and real runs alike.
"""

from __future__ import annotations

import html
import json
from typing import Any

import networkx as nx

from planner.schedule.events import parse_trace

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac")


def _node_id(node: tuple[Any, Any]) -> str:
    kind, key = node
    return {"version": f"v{key}", "step": f"step{key}"}.get(kind, str(key))


def graph_to_json(graph: nx.DiGraph) -> str:
    """Deterministic JSON: ``{"nodes": [...], "edges": [...]}`` with string ids (``v3``, ``step2``, ``g1/0``)."""
    nodes = []
    for node in sorted(graph.nodes, key=lambda n: (n[0], str(n[1]))):
        attrs = {k: v for k, v in graph.nodes[node].items()}
        nodes.append({"id": _node_id(node), **attrs})
    edges = [
        {"src": _node_id(u), "dst": _node_id(v), **data}
        for u, v, data in sorted(graph.edges(data=True), key=lambda e: (_node_id(e[0]), _node_id(e[1])))
    ]
    return json.dumps({"run_config": graph.graph.get("run_config"), "nodes": nodes, "edges": edges},
                      sort_keys=True, indent=1, default=list)


def graph_to_dot(graph: nx.DiGraph, *, max_trajectories: int = 2000) -> str:
    """Graphviz DOT text; versions as boxes, steps as diamonds, trajectories as points (first N only)."""
    lines = ["digraph schedule {", "  rankdir=LR;", '  node [fontname="Helvetica"];']
    shown = set()
    trajs = [n for n in graph if n[0] == "traj"][:max_trajectories]
    shown.update(trajs)
    for node in graph:
        if node[0] == "version":
            lines.append(f'  "{_node_id(node)}" [shape=box, style=filled, fillcolor="{_PALETTE[node[1] % 10]}"];')
            shown.add(node)
        elif node[0] == "step":
            lines.append(f'  "{_node_id(node)}" [shape=diamond];')
            shown.add(node)
    for node in trajs:
        lines.append(f'  "{_node_id(node)}" [shape=point];')
    for u, v, data in graph.edges(data=True):
        if u in shown and v in shown:
            lines.append(f'  "{_node_id(u)}" -> "{_node_id(v)}" [label="{data.get("kind", "")}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _occupancy_rows(events: list[dict[str, Any]], groups: int, end: float, columns: int):
    """Per rollout group and column: (time-averaged running sequences, version, loading fraction). While rollout is
    suspended for training (colocated streaming: ``rollout_suspended`` to ``rollout_resumed``) every group counts as
    loading, its requests kept but not running."""
    width = end / columns
    area = [[0.0] * columns for _ in range(groups)]
    loading = [[0.0] * columns for _ in range(groups)]
    version = [[0] * columns for _ in range(groups)]
    active = [0] * groups
    last_t = [0.0] * groups
    served = [0] * groups
    load_start: dict[int, float] = {}
    stopped_at: float | None = None

    def spread(grid: list[list[float]], r: int, t0: float, t1: float, weight: float) -> None:
        """Add ``weight`` over [t0, t1) to row ``r``, each column its share (the last one takes what runs past it).
        Column by column: stepping from edge to edge stalled where a float edge divided back into the column before."""
        if t1 <= t0 or not weight:
            return
        row = grid[r]
        for col in range(min(int(t0 / width), columns - 1), min(int(t1 / width), columns - 1) + 1):
            lo = max(t0, col * width)
            hi = t1 if col == columns - 1 else min(t1, (col + 1) * width)
            if hi > lo:
                row[col] += weight * (hi - lo) / width

    def move(r: int, t: float, delta: int) -> None:
        if stopped_at is None:
            spread(area, r, last_t[r], t, active[r])
        last_t[r] = t
        active[r] += delta

    for e in events:
        etype, t = e["type"], e["t"]
        if etype == "admitted":
            move(e["rollout_group"], t, 1)
        elif etype == "finished":
            move(e["rollout_group"], t, -1)
        elif etype == "migrated":
            move(e["src"], t, -len(e["trajs"]))
            move(e["dst"], t, len(e["trajs"]))
        elif etype == "weights_load_started":
            load_start[e["rollout_group"]] = t
        elif etype == "weights_loaded":
            r = e["rollout_group"]
            spread(loading, r, load_start.pop(r, t), t, 1.0)
            first = min(int(t / width), columns - 1)
            for col in range(first, columns):
                version[r][col] = e["version"]
            served[r] = e["version"]
        elif etype == "rollout_suspended":
            for r in range(groups):
                move(r, t, 0)
            stopped_at = t
        elif etype == "rollout_resumed" and stopped_at is not None:
            for r in range(groups):
                spread(loading, r, stopped_at, t, 1.0)
                last_t[r] = t
            stopped_at = None
    for r in range(groups):
        move(r, end, 0)
        if stopped_at is not None:  # suspended when the run ended
            spread(loading, r, stopped_at, end, 1.0)
    return area, version, loading


def timeline_html(events: list[dict[str, Any]], *, title: str = "dora schedule", columns: int = 600) -> str:
    """A self-contained HTML page with an inline SVG timeline of the trace."""
    evs = parse_trace(events)
    cfg = next((e for e in evs if e["type"] == "run_config"), None)
    end = max((e["t"] for e in evs), default=1.0) or 1.0
    groups = cfg["num_rollout_groups"] if cfg else 1 + max(
        (e.get("rollout_group", e.get("dst", 0)) for e in evs if "rollout_group" in e or "dst" in e), default=0
    )
    area, version, loading = _occupancy_rows(evs, groups, end, columns)
    slots = cfg["slots_per_group"] if cfg else max(1.0, max((max(row) for row in area), default=1.0))
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
            x = left + c * col_w
            if loading[r][c] > 0.5:
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{col_w + 0.1:.1f}" height="{row_h - 1}" fill="#888"/>')
            elif occ > 0:
                fill = _PALETTE[version[r][c] % len(_PALETTE)]
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{col_w + 0.1:.1f}" height="{row_h - 1}" '
                           f'fill="{fill}" fill-opacity="{0.15 + 0.85 * min(1.0, occ):.2f}"/>')
    out.append(f'<text x="{left - 6}" y="{train_y + 14}" text-anchor="end">trainer</text>')
    for e in evs:
        if e["type"] == "train_step":
            x0 = left + e["start_t"] / end * width
            w = max(1.0, (e["t"] - e["start_t"]) / end * width)
            fill = _PALETTE[e["produced_version"] % len(_PALETTE)]
            out.append(f'<rect x="{x0:.1f}" y="{train_y}" width="{w:.1f}" height="20" fill="{fill}" stroke="#000"/>')
            out.append(f'<text x="{x0 + 2:.1f}" y="{train_y + 14}">s{e["step"]}</text>')
        elif e["type"] == "weights_published":
            x = left + e["t"] / end * width
            out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{train_y + 24}" stroke="#000" '
                       'stroke-dasharray="3,3" stroke-width="0.7"/>')
            out.append(f'<text x="{x + 2:.1f}" y="{top - 6}">v{e["version"]}</text>')
    for i in range(6):
        x = left + i * width / 5
        out.append(f'<text x="{x:.1f}" y="{height - 8}" text-anchor="middle">{end * i / 5:.0f}s</text>')
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
        "<p>Rows: rollout groups (colour = version served, opacity = slot occupancy, grey = loading weights or "
        "suspended while a colocated step trains); "
        "bottom: training steps; dashed: version published.</p><p>" + legend + "</p>"
        + "".join(out) + "</body></html>\n"
    )
