"""`dora apply SPEC|PLAN`: plan (or load a saved plan), lower it to a runtime config, run it, audit it, report.

``run_apply`` is the whole command (the CLI only parses arguments). A spec is planned on the spot with the same
search as `dora plan`; a saved plan.json is used as is, after checking its spec hash still matches (a stale plan is
refused, as Terraform refuses a stale saved plan). Command-line overrides (steps, workers, slots) apply last.

Exit codes: 0 the run finished and its audit passed; 1 the run failed or the audit found a violation
of the three constraints; 2 invalid spec or overrides; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from shlex import quote  # paths in the commands a message suggests
from typing import Any

from dora.runtime.checkpoint import CheckpointError, check_resumable, resume_hint
from dora.runtime.config import RuntimeConfig, RuntimeConfigError, check_engines
from dora.spec.checks import path_problem
from dora.spec.models import MAX_STEPS
from dora.terminal import error, interrupted_exit_code, make_console, say

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass(frozen=True, kw_only=True)
class ApplyOverrides:
    """Command-line overrides of the spec (``None``: take the spec's value or the default)."""

    mode: str | None = None
    steps: int | None = None
    rollout_workers: int | None = None
    max_num_seqs: int | None = None
    output_dir: str | None = None
    watchdog_s: float | None = None
    """Stop with a report after this many seconds without progress (default: the controller's)."""


def runtime_config_for(resolved: Any, overrides: ApplyOverrides, plan: Any = None,
                       calibration: Any = None) -> RuntimeConfig:
    """The RuntimeConfig of one local run: the plan lowered (``dora.lower.runtime``), then the overrides.

    Without ``plan``, the spec is planned here (restricted to ``overrides.mode`` when given).
    Raises ``ValueError`` with the offending option named when the result is not runnable.
    """
    if plan is None:
        resolved, plan = plan_spec(resolved, overrides.mode, calibration)
    import dataclasses

    from dora.lower.runtime import runtime_config
    from planner.policies import PolicyConfig

    for flag, value in (("--steps", overrides.steps), ("--rollout-workers", overrides.rollout_workers),
                        ("--max-num-seqs", overrides.max_num_seqs)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if overrides.steps is not None and overrides.steps > MAX_STEPS:
        raise ValueError(f"--steps must be at most {MAX_STEPS:,} (workload.steps' bound), got {overrides.steps:,}")
    rc = runtime_config(resolved, plan)
    changes: dict[str, Any] = {}
    if overrides.steps:
        changes["steps"] = overrides.steps
    if overrides.rollout_workers:
        n, per = overrides.rollout_workers, rc.accelerators_per_rollout_worker
        have = resolved.spec.cluster.nodes * resolved.spec.cluster.accelerators_per_node
        if n * per > have:
            raise ValueError(f"--rollout-workers {n} needs {n * per} accelerators ({n} x {per} per worker); the "
                             f"cluster has {have} (cluster.nodes x cluster.accelerators_per_node), so at most "
                             f"{have // per}")
        changes["rollout_workers"] = n
        changes["rollout_accelerators"] = n * per
    if overrides.max_num_seqs:
        changes["max_num_seqs"] = overrides.max_num_seqs
    if overrides.output_dir:
        changes["output_dir"] = overrides.output_dir
    if rc.mode != "streaming" and rc.versions_per_engine != 1:
        changes["versions_per_engine"] = 1  # only streaming hosts several versions per engine
    rc = dataclasses.replace(rc, **changes)
    w = resolved.spec.workload
    in_flight = (rc.max_version_lag + 1) * w.prompts_per_step * w.samples_per_prompt
    if overrides.max_num_seqs and overrides.max_num_seqs > in_flight:
        raise ValueError(f"--max-num-seqs {overrides.max_num_seqs:,} is more than the {in_flight:,} trajectories the "
                         f"plan can ever have in flight ((k + 1) x prompts x samples = {rc.max_version_lag + 1} x "
                         f"{w.prompts_per_step} x {w.samples_per_prompt}); use at most {in_flight:,}")
    if rc.max_num_seqs < w.samples_per_prompt:
        where = f"--max-num-seqs {rc.max_num_seqs}" if overrides.max_num_seqs else f"max_num_seqs {rc.max_num_seqs}"
        raise ValueError(f"{where} is below workload.samples_per_prompt ({w.samples_per_prompt}): a prompt group's "
                         f"samples start together on one engine; use --max-num-seqs {w.samples_per_prompt} or more")
    try:  # the policy's own validation, with its arithmetic, before anything starts
        PolicyConfig(mode=rc.mode, max_version_lag=rc.max_version_lag, num_rollout_groups=rc.rollout_workers,
                     slots_per_group=rc.max_num_seqs, prompts_per_step=w.prompts_per_step,
                     samples_per_prompt=w.samples_per_prompt, total_steps=rc.steps,
                     allow_version_mixing=rc.allow_version_mixing, colocated=rc.colocated,
                     max_versions_per_engine=rc.versions_per_engine, consolidation_batch=rc.consolidation_batch)
    except ValueError as exc:
        raise ValueError(f"mode {rc.mode}: {exc}") from None
    return rc


def plan_for_apply(target: str, mode: str | None, calibration_file: str | None) -> tuple[Any, Any]:
    """(resolved spec, plan) for `dora apply TARGET`: a spec is planned now; a saved plan (plan.json, or a plan
    directory) is used as is after checking it still matches its spec. Raises ``ApplyInputError``."""
    from dora.plan_cmd import PlanFileError, is_json_spec, read_plan_file
    from dora.planning import CalibrationFileError, catalog_for, load_calibration
    from dora.spec import load_spec
    from planner.plan import Plan
    from planner.policies import MODES

    if mode is not None and mode not in MODES:
        raise ApplyInputError(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    path = Path(target)
    saved = path.suffix.lower() == ".json" and not is_json_spec(target)
    plan_file = path / "plan.json" if path.is_dir() else path if saved else None
    if plan_file is not None:
        if mode is not None:
            raise ApplyInputError("--mode cannot change a saved plan: re-run `dora plan` with the spec's mode")
        if calibration_file is not None:
            raise ApplyInputError("--calibration cannot change a saved plan (it was planned with its own calibration): "
                                  "re-run `dora plan SPEC --calibration FILE --out DIR`, or apply the spec")
        try:
            data = read_plan_file(str(plan_file))
        except PlanFileError as exc:
            raise ApplyInputError(str(exc)) from None
        plan = Plan.from_dict(data)
        resolved, planned_in = _saved_plan_spec(plan_file, plan)
        spec_path = resolved.file
        calibration_flag, calibration_note = _calibration_flag(plan, planned_in)
        replan = (f"`dora plan {quote(spec_path)}{calibration_flag} --out {quote(str(plan_file.parent))}`"
                  f"{calibration_note}")
        if resolved.spec_hash != plan.spec_hash:
            changed = _changed_inputs(plan.inputs, resolved.inputs,
                                      f"dora diff {quote(str(plan_file))} {quote(spec_path)}{calibration_flag}")
            raise ApplyInputError(
                f"saved plan is stale: {plan_file} was planned for spec hash {plan.spec_hash[:12]}, but "
                f"{spec_path} now hashes to {resolved.spec_hash[:12]}{changed} — run {replan} again (or "
                f"`dora apply {quote(spec_path)}{calibration_flag}` to plan and run)")
        outside = _outside_spec(plan, resolved.spec)
        if outside:
            raise ApplyInputError(
                f"saved plan {plan_file} breaks its spec {spec_path}: {'; '.join(outside)} (the plan file was "
                f"edited?) — run {replan} again, or change the spec")
        return resolved, plan
    resolved = load_spec(target)
    try:
        calibration = load_calibration(calibration_file, catalog_for(resolved))
    except CalibrationFileError as exc:
        raise ApplyInputError(str(exc)) from None
    if (accelerator := resolved.spec.cluster.accelerator) != "cpu":  # before planning: it takes seconds on GPU specs
        from dora.runtime.config import GPU_ENGINES_MISSING

        where = _spec_field_place(resolved, ("cluster", "accelerator"))
        raise ApplyInputError(f"cluster.accelerator {accelerator!r} ({where}): {GPU_ENGINES_MISSING}")
    return plan_spec(resolved, mode, calibration)


def _unwritable_output(output_dir: str, exc: OSError) -> str:
    """Why the run's output directory cannot be written, and what to do; a file in its place (or a parent's) said as
    such: mkdir's EEXIST read "File exists"."""
    from dora.cluster import output_dir_problem

    why = output_dir_problem(Path(output_dir)) or exc.strerror or str(exc)
    return (f"cannot write the run's outputs to {output_dir}/: {why}\n  to fix: choose a writable directory with "
            "--output-dir (or runtime.output_dir in the spec)")


def _outside_spec(plan: Any, spec: Any) -> list[str]:
    """What a saved plan decides beyond what its spec allows (its hash matched, so only an edit of the plan file
    gets here): staleness, mode, version mixing, accelerators, parallel sizes, slots -- the bounds the command-line
    overrides get, each named by its plan.json field."""
    st, out = spec.staleness, []
    if plan.max_version_lag > st.max_version_lag:
        out.append(f"max_version_lag {plan.max_version_lag} is over staleness.max_version_lag {st.max_version_lag}")
    if st.mode != "auto" and plan.mode != st.mode:
        out.append(f"mode {plan.mode}, but staleness.mode pins {st.mode}")
    if (plan.allow_version_mixing or plan.mode == "partial-rollout") and not st.allow_version_mixing:
        out.append(f"{plan.mode} with version mixing, which staleness.allow_version_mixing forbids")
    used = plan.rollout.accelerators + (0 if plan.colocated else plan.train.accelerators)
    if plan.rollout.replicas * plan.rollout.accelerators_per_replica != plan.rollout.accelerators:
        out.append(f"rollout.replicas {plan.rollout.replicas} x accelerators_per_replica "
                   f"{plan.rollout.accelerators_per_replica} is not rollout.accelerators {plan.rollout.accelerators}")
    if used > spec.total_accelerators:
        out.append(f"{used} accelerators, more than the cluster's {spec.total_accelerators}")
    w, r = spec.workload, plan.rollout
    longest = w.prompt_length.max_tokens + w.response_length.max_tokens
    if r.max_model_len < longest:
        out.append(f"rollout.max_model_len {r.max_model_len} is shorter than the spec's longest sequence "
                   f"(prompt cap + response cap = {longest})")
    if r.kv_capacity_tokens < r.max_model_len:
        out.append(f"rollout.kv_capacity_tokens {r.kv_capacity_tokens} cannot hold one sequence of max_model_len "
                   f"{r.max_model_len}")
    from dora.planning import CPU_MAX_NUM_SEQS, VLLM_MAX_NUM_SEQS

    in_flight = (plan.max_version_lag + 1) * w.prompts_per_step * w.samples_per_prompt  # `--max-num-seqs`' bound
    cap = CPU_MAX_NUM_SEQS if spec.cluster.accelerator == "cpu" else VLLM_MAX_NUM_SEQS  # the planner's, a small batch
    if r.max_num_seqs > max(in_flight, cap * r.attention_dp):  # the cap is one rank's
        out.append(f"rollout.max_num_seqs {r.max_num_seqs:,} is more than the {in_flight:,} trajectories the plan can "
                   f"ever have in flight ((k + 1) x prompts x samples = {plan.max_version_lag + 1} x "
                   f"{w.prompts_per_step} x {w.samples_per_prompt}) and than the engine's cap of {cap} slots that "
                   "`dora plan` chooses within")
    if r.gpu_memory_utilization > 1:
        out.append(f"rollout.gpu_memory_utilization {r.gpu_memory_utilization:g} is more than all of the memory (at "
                   "most 1)")
    t, total = plan.train, spec.total_accelerators
    for name, size in (("rollout.tp", r.tp), ("rollout.ep", r.ep), ("train.tp", t.tp), ("train.pp", t.pp),
                       ("train.dp", t.dp), ("train.cp", t.cp), ("train.ep", t.ep)):
        if size > total:
            out.append(f"{name} {size:,} is more than the cluster's {total} accelerators")
    if t.tp * t.pp * t.dp * t.cp != t.accelerators:
        out.append(f"train.tp x pp x dp x cp = {t.tp} x {t.pp} x {t.dp} x {t.cp} is not train.accelerators "
                   f"{t.accelerators}")
    return out + _outside_pins(plan, spec)


def _outside_pins(plan: Any, spec: Any) -> list[str]:
    """What a saved plan sets against the spec's ``placement`` pins. The planner meets a pin exactly, except a
    cap: the engines' slots (``max_num_seqs``, what the KV cache holds may be fewer), the versions per engine (one
    outside streaming) and the packing of an older version (``consolidation_batch``, at most the slots)."""
    if spec.placement == "auto":
        return []
    p, out = spec.placement, []
    if p.colocated is not None and plan.colocated != p.colocated:
        out.append(f"colocated {str(plan.colocated).lower()}, but placement.colocated pins {str(p.colocated).lower()}")
    for side, pins, planned in (("rollout", p.rollout, plan.rollout), ("train", p.train, plan.train)):
        for name, pinned in pins.model_dump(exclude_none=True).items():
            have = getattr(planned, name)
            if side == "rollout" and name == "max_num_seqs":  # the pin is vLLM's, one attention-dp rank's
                have = -(-have // planned.attention_dp)
            capped = name in ("max_num_seqs", "versions_per_engine", "consolidation_batch")
            if have is not None and (have > pinned if capped else have != pinned):  # None: no packing planned
                out.append(f"{side}.{name} {have}, but placement.{side}.{name} pins "
                           + (f"at most {pinned}" if capped else f"{pinned}"))
    return out


def _changed_inputs(old: dict[str, Any], new: dict[str, Any], diff_command: str) -> str:
    """'; changed since: a: x -> y, ...' for a stale plan's inputs (``inputs_diff``)."""
    from dora.report import brief_changes, inputs_diff

    changes = inputs_diff(old, new)
    return f"; changed since: {brief_changes(changes)} (`{diff_command}` lists them all)" if changes else ""


def _saved_plan_spec(plan_file: Path, plan: Any) -> tuple[Any, Path]:
    """(the resolved spec of a saved plan, the directory `dora plan` ran in, as found).

    ``plan.spec_file`` is relative to the directory `dora plan` ran in, which plan.json does not record. Plans are
    written below it (``dora plan specs/x.yaml --out plans/x``), so it is looked for relative to the plan's directory
    and each of its parents, nearest first, then relative to this directory (a plan written elsewhere, applied from
    where it was planned). Where several such files exist (applying project A's plan from project B, which has a
    spec of the same name), the first whose hash is the plan's is its spec; if none is, the plan is stale against
    the nearest. Raises ``ApplyInputError``, or the nearest spec's ``SpecError``."""
    from dora.spec import SpecError, load_spec

    name = Path(plan.spec_file)
    seen: set[Path] = set()
    found: list[tuple[Any, Path]] = []  # (the resolved spec or its SpecError, the directory it was found from)
    # the parents of the path as given first: a symlinked plans/ directory's target has other parents
    for base in [*Path(os.path.abspath(plan_file)).parents, *plan_file.resolve().parents, Path.cwd()]:
        candidate = base / name
        if not _names_something(candidate, Path.is_file) or candidate.resolve() in seen:
            continue
        seen.add(candidate.resolve())
        try:
            resolved = load_spec(os.path.relpath(candidate))
        except SpecError as exc:
            found.append((exc, base))
            continue
        if resolved.spec_hash == plan.spec_hash:
            return resolved, base
        found.append((resolved, base))
    if not found:
        raise ApplyInputError(
            f"{plan_file} was planned from the spec {plan.spec_file} (its spec_file, relative to the directory "
            f"`dora plan` ran in), which is neither relative to {os.path.abspath(plan_file.parent)} or a parent of it nor in "
            "this directory; run `dora apply` from the directory it was planned in, or plan the spec again with "
            "`dora plan SPEC --out DIR`")
    nearest, base = found[0]
    if isinstance(nearest, SpecError):
        raise nearest
    return nearest, base


def _calibration_flag(plan: Any, planned_in: Path) -> tuple[str, str]:
    """(' --calibration FILE' for a plan planned with a calibration file, '' otherwise; a note saying what FILE is
    when plan.json does not name it). A file named in ``calibration_source`` ("file cal.json", relative to the
    directory `dora plan` ran in, ``planned_in``) is named from here; a measured calibration carries its own source
    text instead of its file's name."""
    from planner.calibration import CATALOG_SOURCE

    source = plan.calibration_source
    if source.startswith(CATALOG_SOURCE):
        return "", ""
    if source.startswith("file "):
        return f" --calibration {quote(os.path.relpath(planned_in / source.removeprefix('file ')))}", ""
    return " --calibration FILE", f" (FILE: the calibration file it was planned with, {source})"


def _names_something(path: Path, test: Any) -> bool:
    """``test(path)``, False for a path no file can have (too long, a NUL byte: a hand-edited plan's spec_file)."""
    try:
        return bool(test(path))
    except (OSError, ValueError):
        return False


def plan_spec(resolved: Any, mode: str | None, calibration: Any = None) -> tuple[Any, Any]:
    """Plan a resolved spec, restricted to ``mode`` when given: (the spec as run, its plan)."""
    from dora.planning import make_plan

    if mode is not None:
        from dora.spec.checks import check_placement, check_spec_staleness
        from dora.spec.diagnostics import format_path

        spec = resolved.spec
        staleness: dict[str, Any] = {"mode": mode}
        if mode == "one-step-off" and spec.staleness.max_version_lag > 1:  # within the budget; k = 0 is refused below
            staleness["max_version_lag"] = 1
        update: dict[str, Any] = {"staleness": spec.staleness.model_copy(update=staleness)}
        if mode != "streaming" and spec.placement != "auto":  # streaming-only pins do not apply (as in the runtime)
            rollout = spec.placement.rollout.model_copy(update={"versions_per_engine": None,
                                                                "consolidation_batch": None})
            update["placement"] = spec.placement.model_copy(update={"rollout": rollout})
        pinned = spec.model_copy(update=update)
        # the spec passed its checks with its own mode: what fails now fails because of --mode
        problems = check_spec_staleness(pinned.staleness) + check_placement(pinned, resolved.arch)
        if problems:
            d = problems[0]
            raise ApplyInputError(f"--mode {mode}: {d.message} ({format_path(d.path)}); to fix: {d.hint}, or "
                                  "choose another --mode")
        resolved = dataclasses.replace(resolved, spec=pinned)
    return resolved, make_plan(resolved, calibration).plan


class ApplyInputError(Exception):
    """Bad `dora apply` input that is not a spec diagnostic (stale plan, unknown mode, bad calibration)."""


def run_apply(spec_path: str, *, overrides: ApplyOverrides = ApplyOverrides(), console: Any = None,
              live: bool = True, calibration: str | None = None, address: str | None = None) -> int:
    """Implementation of ``dora apply``: returns the exit code; never raises on bad input or Ctrl-C.

    With ``address`` (a Ray dashboard URL) the lowered job is submitted to that cluster instead of run
    here (``dora.cluster``). Re-running a command whose output directory holds a checkpoint resumes it.
    """
    from dora.planning import InfeasibleError
    from dora.spec import SpecError
    from dora.spec.checks import ADDRESS_FORMS, address_problem

    console = console or make_console(stderr=True, highlight=False)
    if address is not None and (problem := address_problem(address)):  # before planning: it can take seconds
        error(console, f"--address {address!r} {problem}: write it as {ADDRESS_FORMS}")
        return EXIT_INVALID
    try:
        resolved, plan = plan_for_apply(spec_path, overrides.mode, calibration)
    except SpecError as exc:
        from dora.cli import print_spec_error

        print_spec_error(exc)
        return EXIT_INVALID
    except (ApplyInputError, InfeasibleError) as exc:
        error(console, str(exc))
        return EXIT_INVALID
    try:
        rc = runtime_config_for(resolved, overrides, plan)
    except ValueError as exc:
        error(console, f"{spec_path}: {exc}")
        return EXIT_INVALID
    if overrides.watchdog_s is not None and not 1 <= overrides.watchdog_s < math.inf:  # NaN too
        error(console, f"--watchdog-s must be a number of seconds, at least 1, got {overrides.watchdog_s:g}; leave it "
                       "out for no watchdog")
        return EXIT_INVALID
    if overrides.output_dir is not None and (bad_dir := path_problem(("--output-dir",), overrides.output_dir)):
        error(console, f"--output-dir: {bad_dir[0].message}: name a directory, or leave the flag out for the spec's "
                       f"runtime.output_dir ({resolved.output_dir})")
        return EXIT_INVALID
    try:
        check_engines(rc)
    except RuntimeConfigError as exc:
        error(console, f"{spec_path}: {exc}")
        return EXIT_INVALID
    if address is None and resolved.spec.runtime.backend == "ray-cluster":
        address = resolved.spec.runtime.address  # the spec's cluster (validation requires it for ray-cluster)
    if address is not None:
        from dora.cluster import submit_and_follow

        if not Path(rc.output_dir).is_absolute():
            error(console, f"{_output_dir_source(resolved, overrides)} {rc.output_dir!r} is relative: a job submitted "
                           "to a Ray cluster runs in a working directory of its own on the cluster's node (a temporary "
                           "one Ray removes), so its trace, checkpoints and summary would be written there and lost\n"
                           "  to fix: give an absolute path on storage the cluster's nodes share: --output-dir "
                           f"/shared/runs/{Path(rc.output_dir).name or 'run'} (for example), or runtime.output_dir "
                           "in the spec")
            return EXIT_INVALID
        code = submit_and_follow(address, resolved, plan, rc, console=console, watchdog_s=overrides.watchdog_s)
        if code == EXIT_OK:  # the job wrote its summary to the output directory, which the cluster shares
            for line in _plan_check_of_run_dir(spec_path, resolved, plan, rc):
                say(console, line)
        return code
    from dora.runtime.runlock import RunDirBusy, run_dir_lock

    with contextlib.ExitStack() as held:  # the lock is held for the checkpoint read, runtime.json and the run
        try:
            held.enter_context(run_dir_lock(Path(rc.output_dir)))
        except RunDirBusy as exc:
            error(console, str(exc))
            return EXIT_FAILED
        except OSError as exc:
            error(console, _unwritable_output(rc.output_dir, exc))
            return EXIT_INVALID
        return _run_here(spec_path, resolved, plan, rc, overrides, console=console, live=live)


def _output_dir_source(resolved: Any, overrides: ApplyOverrides) -> str:
    """Where the run's output directory was given: the flag, the spec field (with its line), or the default."""
    if overrides.output_dir:
        return "--output-dir"
    if resolved.spec.runtime.output_dir is None:
        return f"the default output directory (runtime.output_dir is not set in {resolved.file})"
    return f"runtime.output_dir ({_spec_field_place(resolved, ('runtime', 'output_dir'))})"


def _spec_field_place(resolved: Any, path: tuple[str, ...]) -> str:
    """'FILE, line N' for a field of a spec that was read and validated already (the file alone where the line is not
    found, the field given by a default)."""
    line = None
    with contextlib.suppress(Exception):  # only to point at the line
        from dora.spec.yamlio import parse_yaml

        line = parse_yaml(Path(resolved.file).read_text(encoding="utf-8"), resolved.file).line_of(path)
    return resolved.file + (f", line {line}" if line else "")


def _run_here(spec_path: str, resolved: Any, plan: Any, rc: RuntimeConfig, overrides: ApplyOverrides, *,
              console: Any, live: bool) -> int:
    """The local run of ``run_apply``, its output directory locked: resume check, runtime.json, run, report."""
    from dora.runtime.driver import JobStopped, report, run_job

    try:  # before anything is written: a refused resume leaves the run's files as they were
        check_resumable(Path(rc.output_dir), json.loads(rc.to_json()))
    except CheckpointError as exc:
        error(console, str(exc))
        return EXIT_INVALID
    workers = f"{rc.rollout_workers} rollout worker" + ("s" if rc.rollout_workers != 1 else "")
    say(console, f"dora apply {spec_path}: mode {rc.mode} (k={rc.max_version_lag}), {workers} x {rc.max_num_seqs} "
                 f"slots, {rc.steps} steps -> {rc.output_dir}/")
    say(console, f"  planned: {plan.mode} on {plan.rollout.replicas} rollout replica(s) + "
                 f"{plan.train.accelerators} training accelerator(s), predicted step "
                 f"{plan.predictions.step_time_s:.2f} s, {plan.predictions.trained_tokens_per_s:,.0f} trained tokens/s "
                 f"({plan.calibration_source})"
                 + (f"; this run overrides it with {rc.rollout_workers} rollout worker(s)"
                    if rc.rollout_workers != plan.rollout.replicas else ""))
    total = resolved.spec.total_accelerators
    if not rc.colocated and rc.rollout_accelerators + plan.train.accelerators > total:
        say(console, f"  note: {rc.rollout_accelerators} rollout + {plan.train.accelerators} training accelerator(s) "
                     f"oversubscribe the cluster's {total}: they share them, and the prediction above is the plan's, "
                     "not this run's")
    try:
        Path(rc.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(rc.output_dir) / "runtime.json").write_text(rc.to_json(), encoding="utf-8")
    except OSError as exc:
        error(console, _unwritable_output(rc.output_dir, exc))
        return EXIT_INVALID
    try:
        result = run_job(rc, console=console, live=live, watchdog_s=overrides.watchdog_s)
    except RuntimeConfigError as exc:
        error(console, f"{spec_path}: {exc}")
        return EXIT_INVALID
    except JobStopped as exc:
        error(console, str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        say(console, f"interrupted: actors stopped, Ray shut down, trace flushed to {rc.output_dir}/trace.jsonl"
                     f"{resume_hint(Path(rc.output_dir))}")
        return interrupted_exit_code(exc)
    code = report(result, console)
    if code == EXIT_OK:
        for line in plan_check(spec_path, resolved, plan, rc, result.summary):
            say(console, line)
    return code


def _plan_check_of_run_dir(spec_path: str, resolved: Any, plan: Any, rc: RuntimeConfig) -> list[str]:
    """``plan_check`` of a finished run from the summary.json in its output directory (a submitted job's)."""
    from dora.runtime.driver import read_summary

    summary = read_summary(Path(rc.output_dir))
    if not summary:
        return [f"plan vs run: not compared: no readable summary in {Path(rc.output_dir) / 'summary.json'}"]
    return plan_check(spec_path, resolved, plan, rc, summary)


PLAN_CHECK_MIN_STEPS = 10
"""A run compared with its plan's prediction has at least this many steps: its steady figures start after the first
step, and a shorter run's still hold the pipeline filling up (the plan predicts over up to 24 steps)."""
PLAN_CHECK_TOLERANCE = 0.25
"""A measured throughput further than this from the plan's prediction gets the commands that fit the cost model's
constants to this machine: published planners see 10-25% error before calibration (README), and this machine's
speed drifts about 20% from run to run."""


def plan_check(spec_path: str, resolved: Any, plan: Any, rc: RuntimeConfig, summary: dict[str, Any]) -> list[str]:
    """Lines comparing a finished local run with its plan's prediction: the steady trained tokens/s and step time,
    measured and predicted, and, when the throughput misses by more than ``PLAN_CHECK_TOLERANCE``, how to fit the
    constants to this machine (``dora calibrate --from-run``). No comparison (one line saying why) when the run
    overrode the plan's engines or slots, or ran fewer than ``PLAN_CHECK_MIN_STEPS`` steps."""
    from dora.lower.runtime import runtime_config

    planned = runtime_config(resolved, plan)
    changed = [what for what, ran, was in (
        ("rollout workers", rc.rollout_workers, planned.rollout_workers),
        ("slots per worker", rc.max_num_seqs, planned.max_num_seqs),
        ("versions per engine", rc.versions_per_engine, planned.versions_per_engine)) if ran != was]
    if changed:
        return [f"plan vs run: not compared: this run overrode the plan's {' and '.join(changed)}, and the plan "
                "predicts its own configuration"]
    measured = summary.get("steady_trained_tokens_per_s")
    steps = summary.get("steps", 0) - (summary.get("resumed_from_step") or 0)
    if measured is None or steps < PLAN_CHECK_MIN_STEPS:
        return [f"plan vs run: not compared: {steps} step(s) ran; a steady figure needs at least "
                f"{PLAN_CHECK_MIN_STEPS} (the first ones fill the pipeline)"]
    predicted = plan.predictions.trained_tokens_per_s
    miss = measured / predicted - 1
    lines = [f"plan vs run: trained {measured:,.0f} tokens/s against the {predicted:,.0f} predicted ({miss:+.0%}); "
             f"step {summary['steady_step_time_s']:.3f} s against {plan.predictions.step_time_s:.3f} s "
             f"(constants: {plan.calibration_source})"]
    if abs(miss) <= PLAN_CHECK_TOLERANCE:
        return lines
    out = rc.output_dir
    spec = quote(spec_path)
    runs = f"--from-run {quote(out)}"
    lines.append(f"  more than {PLAN_CHECK_TOLERANCE:.0%} off: this machine runs at other speeds than those "
                 "constants; fit them to it from runs like this one, then plan with the fit:")
    if rc.mode != "sync":  # the fit needs training steps with no rollout running, which only sync has
        sync_out = f"{out.rstrip('/')}-sync"
        lines.append(f"    dora apply {spec} --mode sync --steps 20 --output-dir {quote(sync_out)}")
        runs += f" --from-run {quote(sync_out)}"
    lines.append(f"    dora calibrate {spec} {runs} --out calibration.json")
    lines.append(f"    dora plan {spec} --calibration calibration.json")
    return lines


__all__ = ["ApplyOverrides", "run_apply", "runtime_config_for"]
