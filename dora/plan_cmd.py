"""`dora plan` and `dora diff`: plan a spec, print the report, write the plan directory, compare plans.

Exit codes follow Terraform: 0 success (or, with --detailed-exitcode, no changes against --against), 2 changes
present (--detailed-exitcode) or invalid input, 1 any error. With --detailed-exitcode every error is 1, so 2
always means "the plan changed".
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from dora.parallel import available_cpus
from dora.planning import (
    MAX_JSON_FILE_BYTES,
    CalibrationFileError,
    InfeasibleError,
    Planned,
    catalog_for,
    load_calibration,
    make_plan,
    read_json_object,
    spec_doc,
)
from dora.report import context_diff, inputs_diff, plan_diff, plan_report_text, render_diff, render_plan
from dora.spec import ResolvedSpec, SpecError, load_spec
from dora.spec.diagnostics import Path as SpecPath
from dora.spec.diagnostics import format_path
from dora.spec.files import InputFileError, loads_json, nearest_existing, read_input_file
from dora.sweep import SweepError, describe, parse_sweep, sweep_points
from dora.terminal import StatusLine, error
from planner import _native
from planner.plan import FORMAT_VERSION, Plan
from planner.schedule import check_trace
from planner.schedule.export import graph_to_dot, graph_to_json, timeline_html
from planner.schedule.graph import build_schedule_graph
from planner.search.core import Space, scale_for, sim_steps_for, simulate_candidate

DISPLAY_SAMPLES = 6000
"""Trajectories in the plan's timeline/graph simulation (large plans are drawn at a reduced scale)."""


class PlanFileError(Exception):
    pass


def read_plan_file(path: str) -> dict[str, Any]:
    """The plan in ``path`` (a plan.json, or a directory `dora plan --out` wrote), checked field by field."""
    if Path(path).is_dir():
        path = str(Path(path) / "plan.json")
    if Path(path).suffix.lower() in (".yaml", ".yml"):  # JSON's reader said only "not readable JSON: Expecting value"
        raise PlanFileError(f"'{path}' is a spec, not a plan: give a plan.json (or its directory) that `dora plan SPEC "
                            "--out DIR` wrote; `dora diff` compares two specs")
    data = read_json_object(path, "plan file", PlanFileError)
    version = data.get("format_version")
    if "rollout_workers" in data and "predictions" not in data:  # launch/runtime.json has a format_version too
        raise PlanFileError(f"'{path}' is the runtime config `dora plan --out` writes beside a plan, not a plan; "
                            "give the plan directory or its plan.json")
    if "format_version" not in data:
        raise PlanFileError(f"'{path}' is not a dora plan (it has no format_version); `dora plan SPEC --out DIR` "
                            "writes DIR/plan.json")
    if type(version) is not int:
        raise PlanFileError(f"plan file '{path}': format_version must be a whole number (this dora writes "
                            f"{FORMAT_VERSION}), got {version!r}")
    if version != FORMAT_VERSION:
        raise PlanFileError(f"plan file '{path}' has format_version {version}; this dora reads {FORMAT_VERSION} "
                            "— re-run `dora plan` with this version")
    try:
        Plan.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise PlanFileError(f"plan file '{path}' is malformed: {exc}") from None
    return data


def schedule_artifacts(planned: Planned) -> dict[str, str]:
    """Simulate the chosen plan with its trace (reduced scale for big plans), audit it, and export it."""
    inputs, chosen = planned.inputs, planned.outcome.chosen
    space = Space(inputs)
    steps = sim_steps_for(inputs)
    replicas = chosen.screened.placement.replicas
    # a picture, not a prediction: any scale that keeps it readable and small
    scaled = scale_for(inputs, replicas, steps, max_factor=float(replicas), budget=DISPLAY_SAMPLES)
    sim = simulate_candidate(space, chosen.screened, steps=steps, scale=scaled, record_events=True)
    events = list(sim.events or ())
    report = check_trace(events, k=chosen.screened.k, allow_version_mixing=inputs.allow_version_mixing)
    if not report.ok:
        raise RuntimeError(f"the chosen schedule violates its constraints: {report.violations[:3]}")
    graph = build_schedule_graph(events)
    note = "" if scaled.factor == 1 else f" (drawn at 1/{scaled.factor:.0f} scale: {scaled.replicas} replicas)"
    return {
        "timeline.html": timeline_html(events, title=f"dora plan: {planned.plan.spec_name} — {planned.plan.mode}{note}"),
        "schedule.json": graph_to_json(graph) + "\n",
        "schedule.dot": graph_to_dot(graph),
    }


