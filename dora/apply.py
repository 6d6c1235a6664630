"""`dora apply SPEC`: load the spec, decide the runtime config, run it locally, audit it, report.

``run_apply`` is the whole command (the CLI only parses arguments). Until the planner search lands,
the runtime config comes from ``runtime_config_for`` -- the spec plus explicit overrides -- which is
the one function to replace with "plan -> lower -> RuntimeConfig".

Exit codes: 0 the run finished and its audit passed; 1 the run failed or the audit found a violation
of the three constraints; 2 invalid spec or overrides; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dora.runtime.config import FORMAT_VERSION, AlgorithmConfig, RuntimeConfig, TaskConfig

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130

DEFAULT_MODE = "streaming"
"""What ``staleness.mode: auto`` runs until the planner search picks the mode."""
DEFAULT_ROLLOUT_WORKERS = 2
"""Rollout groups on the local machine when nothing pins them (2 cores: two engines plus the trainer)."""
DEFAULT_MAX_NUM_SEQS = 32
"""Slots per local rollout worker when nothing pins them."""


@dataclass(frozen=True, kw_only=True)
class ApplyOverrides:
    """Command-line overrides of the spec (``None``: take the spec's value or the default)."""

    mode: str | None = None
    steps: int | None = None
    rollout_workers: int | None = None
    max_num_seqs: int | None = None
    output_dir: str | None = None


def runtime_config_for(resolved: Any, overrides: ApplyOverrides) -> RuntimeConfig:
    """The RuntimeConfig of one local run: the spec's values, the overrides, and local defaults.

    Stand-in for the planner: the mode is the override, else the spec's pinned mode, else
    ``DEFAULT_MODE``; the rollout side is the pinned placement, else the local defaults.
    Raises ``ValueError`` with the offending option named when the result is not runnable.
    """
    from dora.lower.runtime import CHECKPOINT_DIR, METRICS_FILE, TRACE_FILE, _lengths, _model
    from planner.policies import MODES, PolicyConfig

    for flag, value in (("--steps", overrides.steps), ("--rollout-workers", overrides.rollout_workers),
                        ("--max-num-seqs", overrides.max_num_seqs)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    spec = resolved.spec
    w, st = spec.workload, spec.staleness
    mode = overrides.mode or (st.mode if st.mode != "auto" else DEFAULT_MODE)
    if mode not in MODES:
        raise ValueError(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    pinned = spec.placement if not isinstance(spec.placement, str) else None
    workers = overrides.rollout_workers or (pinned.rollout.accelerators if pinned and pinned.rollout.accelerators
                                           else DEFAULT_ROLLOUT_WORKERS)
    slots = overrides.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    steps = overrides.steps or w.steps
    k = 0 if mode == "sync" else st.max_version_lag
    if mode == "one-step-off":
        k = max(k, 1)
    task = TaskConfig(name=w.task.name, warmup_steps=w.task.warmup_steps) if w.task is not None else None
    try:  # the policy's own validation, with its arithmetic, before anything starts
        PolicyConfig(mode=mode, max_version_lag=k, num_rollout_groups=workers, slots_per_group=slots,  # type: ignore[arg-type]
                     prompts_per_step=w.prompts_per_step, samples_per_prompt=w.samples_per_prompt,
                     total_steps=steps, allow_version_mixing=st.allow_version_mixing)
    except ValueError as exc:
        raise ValueError(f"mode {mode}: {exc}") from None
    return RuntimeConfig(
        format_version=FORMAT_VERSION, spec_hash=resolved.spec_hash, spec_name=spec.name, mode=mode,  # type: ignore[arg-type]
        max_version_lag=k, allow_version_mixing=st.allow_version_mixing, versions_per_engine=1, colocated=False,
        rollout_workers=workers, max_num_seqs=slots,
        max_model_len=w.prompt_length.max_tokens + w.response_length.max_tokens,
        accelerator=spec.cluster.accelerator, accelerators_per_rollout_worker=1, rollout_accelerators=workers,
        train_accelerators=1, train_micro_batch_tokens=0, train_num_microbatches=spec.algorithm.minibatches_per_step,
        prompts_per_step=w.prompts_per_step, samples_per_prompt=w.samples_per_prompt, steps=steps,
        prompt_length=_lengths(w.prompt_length, resolved.prompt_lengths),
        response_length=_lengths(w.response_length, resolved.response_lengths),
        task=task, algorithm=AlgorithmConfig(**spec.algorithm.model_dump()), model=_model(resolved),
        rollout_engine=spec.runtime.rollout_engine, trainer=spec.runtime.trainer, seed=spec.runtime.seed,
        output_dir=overrides.output_dir or resolved.output_dir, trace_file=TRACE_FILE, metrics_file=METRICS_FILE,
        checkpoint_dir=CHECKPOINT_DIR,
    )


def run_apply(spec_path: str, *, overrides: ApplyOverrides = ApplyOverrides(), console: Any = None,
              live: bool = True) -> int:
    """Implementation of ``dora apply``: returns the exit code; never raises on bad input or Ctrl-C."""
    from rich.console import Console

    from dora.runtime.config import RuntimeConfigError
    from dora.runtime.driver import report, run_job
    from dora.spec import SpecError, load_spec

    console = console or Console(stderr=True, highlight=False)
    try:
        resolved = load_spec(spec_path)
    except SpecError as exc:
        from dora.cli import print_spec_error

        print_spec_error(exc)
        return EXIT_INVALID
    try:
        rc = runtime_config_for(resolved, overrides)
    except ValueError as exc:
        console.print(f"[bold red]error[/bold red]: {spec_path}: {exc}")
        return EXIT_INVALID
    if resolved.spec.runtime.backend != "local":
        console.print(f"[bold red]error[/bold red]: {spec_path}: runtime.backend is "
                      f"{resolved.spec.runtime.backend!r}; this `dora apply` runs local specs only")
        return EXIT_INVALID
    console.print(f"dora apply {spec_path}: mode {rc.mode} (k={rc.max_version_lag}), {rc.rollout_workers} rollout "
                  f"workers x {rc.max_num_seqs} slots, {rc.steps} steps -> {rc.output_dir}/", highlight=False)
    Path(rc.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(rc.output_dir) / "runtime.json").write_text(rc.to_json(), encoding="utf-8")
    try:
        result = run_job(rc, console=console, live=live)
    except RuntimeConfigError as exc:
        console.print(f"[bold red]error[/bold red]: {spec_path}: {exc}")
        return EXIT_INVALID
    except KeyboardInterrupt:
        console.print(f"interrupted: actors stopped, Ray shut down, trace flushed to {rc.output_dir}/trace.jsonl")
        return EXIT_INTERRUPTED
    return report(result, console)


__all__ = ["ApplyOverrides", "run_apply", "runtime_config_for"]
