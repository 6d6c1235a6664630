"""Rendering a Plan for people: the `dora plan` report (rich), and Terraform-style diffs of two plans.

Everything printed is read from the Plan (computed by the planner); nothing here computes a prediction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from planner.plan import Plan, Predictions, format_rate
from planner.policies import due_consolidation_batch

_GIB = float(1 << 30)


def _dur(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _recomputes(p: Predictions) -> str:
    if p.kv_recomputes_per_step <= 0:
        return "none: every engine's running contexts fit its KV cache"
    migrated = p.kv_recomputes_per_step - p.kv_preemptions_per_step
    return (f"{p.kv_recomputes_per_step:.1f} sequences ({p.kv_preemptions_per_step:.1f} preempted when an engine's "
            "cache filled" + (f", {migrated:.1f} migrated to an engine without room" if migrated > 0.05 else "")
            + f"), re-prefilling {format_rate(p.kv_recomputed_tokens_per_step)} tokens")


def placement_lines(plan: Plan) -> list[str]:
    r, t = plan.rollout, plan.train
    kind = "colocated (rollout and training time-share every accelerator)" if plan.colocated else \
        f"disaggregated: {r.accelerators} rollout + {t.accelerators} training accelerators"
    train = f"tp={t.tp} pp={t.pp} dp={t.dp}" + (f" ep={t.ep}" if t.ep > 1 else "") + (f" cp={t.cp}" if t.cp > 1 else "")
    return [
        f"mode          {plan.mode} (staleness budget used k={plan.max_version_lag}"
        f"{', version mixing allowed' if plan.allow_version_mixing else ''})",
        f"placement     {kind}",
        f"rollout       {r.replicas} engine replicas x {r.accelerators_per_replica} accelerators "
        f"(tp={r.tp}{f' ep={r.ep}' if r.ep > 1 else ''}), {r.max_num_seqs} sequences each, "
        f"max_model_len {r.max_model_len}, {r.versions_per_engine} version(s) per engine"
        + (f"; an older version is packed up to {r.consolidation_batch} sequences per engine "
           f"({due_consolidation_batch(r.consolidation_batch)} for the one the trainer waits for next)"
           if r.consolidation_batch is not None else ""),
        f"training      {t.accelerators} accelerators: {train}, {t.num_microbatches} microbatches of "
        f"{t.micro_batch_tokens} tokens{', full recompute' if t.recompute else ''}",
    ]


def _predictions_table(plan: Plan) -> Table:
    p = plan.predictions
    tab = Table(title="Predicted (simulated)", show_header=False, box=None, pad_edge=False)
    tab.add_column(style="bold")
    tab.add_column()
    rows = [
        ("step time", _dur(p.step_time_s)),
        ("trained tokens/s", format_rate(p.trained_tokens_per_s)),
        ("generated tokens/s", format_rate(p.generated_tokens_per_s)),
        ("samples/s", f"{p.samples_per_s:.2f}"),
        ("speedup vs best sync plan", f"{p.speedup_vs_sync:.2f}x"),
        *([("overlap ceiling", f"{format_rate(p.overlap_ceiling_tokens_per_s)} trained tokens/s "
            f"({p.speedup_vs_sync * p.overlap_ceiling_tokens_per_s / p.trained_tokens_per_s:.2f}x best sync); "
            f"this plan reaches {100 * p.trained_tokens_per_s / p.overlap_ceiling_tokens_per_s:.0f}%")]
          if p.overlap_ceiling_tokens_per_s and p.trained_tokens_per_s else []),
        ("bubble fraction", f"{100 * p.bubble_fraction:.0f}%"),
        ("rollout slot occupancy", f"{100 * p.rollout_occupancy:.0f}%"),
        ("rollout share of a sync step", f"{100 * p.rollout_share:.0f}%"),
        ("trainer utilization", f"{100 * p.trainer_utilization:.0f}%"),
        ("weight sync per version", _dur(p.weight_sync_s)),
        *([("host memory moves per step", f"{_dur(p.engine_swap_s + p.trainer_swap_s)}: "
            + (f"engines out and back {_dur(p.engine_swap_s)}, " if p.engine_swap_s else "")
            + f"trainer state out and back {_dur(p.trainer_swap_s)}")]
          if plan.colocated else []),
        ("KV-cache recomputes per step", _recomputes(p)),
        ("mean staleness / live versions", f"{p.mean_staleness:.2f} / up to {p.max_live_versions}"),
        ("time for all steps", _dur(p.total_time_s)),
        ("accelerator-hours", _amount(p.accelerator_hours, 1)),
        ("cost", f"${_amount(p.cost_usd, 0)}" if p.cost_usd is not None else "(no price in the spec)"),
    ]
    for k, v in rows:
        tab.add_row(k, v)
    return tab


def _memory_table(plan: Plan) -> Table:
    tab = Table(title="Memory per accelerator", title_justify="left")
    for col in ("side", "uses", "of", "headroom", "breakdown"):
        tab.add_column(col)
    for m in plan.memory:
        parts = ", ".join(f"{k} {v / _GIB:.1f}" for k, v in sorted(m.detail.items()) if v)
        tab.add_row(m.side, f"{m.need_bytes / _GIB:.1f} GiB", f"{m.have_bytes / _GIB:.1f} GiB",
                    f"{100 * m.headroom_fraction:.0f}%", f"{parts} (GiB)")
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
def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k in sorted(value):
            out.update(_flatten(value[k], f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


DIFF_SECTIONS = ("objective", "mode", "max_version_lag", "colocated", "allow_version_mixing", "rollout", "train", "predictions",
                 "memory", "warnings", "spec_hash", "calibration_fingerprint", "catalog_fingerprint", "format_version",
                 "dora_version", "spec_name", "calibration_source")
"""What a plan diff shows; the considered-candidates table is context, not part of the plan's decision."""


