"""Rendering a Plan for people: the `dora plan` report (rich), and Terraform-style diffs of two plans.

Everything printed is read from the Plan (computed by the planner); nothing here computes a prediction.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from planner.plan import Plan, Predictions, format_rate

_GIB = float(1 << 30)


_DURATION_UNITS = ((1.0, "ms", 1000.0, 0), (120.0, "s", 1.0, 1), (7200.0, "min", 1 / 60, 1), (math.inf, "h", 1 / 3600, 1))
"""(below this many seconds, unit, per second, decimals) of ``_dur``."""


def _fixed(x: float, decimals: int) -> tuple[str, float]:
    """``x`` to ``decimals`` decimals and the value printed; a non-zero ``x`` that would print as 0 prints as '<0.1'
    (or '>-0.1'), its printed value 0."""
    text = f"{x:.{decimals}f}"
    if x and float(text) == 0:
        unit = f"{10.0 ** -decimals:.{decimals}f}"
        return (f"<{unit}" if x > 0 else f">-{unit}"), 0.0
    return text, float(text)


def _dur_value(seconds: float, extra: int = 0) -> tuple[str, float]:
    """``_dur`` with ``extra`` more decimals, and the seconds it prints. A value whose rounding reaches the next unit
    takes that unit (0.9996 s is '1.0 s', not '1000 ms'); a non-zero one that would print as 0 prints as '<1 ms'."""
    for limit, unit, per_s, decimals in _DURATION_UNITS:
        if seconds < limit:
            text, value = _fixed(seconds * per_s, decimals + extra)
            if value / per_s < limit:
                return f"{text} {unit}", value / per_s
    text, value = _fixed(seconds / 3600, 1 + extra)
    return f"{text} h", value * 3600


def _dur(seconds: float) -> str:
    return _dur_value(seconds)[0]


def _adding_up(total: float, parts: Sequence[float], fmt: Callable[[float, int], tuple[str, float]],
               extras: Sequence[int] = (0, 1, 2)) -> tuple[str, list[str]]:
    """``total`` and its ``parts`` (which add up to it) as ``fmt`` prints them with the fewest ``extras`` decimals
    at which the printed parts add up to the printed total (a part printed as '<0.1' counting 0); the fewest where
    none does (a total and parts in different units, '2.1 min' of '100 s' and '25 s', never add up to the digit) or
    when there are no parts."""
    if not parts:
        return fmt(total, extras[0])[0], []
    for extra in extras:
        total_text, total_value = fmt(total, extra)
        printed = [fmt(x, extra) for x in parts]
        if abs(sum(v for _, v in printed) - total_value) <= 1e-9 * max(1.0, abs(total_value)):
            return total_text, [text for text, _ in printed]
    return fmt(total, extras[0])[0], [fmt(x, extras[0])[0] for x in parts]


def _percent(fraction: float) -> str:
    """A whole percentage that reads 0% or 100% only when it is exactly that: '<1%', '>99%', '>100%'."""
    value = 100 * fraction
    text = f"{value:.0f}"
    if value and float(text) == 0:
        return "<1%" if value > 0 else ">-1%"
    if value != 100 and float(text) == 100:
        return ">99%" if value < 100 else ">100%"
    return f"{text}%"


CEILING_SAMPLING = 1e-3
"""How far a simulated plan may pass the overlap ceiling and still read as reaching it. The ceiling's batch holds the
mean prompt and response of the spec's distributions; the simulated batches are drawn from them, and a plan bound by
its trainer (whose step time is that of the mean batch) trains their drawn tokens: a few ppm more on a draw of long
ones. A plan further past it than this would be a cost-model error, and its figure is printed as it is."""


def _reach(fraction: float) -> str:
    """What share of the overlap ceiling a plan reaches (``CEILING_SAMPLING``)."""
    if 1 < fraction <= 1 + CEILING_SAMPLING:
        return "this plan is at it (its simulated batches drew slightly more tokens than the mean the ceiling assumes)"
    return f"this plan reaches {_percent(fraction)}"


def _recomputes(p: Predictions) -> str:
    if p.kv_recomputes_per_step <= 0:
        return "none: every engine's running contexts fit its KV cache"
    migrated = p.kv_recomputes_per_step - p.kv_preemptions_per_step
    shown = migrated > 1e-9 * p.kv_recomputes_per_step  # more than float noise of the subtraction
    total, parts = _adding_up(p.kv_recomputes_per_step, [p.kv_preemptions_per_step, *([migrated] if shown else [])],
                              lambda x, extra: _fixed(x, 1 + extra))
    return (f"{total} sequences ({parts[0]} preempted when an engine's cache filled"
            + (f", {parts[1]} migrated to an engine without room" if shown else "")
            + f"), re-prefilling {format_rate(p.kv_recomputed_tokens_per_step)} tokens")


def _attention_dp(r: Any) -> str:
    """' attention-dp=N' for a replica of N attention data-parallel ranks, '' for one."""
    return f" attention-dp={r.attention_dp}" if r.attention_dp > 1 else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('ch') else 's'}"


def _staleness(plan: Plan) -> str:
    """The k the plan runs under, against the spec's staleness budget (``plan.max_version_lag`` is the former)."""
    k = plan.max_version_lag
    budget = plan.inputs.get("spec", {}).get("staleness", {}).get("max_version_lag")
    if not isinstance(budget, int) or budget == k:
        return f"k={k}, the spec's staleness budget"
    return f"k={k}, chosen within the spec's staleness budget of {budget}"