def write_plan_dir(resolved: ResolvedSpec, planned: Planned, out: Path) -> list[Path]:
    """Write the plan's files into ``out`` and return their paths, all or nothing.

    Everything is rendered first, then written into a temporary directory and renamed into place
    (``dora.lower.render.install_files``): a lowering error, a full disk or anything else leaves ``out`` exactly as
    it was (absent if it was absent), never a mix of an earlier plan's files and this one's. dora's own entries
    (plan.json, report.txt, timeline.html, schedule.json/.dot, launch/) are replaced only in a directory that already
    holds a plan dora wrote (``_check_plan_dir``); anything else in ``out`` is left alone, and a directory where a
    plan file goes, or a file where launch/ goes, is refused, not deleted. The report and launch/ are made from the
    plan as plan.json holds it (``saved_plan``), so that every figure they print is the file's."""
    from dora.lower.render import install_files, launch_modes, render_launch

    plan = saved_plan(planned.plan)
    files = {"plan.json": plan.to_json(), "report.txt": plan_report_text(plan)}
    files.update(schedule_artifacts(planned))
    launch = render_launch(resolved, plan)
    _check_plan_dir(out, [*files, *{PurePosixPath(rel).parts[0] for rel in launch}])
    install_files(out, {**files, **launch}, launch_modes(launch))
    return [out / name for name in sorted(files)] + sorted(out / rel for rel in launch)


def saved_plan(plan: Plan) -> Plan:
    """``plan`` as plan.json holds it: its figures rounded as ``Plan.to_dict`` rounds them. The report and the launch
    files are made from this, so that they print what the file holds (117,074.0 accelerator-hours, not 117,074.4)."""
    return Plan.from_dict(plan.to_dict())


PLAN_DIR_ENTRIES = ("plan.json", "report.txt", "timeline.html", "schedule.json", "schedule.dot", "launch")
"""What `dora plan --out` writes at the top of its directory (``write_plan_dir``)."""


PROBE_PREFIX = ".dora-plan-probe-"
"""The empty directory ``_check_plan_dir`` makes and removes where --out's would be made, to try the filesystem."""


def _check_plan_dir(out: Path, names: list[str]) -> None:
    """Refuse (``FileExistsError``) an existing ``out`` that holds some of dora's ``names`` but no plan.json dora
    wrote: a report.txt or launch/ of the user's is not dora's to replace. A new or empty directory, one holding none
    of the names, or an earlier plan's directory is fine. A file where the directory or one of its parents would be
    is refused too (``NotADirectoryError``), as is a directory this process cannot write where it would be made
    (``PermissionError``), before planning rather than after the report."""
    place = nearest_existing(out)
    if not place.is_dir():
        what = "the path" if place == out.absolute() else f"its parent {place}"
        raise NotADirectoryError(errno.ENOTDIR, f"{what} is a file, not a directory", str(out))
    if not os.access(place, os.W_OK | os.X_OK):  # as the run directory's check (``cluster.output_dir_problem``)
        raise PermissionError(errno.EACCES, f"{place}/ is not writable", str(out))
    try:  # os.access says yes to root where the filesystem says no (/proc): try it
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=place))
    except OSError as exc:
        raise OSError(exc.errno, f"cannot make a directory in {place}/: {exc.strerror or exc}", str(out)) from exc
    if not out.is_dir() or _is_dora_plan(out / "plan.json"):
        return
    in_the_way = [name for name in sorted(names) if os.path.lexists(out / name)]
    if in_the_way:
        shown = ", ".join(f"{name}/" if (out / name).is_dir() else name for name in in_the_way)
        them = "they are" if len(in_the_way) > 1 else "it is"
        raise FileExistsError(errno.EEXIST, f"it holds {shown} but no plan `dora plan` wrote, so {them} not dora's "
                                            "to replace", str(out))


def _is_dora_plan(path: Path) -> bool:
    """``path`` holds a plan `dora plan` wrote (of any format version)."""
    try:
        data = read_json_object(str(path), "plan file", PlanFileError)
    except PlanFileError:
        return False
    return {"format_version", "spec_hash", "predictions"} <= set(data)


_MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
"""Write failures that are the machine's, not the --out path's."""


