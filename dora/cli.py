"""The `dora` command line: argument parsing and exit codes; each subcommand delegates to its stage.

Exit codes: 0 success; 2 invalid input (spec diagnostics, or `plan --detailed-exitcode` with changes);
1 any other failure. Bad input never prints a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dora import __version__

EXAMPLES = """\
examples:
  dora validate specs/*.yaml            check specs; each problem with its YAML path and line
  dora plan specs/dense-32b-h800x128.yaml
                                        dry run: chosen placement, mode, predicted cost, considered plans
  dora plan SPEC --out plans/x          write plan.json, report, timeline, schedule graph, launch/ artifacts
  dora plan SPEC --against plans/x/plan.json --detailed-exitcode
                                        exit 0 if the plan is unchanged, 2 if it changed, 1 on error
  dora plan SPEC --sweep cluster.nodes=2,4,8,16
                                        one plan per value, side by side: throughput, time, cost
  dora diff old.yaml new.yaml           what changes in placement and predictions (specs or plan.json files)
  dora apply specs/local-tiny.yaml      plan and run a real asynchronous RL job on this machine's CPU
  dora apply plans/x/plan.json          run a saved plan (refused if its spec changed since)
  dora apply SPEC --address http://HEAD:8265
                                        submit it to a Ray cluster (Jobs API) and follow its logs
  dora status RUN_DIR / dora stop RUN_DIR
                                        the submitted job's state / stop it
  dora calibrate specs/local-tiny.yaml --out cal.json
                                        measure this machine's engines; then `dora plan SPEC --calibration cal.json`
  dora examples local-tiny > my.yaml    start from a shipped example spec
  dora schema > dora-spec.schema.json   JSON Schema of the spec language, for editors
"""

EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2


def _err_console():
    from dora.terminal import make_console

    return make_console(stderr=True, highlight=False, soft_wrap=True)


def _out_console():
    from dora.terminal import make_console

    return make_console(highlight=False, soft_wrap=True)


def _error(message: str, *, label: str = "error") -> None:
    """``label: message`` on stderr, the message exactly as written (``dora.terminal.error``)."""
    from dora.terminal import error

    error(_err_console(), message, label=label)


def cmd_validate(args: argparse.Namespace) -> int:
    from dora.spec import SpecError, load_spec

    status = EXIT_OK
    results = []
    from dora.planning import pin_problems

    for file in args.specs:
        try:
            resolved = load_spec(file)
            problems = pin_problems(resolved)
            if problems:
                raise SpecError(file, problems)
        except SpecError as exc:
            status = EXIT_INVALID
            results.append({"file": file, "valid": False, "problems": [d.to_json() for d in exc.diagnostics]})
            if not args.json:
                print_spec_error(exc)
            continue
        results.append({"file": file, "valid": True, "spec_hash": resolved.spec_hash})
        if not args.json:
            arch = resolved.arch
            from rich.text import Text

            _out_console().print(Text.assemble(("ok", "green"), f" {file}: {resolved.spec.name} — {arch.name}, "
                                               f"{resolved.spec.total_accelerators} x {resolved.spec.cluster.accelerator}"))
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    return status


def print_spec_error(exc) -> None:
    from rich.text import Text

    from dora.spec.diagnostics import format_path
    from dora.terminal import error

    con = _err_console()
    n = len(exc.diagnostics)
    error(con, f"{exc.file or repr(exc.file)}: {n} problem{'s' if n != 1 else ''}")  # '': an empty name given
    for d in exc.diagnostics:
        where = format_path(d.path)
        line = f" (line {d.line})" if d.line is not None else ""
        con.print(Text.assemble("  ", (where, "bold"), f"{line}: {d.message}"))
        if d.hint:
            con.print(Text.assemble("      ", ("to fix:", "dim"), f" {d.hint}"))


def cmd_schema(args: argparse.Namespace) -> int:
    from dora.spec.schema import spec_json_schema

    print(json.dumps(spec_json_schema(), indent=2, sort_keys=True))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from dora.plan_cmd import cmd_plan as run

    return run(args, _out_console(), _err_console())


def cmd_diff(args: argparse.Namespace) -> int:
    from dora.plan_cmd import cmd_diff as run

    return run(args, _out_console(), _err_console())


def cmd_apply(args: argparse.Namespace) -> int:
    from dora.apply import ApplyOverrides, run_apply

    overrides = ApplyOverrides(mode=args.mode, steps=args.steps, rollout_workers=args.rollout_workers,
                               max_num_seqs=args.max_num_seqs, output_dir=args.output_dir, watchdog_s=args.watchdog_s)
    return run_apply(args.target, overrides=overrides, console=_err_console(), live=not args.no_live,
                     calibration=args.calibration, address=args.address)


def cmd_status(args: argparse.Namespace) -> int:
    from dora.cluster import ClusterError, JobRecordError, job_status

    try:
        info = job_status(args.target)
    except ClusterError as exc:
        _error(str(exc))
        return EXIT_INVALID if isinstance(exc, JobRecordError) else EXIT_ERROR
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        _out_console().print(f"{info['submission_id']} on {info['address']}: {info['status']}"
                             + (f" — {info['message']}" if info["message"] else ""), markup=False)
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from dora.cluster import ClusterError, JobRecordError, stop_job

    try:
        info = stop_job(args.target)
    except ClusterError as exc:
        _error(str(exc))
        return EXIT_INVALID if isinstance(exc, JobRecordError) else EXIT_ERROR
    what = "stop requested" if info["stop_requested"] else "already finished"
    _out_console().print(f"{info['submission_id']} on {info['address']}: {what} ({info['status']})", markup=False)
    return EXIT_OK


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dora.calibrate import run_calibrate

    return run_calibrate(args.spec, args.out, _err_console(), quick=args.quick, from_runs=args.from_run,
                         in_situ=args.in_situ, steps=args.steps, runs_dir=args.runs_dir)


def cmd_examples(args: argparse.Namespace) -> int:
    from dora.examples import example_text, examples_dir, list_examples
    from dora.spec.diagnostics import did_you_mean

    names = [name for name, _ in list_examples()]
    if args.name is None:
        for name, summary in list_examples():
            print(f"{name:24} {summary}")
        print(f"\n(in {examples_dir()}; `dora examples NAME > my-spec.yaml` copies one)")
        return EXIT_OK
    text = example_text(args.name)
    if text is None:
        _error(f"no example named '{args.name}'{did_you_mean(args.name, names)}; examples: {', '.join(names)}")
        return EXIT_INVALID
    print(text, end="")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from dora.terminal import named

    parser = argparse.ArgumentParser(
        prog="dora",
        description="Plan and run asynchronous RL post-training (multi-version streaming rollout) from a YAML spec.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dora {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("validate", help="check spec files and report their problems (every field's at once; the checks "
                                        "across fields once the fields are valid)")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.add_argument("--json", action="store_true", help="machine-readable results")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="plan a spec: placement, mode, staleness, predicted cost (a dry run)")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--out", metavar="DIR", help="write plan.json, report.txt, timeline.html, schedule.*, launch/")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the report")
    p.add_argument("--calibration", metavar="FILE", help="calibration JSON from `dora calibrate`")
    p.add_argument("--against", metavar="PLAN_JSON", help="compare with a previous plan.json and show the diff")
    p.add_argument("--detailed-exitcode", action="store_true",
                   help="with --against: exit 0 when unchanged, 2 when the plan changed, 1 on error")
    p.add_argument("--sweep", action="append", metavar="FIELD=V1,V2",
                   help="plan the spec once per value of a field and compare the plans in a table (e.g. "
                        "cluster.nodes=8,16,32 or staleness.max_version_lag=1..4); repeat it for a grid")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("apply", help="plan and run a spec (or run a saved plan.json); locally on CPU by default")
    p.add_argument("target", metavar="SPEC|PLAN", type=named("a spec, a plan.json or a plan directory"),
                   help="a spec, or a plan.json / plan directory from `dora plan --out`")
    p.add_argument("--mode", help="run this mode instead of the planner's choice (sync, one-step-off, ...)")
    p.add_argument("--steps", type=int, help="run this many training steps instead of the spec's")
    p.add_argument("--rollout-workers", type=int, help="override the planned number of rollout engine replicas")
    p.add_argument("--max-num-seqs", type=int, help="override the planned slots per rollout engine")
    p.add_argument("--output-dir", help="write trace, metrics and checkpoints here instead of the spec's output_dir")
    p.add_argument("--calibration", metavar="FILE", type=named("a calibration file, or leave the flag out"),
                   help="calibration JSON from `dora calibrate`, used to plan")
    p.add_argument("--no-live", action="store_true", help="plain per-step lines instead of the live display")
    p.add_argument("--address", metavar="URL", help="submit to this Ray cluster's Jobs API (http://HEAD:8265); a spec "
                   "with runtime.backend ray-cluster is submitted to its runtime.address without it")
    p.add_argument("--watchdog-s", type=float, help="stop with a report after this many seconds without progress")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("status", help="state of the job `dora apply --address` submitted")
    p.add_argument("target", metavar="RUN_DIR|SPEC", type=named("a run directory or a spec"),
                   help="the run's output directory (holds job.json) or its spec")
    p.add_argument("--json", action="store_true", help="machine-readable")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("stop", help="stop the job `dora apply --address` submitted")
    p.add_argument("target", metavar="RUN_DIR|SPEC", type=named("a run directory or a spec"),
                   help="the run's output directory (holds job.json) or its spec")
    p.set_defaults(func=cmd_stop)

    from dora.calibrate import add_arguments as calibrate_arguments

    p = sub.add_parser("calibrate", help="measure the local engines and write a calibration file for `dora plan`")
    calibrate_arguments(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("diff", help="compare two specs or plan files, Terraform-style")
    p.add_argument("old", metavar="OLD", type=named("a spec or a plan file"))
    p.add_argument("new", metavar="NEW", type=named("a spec or a plan file"))
    p.add_argument("--calibration", metavar="FILE", type=named("a calibration file, or leave the flag out"),
                   help="calibration JSON from `dora calibrate`, used to plan a spec given as OLD or NEW (a saved "
                        "plan keeps its own)")
    p.add_argument("--detailed-exitcode", action="store_true", help="exit 2 when there are changes")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("examples", help="list the example specs shipped with dora, or print one")
    p.add_argument("name", nargs="?", metavar="NAME")
    p.set_defaults(func=cmd_examples)

    p = sub.add_parser("schema", help="print the JSON Schema of the spec language")
    p.set_defaults(func=cmd_schema)
    return parser


class StdoutWriteError(Exception):
    """Writing to standard output failed (a full disk, an I/O error): the environment's problem, not dora's."""

    def __init__(self, cause: OSError):
        super().__init__(cause.strerror or str(cause))
        self.cause = cause


class _GuardedStdout:
    """``sys.stdout`` whose failed write or flush raises ``StdoutWriteError``, so that ``main`` tells it apart from
    an ``OSError`` of anything else (a closed pipe stays ``BrokenPipeError``: `dora schema | head` is no error)."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutWriteError(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutWriteError(exc) from exc

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ... as the stream has them
        return getattr(self._stream, name)


def _drop_stdout(stream: Any) -> None:
    """Point the process's stdout at /dev/null once writing it failed, so that the interpreter's flush at exit does
    not fail again on what is left in the buffer ("Exception ignored ..."). Only for the real stdout."""
    real = sys.__stdout__
    if real is None or stream is not real:
        return
    with contextlib.suppress(OSError, ValueError):  # best effort: at worst Python prints its own notice at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, real.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_ERROR
    stdout = sys.stdout
    if stdout is not None:
        sys.stdout = _GuardedStdout(stdout)  # type: ignore[assignment]
    try:
        status = func(args)
        sys.stdout.flush()  # output that fit in the buffer is written here: a full disk fails here, not at exit
        return status
    except KeyboardInterrupt as exc:
        from dora.terminal import interrupted_exit_code

        _err_console().print("interrupted")
        return interrupted_exit_code(exc)
    except BrokenPipeError:
        from dora.terminal import EXIT_CLOSED_PIPE

        _drop_stdout(stdout)
        return EXIT_CLOSED_PIPE
    except StdoutWriteError as exc:
        _drop_stdout(stdout)
        full = exc.cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        _error(f"cannot write to standard output: {exc}\n  to fix: "
               + ("free space where standard output goes, or " if full else "") + "redirect it to a writable file")
        return EXIT_ERROR
    except Exception as exc:  # a bug in dora, not bad input: short message, traceback only on request
        if os.environ.get("DORA_DEBUG"):
            raise
        _error(f"{type(exc).__name__}: {exc}\n  this is a bug in dora; rerun with DORA_DEBUG=1 for the traceback and "
               "report it", label="internal error")
        return EXIT_ERROR
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