def placement_lines(plan: Plan) -> list[str]:
    r, t = plan.rollout, plan.train
    kind = "colocated (rollout and training time-share every accelerator)" if plan.colocated else \
        f"disaggregated: {r.accelerators} rollout + {_count(t.accelerators, 'training accelerator')}"
    train = f"tp={t.tp} pp={t.pp} dp={t.dp}" + (f" ep={t.ep}" if t.ep > 1 else "") + (f" cp={t.cp}" if t.cp > 1 else "")
    return [
        f"mode          {plan.mode} ({_staleness(plan)}{', version mixing allowed' if plan.allow_version_mixing else ''})",
        f"placement     {kind}",
        f"rollout       {_count(r.replicas, 'engine replica')} x {_count(r.accelerators_per_replica, 'accelerator')} "
        f"(tp={r.tp}{_attention_dp(r)}{f' ep={r.ep}' if r.ep > 1 else ''}), {r.max_num_seqs} sequences each, "
        f"max_model_len {r.max_model_len}, {_count(r.versions_per_engine, 'version')} per engine"
        + (f"; an older version is packed up to {r.consolidation_batch} sequences per engine"
           if r.consolidation_batch is not None else ""),
        f"training      {_count(t.accelerators, 'accelerator')}: {train}, {_count(t.num_microbatches, 'microbatch')} of "
        f"{t.micro_batch_tokens} tokens{', full recompute' if t.recompute else ''}"
        + ("; a step held by the oldest version's tail starts on the finished groups and takes the rest as they "
           "finish" if plan.early_steps else ""),
    ]


def _speedup(plan: Plan) -> str:
    """Over the best sync plan; where the spec's pins hold a slower sync baseline, over that one too."""
    p = plan.predictions
    if p.speedup_vs_sync_any_placement is None:
        return f"{p.speedup_vs_sync:.2f}x"
    return (f"{p.speedup_vs_sync_any_placement:.2f}x, over sync on a placement the spec's pins rule out (see the "
            f"considered plans); {p.speedup_vs_sync:.2f}x over sync on the pinned one")


def _sweep_speedup(p: Predictions) -> str:
    """A sweep row's speedup: over the best sync plan, as the plan report's headline (``_speedup``), starred where the
    spec's pins rule that plan out (the row said the pinned sync's figure, the legend the best's)."""
    if p.speedup_vs_sync_any_placement is None:
        return f"{p.speedup_vs_sync:.2f}x"
    return f"{p.speedup_vs_sync_any_placement:.2f}x*"