def _write_fix(exc: OSError) -> str:
    """What to do about ``exc``, raised while writing the plan directory."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space on that filesystem, or choose a directory on another one for --out"
    if exc.errno == errno.EFBIG:  # a file over this process's size limit (`ulimit -f`) or the filesystem's
        return ("raise this shell's file-size limit (`ulimit -f`) if it is set, or choose a directory on a filesystem "
                "that takes larger files for --out")
    if exc.errno in (errno.EISDIR, errno.EEXIST, errno.ENOTDIR):
        return "move that out of the way, or choose another directory for --out"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "choose a writable directory for --out"
    if exc.errno == errno.ENAMETOOLONG:
        return "choose a shorter name for --out"
    return "choose another directory for --out"


def cmd_plan(args: argparse.Namespace, out_console, err_console) -> int:
    from dora.cli import print_spec_error
    from dora.lower import LoweringError, build_context

    error_code = 1 if args.detailed_exitcode else 2
    if args.detailed_exitcode and not args.against:
        error(err_console, "--detailed-exitcode compares against a saved plan: add --against PLAN.json")
        return error_code
    # an empty path is falsy (an empty --out planned, wrote nothing and exited 0) or the working directory
    for flag, value, fix in (("--out", args.out, "name the directory to write the plan into (e.g. --out plans/x)"),
                             ("--against", args.against, "name a saved plan.json or its directory"),
                             ("--calibration", args.calibration, "name a calibration file from `dora calibrate`")):
        if value is not None and not value.strip():
            error(err_console, f"{flag} is empty: {fix}, or leave the flag out")
            return error_code
    points: list[tuple[tuple[SpecPath, Any], ...]] = []
    if args.sweep:
        if args.out or args.against:
            error(err_console, f"--sweep plans several variants of the spec; {'--out' if args.out else '--against'} "
                               "takes one plan: plan the variant you chose on its own (a copy of the spec with its "
                               "values), or leave the flag out")
            return error_code
        try:
            sweeps = [parse_sweep(arg) for arg in args.sweep]
            points = sweep_points(sweeps)
        except SweepError as exc:
            error(err_console, str(exc))
            return error_code
    try:
        resolved = load_spec(args.spec)
        calibration = load_calibration(args.calibration, catalog_for(resolved))
        old = read_plan_file(args.against) if args.against else None
    except SpecError as exc:
        print_spec_error(exc)
        return error_code
    except (CalibrationFileError, PlanFileError) as exc:
        error(err_console, str(exc))
        return error_code
    if points:
        return _cmd_sweep(args, resolved, points, out_console, err_console)
    if args.out:  # a directory that is not dora's to write is refused before planning, not after the report
        try:
            _check_plan_dir(Path(args.out), list(PLAN_DIR_ENTRIES))
        except OSError as exc:
            error(err_console, f"cannot write the plan to {args.out}/: {exc.strerror or exc}\n"
                               f"  to fix: {_write_fix(exc)}")
            return error_code
    status = StatusLine(err_console)
    try:
        try:
            planned = make_plan(resolved, calibration, workers=available_cpus(),
                                progress=_simulations_shown(status, f"planning {resolved.spec.name}"))
        finally:  # before any message, Ctrl-C's included
            status.clear()
    except SpecError as exc:  # a pinned size no layout takes (planning.pin_problems)
        print_spec_error(exc)
        return error_code
    except InfeasibleError as exc:
        print_infeasible(err_console, exc, resolved)
        return 1
    plan = saved_plan(planned.plan)  # what plan.json holds: every figure printed is the file's
    if _native.STATUS.startswith("python: not compiled"):  # a stale build already warned when planner was imported
        err_console.print("note: the simulator ran from its Python sources (this install did not compile it: no C "
                          "compiler?), so planning took up to about 1.8x longer; see the README", markup=False,
                          highlight=False)
    if args.json:
        print(plan.to_json(), end="")
    else:
        out_console.print(render_plan(plan))
    if args.out:
        try:
            written = write_plan_dir(resolved, planned, Path(args.out))
        except LoweringError as exc:
            error(err_console, f"cannot lower the plan: {exc}")
            return error_code
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename and str(exc.filename) != args.out else ""
            error(err_console, f"cannot write the plan to {args.out}/: {exc.strerror or exc}{where}\n"
                               f"  to fix: {_write_fix(exc)}")
            # a full disk or a failing device is not bad input: 1, as any other error (2 is kept for --out's path)
            return 1 if exc.errno in _MACHINE_ERRNOS else error_code
        if not args.json:
            out_console.print(f"\nwrote {len(written)} files to {args.out}/ (plan.json, report.txt, timeline.html, "
                              "schedule.json/.dot, launch/)", markup=False, highlight=False)
        for refusal in build_context(resolved, plan).refusals:  # what launch/NOTES.txt says, where it is not read
            err_console.print(f"warning: {refusal}", style="yellow", markup=False, highlight=False)
    if old is not None:
        new = plan.to_dict()
        changes = plan_diff(old, new)
        # with --json, stdout holds the plan alone; the diff goes to stderr
        (err_console if args.json else out_console).print(
            "\n".join(render_diff(changes, args.against, args.spec, inputs_diff(old["inputs"], new["inputs"]),
                                   context_diff(old, new))),
            markup=False, highlight=False)
        if args.detailed_exitcode:
            return 2 if changes else 0
    return 0


def _simulations_shown(status: StatusLine, doing: str) -> Callable[[int, int], None]:
    """A ``make_plan`` progress callback: ``doing``, the candidate plans simulated and being simulated, and the
    seconds since it started, on ``status``, from the start (the screen runs before the first simulation)."""
    start = time.monotonic()
    status.show(f"{doing}: screening the candidates")

    def shown(done: int, running: int) -> None:
        now = f"{done} candidate plans simulated" + (f", {running} more under way" if running else "")
        status.show(f"{doing}: {now} ({time.monotonic() - start:.0f} s)")

    return shown


def _cmd_sweep(args: argparse.Namespace, resolved: ResolvedSpec, points: list[tuple[tuple[SpecPath, Any], ...]],
               out_console, err_console) -> int:
    """``dora plan SPEC --sweep FIELD=V1,V2,...``: a table of the plans (``dora.sweep``); exit 0 when any point has a
    plan, 2 when every value is refused by the spec language, 1 when nothing fits at any point. Each point plans with
    ``--calibration``'s file (read already) over its own catalog entry: a point may change the accelerator or the
    rollout engine."""
    from dora.report import render_sweep
    from dora.sweep import best_index, run_sweep

    workers = available_cpus()

    status = StatusLine(err_console)
    doing = ""

    def progress(i: int, what: str) -> None:
        nonlocal doing
        status.clear()
        doing = f"planning {i + 1}/{len(points)}: {what}"
        err_console.print(doing, style="dim", markup=False, highlight=False)

    def plan_point(r: ResolvedSpec) -> Any:
        try:
            calibration = load_calibration(args.calibration, catalog_for(r))
            return saved_plan(make_plan(r, calibration, workers=workers, progress=_simulations_shown(status, doing)).plan)
        finally:
            status.clear()

    planned = run_sweep(resolved.file, points, plan_point, progress)
    if all(p.invalid is not None for p in planned):
        error(err_console, f"--sweep {', '.join(args.sweep)}: the spec refuses every value; the first, "
                           f"{describe(planned[0].settings)}: {planned[0].invalid}")
        return 2
    best = best_index(planned, resolved.spec.objective)
    if args.json:
        print(json.dumps({"spec_file": resolved.file, "objective": resolved.spec.objective, "best": best, "points": [
            {"settings": {format_path(path): value for path, value in p.settings},
             "plan": p.plan.to_dict() if p.plan is not None else None, "invalid": p.invalid,
             "infeasible": p.infeasible} for p in planned]}, indent=2))
    else:
        fields = [format_path(path) for path, _ in points[0]]
        out_console.print(render_sweep(resolved.spec.name, resolved.file, fields, planned, best,
                                       resolved.spec.objective))
    return 0 if best is not None else 1


def print_infeasible(console, exc: InfeasibleError, resolved: ResolvedSpec) -> None:
    """Say that nothing fits ``resolved``'s cluster, naming its file: the closest candidate and what to change."""
    error(console, f"{resolved.file}: nothing fits — {exc.headline}")  # the closest candidate's detail follows
    if exc.closest is not None:
        console.print(f"  closest candidate: {exc.closest.what}\n  it lacks: {exc.closest.reason}",
                      markup=False, highlight=False)
    for other in exc.also:  # the other side has nothing that fits either
        console.print(f"  and on the other side: {other.what}\n  it lacks: {other.reason}", markup=False,
                      highlight=False)
    host = resolved.spec.cluster.host_memory_gib_per_node
    if host is not None and exc.closest is not None and "host memory" in exc.closest.reason:
        doc = spec_doc(resolved.file)
        line = doc.line_of(("cluster", "host_memory_gib_per_node")) if doc is not None else None
        console.print(f"  the spec sets: cluster.host_memory_gib_per_node = {host:g}"
                      + (f" (line {line})" if line is not None else ""), markup=False, highlight=False)
    low_memory = resolved.spec.runtime.gpu_memory_utilization < 0.5
    pinned = resolved.spec.placement != "auto"
    if pinned:
        console.print(f"  the spec pins: {', '.join(pinned_fields(resolved))}", markup=False, highlight=False)
    console.print("  to fix: " + ("remove or relax the pinned sizes under placement (the search then chooses them), "
                                  if pinned else "")
                  + "add accelerators, use a larger accelerator, lower the response cap, "
                  + ("raise runtime.gpu_memory_utilization, " if low_memory else "") + "or a smaller model",
                  markup=False, highlight=False)