def plan_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(symbol, path, old, new) for every changed leaf of the plan's decision: '~' changed, '+' added, '-' removed."""
    out = tree_diff({k: old.get(k) for k in DIFF_SECTIONS if k in old and k != "warnings"},
                    {k: new.get(k) for k in DIFF_SECTIONS if k in new and k != "warnings"})
    # warnings one by one: the ones gone, then the new ones (a warning whose figure moved is both)
    was, now = list(old.get("warnings") or ()), list(new.get("warnings") or ())
    out += [("-", "warning", w, None) for w in was if w not in now]
    out += [("+", "warning", None, w) for w in now if w not in was]
    return out


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


def tree_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(symbol, path, old, new) for every changed leaf of two nested objects (specs, plans). A leaf that is null on
    one side and absent on the other is no change (``placement: auto`` against pins that leave fields unset)."""
    a, b = _flatten(old), _flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a:
            if b[key] is not None:
                out.append(("+", key, None, b[key]))
        elif key not in b:
            if a[key] is not None:
                out.append(("-", key, a[key], None))
        elif a[key] != b[key]:
            out.append(("~", key, a[key], b[key]))
    return out


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
                inputs: Sequence[tuple[str, str, Any, Any]] = ()) -> list[str]:
    """Terraform-style lines; ``inputs``: the changes between the two plans' inputs (``inputs_diff``)."""
    lines = []
    if inputs:
        lines += [f"dora diff {old_name} -> {new_name}", "", "Inputs (spec):", *_change_lines(inputs), ""]
    if not changes:
        return [*lines, f"No changes. {new_name} plans the same as {old_name}."]
    lines += ["Plan:"] if inputs else [f"dora diff {old_name} -> {new_name}", ""]
    lines += _change_lines(changes)
    n = {s: sum(1 for c in changes if c[0] == s) for s in "~+-"}
    lines += ["", f"Plan: {n['+']} to add, {n['~']} to change, {n['-']} to remove."]
    return lines


def _change_lines(changes: Sequence[tuple[str, str, Any, Any]]) -> list[str]:
    lines = []
    for sym, path, a, b in changes:
        if sym == "~":
            lines.append(f"  ~ {path}: {format_value(a)} -> {format_value(b)}{relative_change(a, b)}")
        elif sym == "+":
            lines.append(f"  + {path}: {format_value(b)}")
        else:
            lines.append(f"  - {path}: {format_value(a)}")
    return lines