def _predictions_table(plan: Plan) -> Table:
    p = plan.predictions
    best_sync = p.speedup_vs_sync_any_placement or p.speedup_vs_sync
    tab = Table(title="Predicted (simulated)", show_header=False, box=None, pad_edge=False)
    tab.add_column(style="bold")
    tab.add_column()
    rows = [
        ("step time", _dur(p.step_time_s)),
        ("trained tokens/s", format_rate(p.trained_tokens_per_s)),
        ("generated tokens/s", format_rate(p.generated_tokens_per_s)),
        ("samples/s", f"{p.samples_per_s:.2f}"),
        ("speedup vs best sync plan", _speedup(plan)),
        *([("overlap ceiling", f"{format_rate(p.overlap_ceiling_tokens_per_s)} trained tokens/s "
            f"({best_sync * p.overlap_ceiling_tokens_per_s / p.trained_tokens_per_s:.2f}x best sync); "
            f"{_reach(p.trained_tokens_per_s / p.overlap_ceiling_tokens_per_s)}")]
          if p.overlap_ceiling_tokens_per_s and p.trained_tokens_per_s else []),
        ("bubble fraction", _percent(p.bubble_fraction)),
        ("rollout slot occupancy", _percent(p.rollout_occupancy)),
        ("rollout share of a sync step", _percent(p.rollout_share)),
        ("trainer utilization", _percent(p.trainer_utilization)),
        ("weight sync per version", _dur(p.weight_sync_s)),
        *([("host memory moves per step", _host_moves(p))] if plan.colocated else []),
        ("KV-cache recomputes per step", _recomputes(p)),
        ("mean staleness / live versions", f"{p.mean_staleness:.2f} / up to {p.max_live_versions}"),
        ("time for all steps", _dur(p.total_time_s)),
        ("accelerator-hours", _amount(p.accelerator_hours, 1)),
        ("cost", f"${_amount(p.cost_usd, 0)}" if p.cost_usd is not None else "(no price in the spec)"),
    ]
    for k, v in rows:
        tab.add_row(k, v)
    return tab


def _host_moves(p: Predictions) -> str:
    """The total, then the engines' and the trainer's moves, to the precision at which the two add up to it."""
    parts = [p.engine_swap_s, p.trainer_swap_s] if p.engine_swap_s else [p.trainer_swap_s]
    total, texts = _adding_up(p.engine_swap_s + p.trainer_swap_s, parts, _dur_value)
    return (f"{total}: " + (f"engines out and back {texts[0]}, " if p.engine_swap_s else "")
            + f"trainer state out and back {texts[-1]}")


def _memory_table(plan: Plan) -> Table:
    """Each side's need and its breakdown in GiB, to 0.1 GiB, or to 0.01 (0.001) where the printed parts would not
    add up to the printed need at 0.1; a non-zero part too small to show prints as '<0.1'."""
    tab = Table(title="Memory per accelerator", title_justify="left")
    for col in ("side", "uses", "of", "headroom", "breakdown"):
        tab.add_column(col)
    for m in plan.memory:
        names = [k for k, v in sorted(m.detail.items()) if v]
        need, parts = _adding_up(m.need_bytes, [m.detail[k] for k in names],
                                 lambda x, extra: _fixed(x / _GIB, 1 + extra))
        tab.add_row(m.side, f"{need} GiB", f"{m.have_bytes / _GIB:.1f} GiB", _percent(m.headroom_fraction),
                    ", ".join(f"{k} {v}" for k, v in zip(names, parts, strict=True)) + " (GiB)")
    if any(m.side == "host" for m in plan.memory):
        tab.caption = ("host: each accelerator's share of its node's host memory, where this colocated plan parks the "
                       "trainer's state while the engines roll out, or the engines' while it trains (the larger)")
        tab.caption_justify = "left"
    return tab


def _amount(x: float, decimals: int) -> str:
    """``x`` with thousands separators and ``decimals`` decimals, or 3 significant digits when that would print a
    nonzero amount as 0 (local-tiny's 0.0234 accelerator-hours)."""
    text = f"{x:,.{decimals}f}"
    return f"{x:.3g}" if x and float(text.replace(",", "")) == 0 else text


def _considered_table(plan: Plan) -> Table:
    tab = Table(title="Considered plans", title_justify="left")
    for col in ("candidate", "stage", "trained tok/s", "CHOSEN", "why"):
        tab.add_column(col, overflow="fold")
    for c in plan.considered:
        tab.add_row(escape(c.label), c.stage,
                    format_rate(c.trained_tokens_per_s) if c.trained_tokens_per_s is not None else "-",
                    "✔" if c.status == "chosen" else "", escape(c.reason))
    return tab


