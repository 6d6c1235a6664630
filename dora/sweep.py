"""``dora plan SPEC --sweep FIELD=V1,V2,...``: the spec planned once per value of a field (a grid for several), side by
side, before anything is rented: how many nodes, which accelerator, what staleness budget.

Each point is the spec file with the swept fields replaced (``load_spec(file, settings)``), validated and planned as
``dora plan`` plans it; a value the spec language refuses, or one nothing fits, is a row saying why, and the others are
still planned. Values read as YAML scalars (``8``, ``h100``, ``true``, ``1.0e-6``); ``A..B`` is every integer from A to
B.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dora.spec import SpecError, load_spec
from dora.spec.diagnostics import Path, format_path
from dora.spec.yamlio import parse_yaml

MAX_POINTS = 32
"""Most points one sweep plans (the product of its fields' value counts): each takes seconds on a GPU spec."""

_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
FORM = "FIELD=V1,V2,... (e.g. --sweep cluster.nodes=8,16,32, or --sweep staleness.max_version_lag=1..4)"


class SweepError(ValueError):
    """A ``--sweep`` argument that does not read as FIELD=V1,V2,..."""


@dataclass(frozen=True)
class Sweep:
    """One ``--sweep`` argument: a spec field (its YAML path) and the values it takes."""

    path: Path
    values: tuple[Any, ...]

    @property
    def field(self) -> str:
        return format_path(self.path)


@dataclass(frozen=True)
class Point:
    """One planned point: the swept fields' values, and the plan, or why there is none."""

    settings: tuple[tuple[Path, Any], ...]
    plan: Any = None
    """``planner.plan.Plan`` (as ``dora plan`` saves it)."""
    accelerators: int = 0
    """The cluster's accelerators at this point (what is rented, whether or not the plan uses every one)."""
    invalid: str | None = None
    """The spec language's refusal of these values: each problem with its field and fix."""
    infeasible: str | None = None
    """Nothing fits the cluster: the planner's headline."""


def parse_sweep(arg: str) -> Sweep:
    """``FIELD=V1,V2,...`` -> Sweep; raises ``SweepError`` saying what is wrong and how to write it."""
    field, eq, rest = arg.partition("=")
    field = field.strip()
    if not eq or not field:
        raise SweepError(f"--sweep {arg!r}: {'no values' if field else 'no field'}: write it as {FORM}")
    if not _FIELD.fullmatch(field):
        raise SweepError(f"--sweep {arg!r}: {field!r} is not a spec field's dotted path: write it as {FORM}")
    values: list[Any] = []
    for raw in (part.strip() for part in rest.split(",")):
        if not raw:
            raise SweepError(f"--sweep {arg!r}: an empty value: write it as {FORM}")
        if m := _RANGE.fullmatch(raw):
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo or hi - lo >= MAX_POINTS:
                raise SweepError(f"--sweep {arg!r}: the range {raw} must run upwards over at most {MAX_POINTS} "
                                 "integers")
            values.extend(range(lo, hi + 1))
            continue
        values.append(_scalar(arg, raw))
    seen: list[Any] = []
    for v in values:
        if any(type(v) is type(s) and v == s for s in seen):
            raise SweepError(f"--sweep {arg!r}: {v!r} is given twice: list each value once")
        seen.append(v)
    return Sweep(path=tuple(field.split(".")), values=tuple(values))


def _scalar(arg: str, raw: str) -> Any:
    """``raw`` read as a YAML scalar, as the spec file would read it."""
    try:
        doc = parse_yaml(f"value: {raw}\n", "--sweep")
    except SpecError:
        doc = None
    value = doc.data.get("value") if doc is not None and isinstance(doc.data, dict) else None
    if doc is None or doc.problems or value is None or isinstance(value, dict | list):
        raise SweepError(f"--sweep {arg!r}: {raw!r} is not a single value (a number, a word, true or false)")
    return value


def sweep_points(sweeps: Sequence[Sweep]) -> list[tuple[tuple[Path, Any], ...]]:
    """Every combination of the sweeps' values, the first sweep's slowest; raises ``SweepError`` beyond
    ``MAX_POINTS`` or when two sweeps set the same field."""
    fields = [s.field for s in sweeps]
    for i, f in enumerate(fields):
        for g in fields[:i]:
            if f == g or f.startswith(g + ".") or g.startswith(f + "."):
                raise SweepError(f"--sweep {f} and --sweep {g} set the same field: sweep it once")
    count = 1
    for s in sweeps:
        count *= len(s.values)
    if count > MAX_POINTS:
        raise SweepError(f"--sweep: {' x '.join(str(len(s.values)) for s in sweeps)} = {count} points, over the "
                         f"{MAX_POINTS} one sweep plans (each takes seconds): sweep fewer values")
    return [tuple(zip((s.path for s in sweeps), combo, strict=True))
            for combo in itertools.product(*(s.values for s in sweeps))]


def describe(settings: Sequence[tuple[Path, Any]]) -> str:
    """'cluster.nodes=16, staleness.max_version_lag=2'."""
    return ", ".join(f"{format_path(p)}={shown_value(v)}" for p, v in settings)


def shown_value(value: Any) -> str:
    """A swept value as the spec file writes it (``true``, not ``True``)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def run_sweep(spec_file: str, points: Sequence[tuple[tuple[Path, Any], ...]],
              plan: Callable[[Any], Any], progress: Callable[[int, str], None] = lambda i, what: None) -> list[Point]:
    """Load and plan ``spec_file`` at each point; ``plan(resolved)`` returns the plan or raises the planner's
    ``InfeasibleError`` or (a pinned size no layout takes) ``SpecError``."""
    from planner.search import InfeasibleError

    out: list[Point] = []
    for i, settings in enumerate(points):
        progress(i, describe(settings))
        try:
            resolved = load_spec(spec_file, settings)
            out.append(Point(settings=settings, plan=plan(resolved), accelerators=resolved.spec.total_accelerators))
        except SpecError as exc:
            out.append(Point(settings=settings, invalid="; ".join(
                f"{format_path(d.path)}" + (f" (line {d.line})" if d.line is not None else "") + f": {d.message}"
                + (f" (to fix: {d.hint})" if d.hint else "") for d in exc.diagnostics)))
        except InfeasibleError as exc:
            out.append(Point(settings=settings, infeasible=exc.headline))
    return out


def best_index(points: Sequence[Point], objective: str) -> int | None:
    """The planned point the objective ranks first (the spec's ``objective``: throughput, time or cost)."""
    planned = [(i, p.plan.predictions) for i, p in enumerate(points) if p.plan is not None]
    if not planned:
        return None
    if objective == "throughput":
        return max(planned, key=lambda ip: ip[1].trained_tokens_per_s)[0]
    if objective == "cost":  # dollars where every point has a price, else accelerator-hours (what a price multiplies)
        priced = all(p.cost_usd is not None for _, p in planned)
        return min(planned, key=lambda ip: ip[1].cost_usd if priced else ip[1].accelerator_hours)[0]
    return min(planned, key=lambda ip: ip[1].total_time_s)[0]