def pinned_fields(resolved: ResolvedSpec) -> list[str]:
    """Each field set under ``placement``, as ``placement.train.accelerators = 63 (line 34)``: the line where the
    spec file still reads (a spec given as JSON, or gone since, names no line)."""
    doc = spec_doc(resolved.file)

    def leaves(value: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
        if isinstance(value, dict):
            return [leaf for k, v in value.items() for leaf in leaves(v, (*path, k))]
        return [] if value is None else [(path, value)]

    placement = resolved.spec.placement
    if placement == "auto":
        return []
    out = []
    for path, value in leaves(placement.model_dump(mode="json", exclude_unset=True), ("placement",)):
        line = doc.line_of(path) if doc is not None else None
        out.append(f"{'.'.join(path)} = {json.dumps(value)}" + (f" (line {line})" if line is not None else ""))
    return out


def _is_plan_path(path: str) -> bool:
    """A plan file or plan directory, not a spec (YAML, or JSON without a format_version)."""
    return Path(path).is_dir() or (path.lower().endswith(".json") and not is_json_spec(path))


def is_json_spec(path: str) -> bool:
    """A JSON file holding a spec rather than a plan (specs may be written in JSON, YAML's subset)."""
    try:
        data = loads_json(read_input_file(path, MAX_JSON_FILE_BYTES).decode("utf-8"))
    except (InputFileError, ValueError):  # read_plan_file then says what is wrong with it
        return False
    return isinstance(data, dict) and "format_version" not in data and "model" in data


def cmd_diff(args: argparse.Namespace, out_console, err_console) -> int:
    from dora.cli import print_spec_error

    error_code = 1 if args.detailed_exitcode else 2  # as `dora plan`: with --detailed-exitcode 2 means "changed"
    sides = (args.old, args.new)
    if args.calibration is not None:
        if not args.calibration.strip():
            error(err_console, "--calibration is empty: name a calibration file from `dora calibrate`, or leave the "
                               "flag out")
            return error_code
        if all(_is_plan_path(path) for path in sides):
            error(err_console, "--calibration plans a spec side, but both sides are saved plans (each keeps the "
                               "calibration it was planned with): give a spec, or leave the flag out")
            return error_code
    plans = []
    try:
        load_calibration(args.calibration)  # a bad file is reported before any side is planned
        for path in sides:
            if _is_plan_path(path):
                plans.append(read_plan_file(path))
                continue
            resolved = load_spec(path)
            calibration = load_calibration(args.calibration, catalog_for(resolved))  # each side over its own catalog
            try:
                plans.append(make_plan(resolved, calibration, workers=available_cpus()).plan.to_dict())
            except InfeasibleError as exc:  # an error, as in `dora plan`, not bad input
                print_infeasible(err_console, exc, resolved)
                return 1
    except SpecError as exc:
        print_spec_error(exc)
        return error_code
    except (PlanFileError, CalibrationFileError) as exc:
        error(err_console, str(exc))
        return error_code
    old, new = plans
    changes = plan_diff(old, new)
    inputs = inputs_diff(old["inputs"], new["inputs"])
    out_console.print("\n".join(render_diff(changes, args.old, args.new, inputs, context_diff(old, new))),
                      markup=False, highlight=False)
    return 2 if (changes and args.detailed_exitcode) else 0