def render_plan(plan: Plan) -> Group:
    head = Text(f"dora plan: {plan.spec_name}  ({plan.spec_file}, spec {plan.spec_hash[:12]})", style="bold")
    calib = Text(f"calibration: {plan.calibration_source} ({plan.calibration_fingerprint})", style="dim")
    parts: list[Any] = [head, calib, Text(""), *[Text(line) for line in placement_lines(plan)], Text(""),
                        _predictions_table(plan), Text(""), _memory_table(plan), Text(""), _considered_table(plan)]
    if plan.warnings:
        parts.append(Text(""))
        parts.extend(Text(f"warning: {w}", style="yellow") for w in plan.warnings)
    return Group(*parts)


def render_sweep(spec_name: str, spec_file: str, fields: Sequence[str], points: Sequence[Any], best: int | None,
                 objective: str) -> Group:
    """``dora plan --sweep``: a row per point (``dora.sweep.Point``), the swept values first; the point the spec's
    objective ranks first is marked, and a point without a plan says why."""
    from dora.sweep import shown_value

    head = Text(f"dora plan --sweep: {spec_name}  ({spec_file}), {len(points)} plans over {' x '.join(fields)}",
                style="bold")
    priced = all(p.plan is None or p.plan.predictions.cost_usd is not None for p in points)
    tab = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    names = [field.rsplit(".", 1)[-1] for field in fields]  # the title has each whole path
    first = names[0] if len(names) == 1 else "point"
    tab.add_column(first, overflow="fold", min_width=min(max(8, len(first)), 16))
    for col in ("plan", "tok/s", "/accel.", "vs sync", "all steps", "cost" if priced else "accel.-h", "best"):
        tab.add_column(col, overflow="fold", no_wrap=col != "plan", min_width=16 if col == "plan" else None)
    for i, point in enumerate(points):
        values = [escape(shown_value(v)) for _, v in point.settings]
        value = values[0] if len(values) == 1 else " ".join(f"{n}={v}" for n, v in zip(names, values, strict=True))
        if point.plan is None:
            why = f"invalid: {point.invalid}" if point.invalid is not None else f"nothing fits: {point.infeasible}"
            tab.add_row(value, escape(why), *["-"] * 5, "")
            continue
        plan, p = point.plan, point.plan.predictions
        where = (f"coloc {plan.rollout.accelerators}" if plan.colocated else
                 f"R{plan.rollout.accelerators} T{plan.train.accelerators}")
        tab.add_row(value, f"{plan.mode} k={plan.max_version_lag}, {where} of {point.accelerators}",
                    format_rate(p.trained_tokens_per_s), format_rate(p.trained_tokens_per_s / point.accelerators),
                    _sweep_speedup(p), _dur(p.total_time_s),
                    f"${_amount(p.cost_usd, 0)}" if priced else _amount(p.accelerator_hours, 1),
                    "✔" if i == best else "")
    ranked = {"throughput": "the most trained tokens/s", "time": "the shortest time for all steps",
              "cost": "the lowest cost" if priced else "the fewest accelerator-hours (a point has no price)"}[objective]
    foot = Text(f"best: {ranked}, the spec's objective ({objective}). plan: mode, staleness k, accelerators that roll "
                "out (R) and train (T), or time-share (coloc), of the cluster's. tok/s: trained tokens/s, in all and "
                "per accelerator rented; vs sync: over the best sync plan (*: on a placement the spec's pins rule out; `dora "
                "plan` gives both); all steps: the time for the spec's steps; "
                + ("cost: at the spec's cluster.price_per_accelerator_hour_usd, whatever the accelerator" if priced else
                   "accel.-h: accelerator-hours for them (a point has no cluster.price_per_accelerator_hour_usd)")
                + ". Each row is `dora plan` of the spec with these values: plan a copy with them for its whole report.",
                style="dim")
    return Group(head, tab, foot)


def plan_report_text(plan: Plan, width: int = 120) -> str:
    """The report as plain text (deterministic: fixed width, no colour) for report.txt."""
    # rich types `file` as IO[str]; it only calls write() and flush(), which _Null provides
    console = Console(width=width, record=True, file=_Null(),  # type: ignore[arg-type]
                      color_system=None, force_terminal=False)
    console.print(render_plan(plan))
    return console.export_text()


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


# --------------------------------------------------------------------------------------------- diffs
def _flatten(value: Any, prefix: str = "", keyed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The leaves of ``value`` by path ('rollout.tp'). A list of objects is indexed by position ('x[0].a'), or, where
    ``keyed`` names a field for its path that tells its entries apart, by that field ('memory[rollout].need_bytes'),
    so that reordering the entries changes nothing."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k in sorted(value):
            out.update(_flatten(value[k], f"{prefix}.{k}" if prefix else str(k), keyed))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        key = (keyed or {}).get(prefix)
        labels = [v.get(key) for v in value] if key else []
        if labels and all(isinstance(x, str) for x in labels) and len(set(labels)) == len(labels):
            value = [{k: x for k, x in v.items() if k != key} for v in value]  # the label says it
        else:
            labels = [str(i) for i in range(len(value))]
        out = {}
        for label, v in zip(labels, value, strict=True):
            out.update(_flatten(v, f"{prefix}[{label}]", keyed))
        return out
    return {prefix: value}


DIFF_SECTIONS = ("objective", "mode", "max_version_lag", "colocated", "allow_version_mixing", "early_steps", "rollout",
                 "train", "predictions", "memory", "warnings", "spec_hash", "calibration_fingerprint", "catalog_fingerprint", "format_version",
                 "spec_name", "calibration_source")
"""What a plan diff counts as changes; the considered-candidates table is not part of the plan's decision."""

CONTEXT_FIELDS = ("dora_version",)
"""Shown when they differ, but no change: a plan made by another release decides the same (``format_version``, a
change, guards what a release could not read)."""

_KEYED_LISTS = {"memory": "side"}
"""The plan's lists of objects compared entry by entry by this field, not by position."""


def plan_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(symbol, path, old, new) for every changed leaf of the plan's decision: '~' changed, '+' added, '-' removed."""
    out = tree_diff({k: old.get(k) for k in DIFF_SECTIONS if k in old and k != "warnings"},
                    {k: new.get(k) for k in DIFF_SECTIONS if k in new and k != "warnings"}, _KEYED_LISTS)
    # warnings one by one: a warning whose figures moved, and only they, is one change; then the ones gone, then the
    # new ones (a reworded warning read as one removed and one added, two changes for one)
    was = [w for w in old.get("warnings") or () if w not in (new.get("warnings") or ())]
    now = [w for w in new.get("warnings") or () if w not in (old.get("warnings") or ())]
    for w in list(was):
        same = next((n for n in now if _figures_aside(n) == _figures_aside(w)), None)
        if same is not None:
            out.append(("~", "warning", w, same))
            was.remove(w)
            now.remove(same)
    out += [("-", "warning", w, None) for w in was]
    out += [("+", "warning", None, w) for w in now]
    return out


def _figures_aside(text: str) -> str:
    """``text`` with each number (``25%``, ``1,222``, ``0.5``, ``+3.4%``) replaced by ``#``: two warnings alike but for
    their figures are the same warning."""
    return re.sub(r"[-+]?\d[\d,]*(\.\d+)?", "#", text)


def context_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """The ``CONTEXT_FIELDS`` that differ between two plans, as ``plan_diff`` rows."""
    return tree_diff({k: old.get(k) for k in CONTEXT_FIELDS}, {k: new.get(k) for k in CONTEXT_FIELDS})


def inputs_diff(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[tuple[str, str, Any, Any]]:
    """The changed inputs of two plans (``Plan.inputs``): spec fields by their YAML path, then the resolved
    architecture's fields as ``arch.<field>`` and the files the spec reads as ``files.<name>`` (a content digest)."""
    if not old or not new:
        return []
    out = tree_diff(old.get("spec") or {}, new.get("spec") or {})
    for part in ("arch", "files"):
        changes = tree_diff(old.get(part) or {}, new.get(part) or {})
        out += [(sym, f"{part}.{path}", a, b) for sym, path, a, b in changes]
    return out


def tree_diff(old: dict[str, Any], new: dict[str, Any],
              keyed: Mapping[str, str] | None = None) -> list[tuple[str, str, Any, Any]]:
    """(symbol, path, old, new) for every changed leaf of two nested objects (specs, plans; ``keyed``: as
    ``_flatten``). A leaf that is null or an empty list on one side and absent on the other is no change
    (``placement: auto`` against pins that leave fields unset; ``memory: []`` against the leaves of its entries,
    which show as removed)."""
    a, b = _flatten(old, keyed=keyed), _flatten(new, keyed=keyed)
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a:
            if not _empty(b[key]):
                out.append(("+", key, None, b[key]))
        elif key not in b:
            if not _empty(a[key]):
                out.append(("-", key, a[key], None))
        elif a[key] != b[key]:
            out.append(("~", key, a[key], b[key]))
    return out


def _empty(leaf: Any) -> bool:
    return leaf is None or leaf == []


LONG_INT_DIGITS = 30
"""An integer with more digits than this (only a hand-edited plan has one) prints as 1.23457e+400."""


def format_value(v: Any) -> str:
    """A diffed value as the diffs print it: floats to 6 significant digits (and integers of over 30 digits),
    strings quoted."""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, int) and not isinstance(v, bool) and len(digits := str(abs(v))) > LONG_INT_DIGITS:
        return f"{'-' if v < 0 else ''}{digits[0]}.{digits[1:6]}e+{len(digits) - 1}"
    return repr(v) if isinstance(v, str) else str(v)


def relative_change(a: Any, b: Any) -> str:
    """'  (+12.5%)' between two numbers, '' where it means nothing (not numbers, from 0, or not a finite float: an
    integer too large for one)."""
    if not (isinstance(a, int | float) and isinstance(b, int | float)) or isinstance(a, bool) or isinstance(b, bool):
        return ""
    if not a:
        return ""
    try:
        change = 100 * (b - a) / abs(a)
    except OverflowError:  # integers whose ratio no float holds
        return ""
    return f"  ({change:+.1f}%)" if math.isfinite(change) else ""


def brief_changes(changes: Sequence[tuple[str, str, Any, Any]], most: int = 4) -> str:
    """'path: old -> new, ...' for a one-line message: the first ``most`` changes (``tree_diff`` rows), values as the
    diffs print them, cut to 40 characters, '(none)' for an absent one; then 'and N more'."""
    def short(value: Any) -> str:
        text = "(none)" if value is None else format_value(value)
        return text if len(text) <= 40 else text[:37] + "..."

    shown = [f"{path}: {short(a)} -> {short(b)}" for _, path, a, b in changes[:most]]
    return ", ".join(shown + ([f"and {len(changes) - most} more"] if len(changes) > most else []))


def render_diff(changes: list[tuple[str, str, Any, Any]], old_name: str, new_name: str,
                inputs: Sequence[tuple[str, str, Any, Any]] = (),
                context: Sequence[tuple[str, str, Any, Any]] = ()) -> list[str]:
    """Terraform-style lines; ``inputs``: the changes between the two plans' inputs (``inputs_diff``); ``context``:
    fields that differ but are no change (``context_diff``), shown first and not counted."""
    lines = [f"dora diff {old_name} -> {new_name}", ""] if inputs or context or changes else []
    if context:
        lines += ["Context (not a change):", *_change_lines(context), ""]
    if inputs:
        lines += ["Inputs (spec):", *_change_lines(inputs), ""]
    if not changes:
        return [*lines, f"No changes. {new_name} plans the same as {old_name}."]
    lines += ["Plan:"] if inputs or context else []
    lines += _change_lines(changes)
    n = {s: sum(1 for c in changes if c[0] == s) for s in "~+-"}
    lines += ["", f"Plan: {n['+']} to add, {n['~']} to change, {n['-']} to remove."]
    return lines


def _is_bytes(path: str) -> bool:
    """A plan field that holds bytes: ``*_bytes`` (``memory[train].need_bytes``) and a memory breakdown's parts
    (``memory[train].detail.grads``)."""
    return path.endswith("_bytes") or (path.startswith("memory[") and ".detail." in path)


def _shown(path: str, value: Any) -> str:
    """``format_value``, with bytes in GiB as the report prints memory (``9.28 GiB``, not ``9.96968e+09``)."""
    if _is_bytes(path) and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value / _GIB:,.2f} GiB"
    return format_value(value)


def _change_lines(changes: Sequence[tuple[str, str, Any, Any]]) -> list[str]:
    lines = []
    for sym, path, a, b in changes:
        if sym == "~":
            lines.append(f"  ~ {path}: {_shown(path, a)} -> {_shown(path, b)}{relative_change(a, b)}")
        elif sym == "+":
            lines.append(f"  + {path}: {_shown(path, b)}")
        else:
            lines.append(f"  - {path}: {_shown(path, a)}")
    return lines
