"""The runtime driver: run one lowered plan (``runtime.json``) to the end, then audit what happened.

    python -m dora.runtime.driver --config launch/runtime.json     # what a Ray job runs

``run_job(config)`` is the same thing in-process (``dora apply`` calls it). It starts a Ray instance of its own
when this process has none (and shuts down only what it started) -- or, inside a Ray job
(``RAY_ADDRESS`` set by the job supervisor), connects to that cluster -- runs the controller, then
reads back ``trace.jsonl`` and audits it with ``planner.schedule.check_trace`` -- the checker that
validates simulated schedules. It writes, under the run's output directory: ``trace.jsonl``,
``metrics.jsonl`` (by the controller), ``timeline.html``, ``summary.json``, the warm-up cache and
``checkpoint/``. When that directory already holds a checkpoint of the same job, the run resumes
from it (``dora.runtime.checkpoint``): re-running a killed command continues it; when the checkpoint already holds
every step, the run is only audited again (its summary then has no speed figures: nothing ran).

The local instance is Ray's ``address="local"``: one of its own, sized to this machine's cores, even when a
``ray start`` cluster runs here. On a cluster (a Ray job, or a caller's Ray) the actors reserve shares of the CPUs
that are free, and the run stops with the figures before creating them when those cannot be placed
(``_check_room``) instead of leaving them pending.

Exit codes (``main``): 0 ran and the audit passed; 1 the audit found a violation or the run failed;
2 the config is unreadable; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text

from dora.runtime.config import RuntimeConfig, RuntimeConfigError, check_engines
from dora.terminal import error, interrupted_exit_code, say

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass(frozen=True, kw_only=True)
class JobResult:
    """What one run produced: the summary (as written to ``summary.json``) and the audit verdict."""

    summary: dict[str, Any]
    audit: dict[str, Any]
    output_dir: Path
    timeline_error: str | None = None
    """Why ``timeline.html`` is missing (the audit and the summary do not depend on it); None when it was drawn."""

    @property
    def ok(self) -> bool:
        return bool(self.audit["ok"])


class JobStopped(Exception):
    """The run stopped before its end (stalled pipeline, lost worker or trainer, unusable checkpoint): a message, no
    traceback."""


def controller_config(rc: RuntimeConfig, *, base_dir: Path = Path(),
                      warmup_cache_dir: Path | None = None, cpus: float | Sequence[float] | None = None,
                      watchdog_s: float | None = None) -> Any:
    """Resolve the runtime config into the controller's objects (engine, trainer, task, policy configs).

    The task defines the vocabulary (numbers plus three specials), so the model's ``vocab_size`` is
    the task's, not the catalog preset's. Sequences fit ``4`` prompt tokens plus the response cap.
    The warm-up cache defaults to ``<output_dir>/cache``; runs that share a spec and seed can share it.
    Each engine runs one torch thread (one core); the trainer runs one per core of the plan's trainer
    (``train_accelerators``: both cores in a colocated plan, whose engines idle or stop while it trains), at most the
    cores it may use. ``cpus``: the free CPUs of each node the actors may use (a number: one node; None: this
    machine's cores); each actor reserves an equal share of them (``actor_share``).
    """
    from dora.runtime.checkpoint import config_key
    from dora.runtime.controller import ControllerConfig
    from dora.runtime.engines.tiny_model import TinyModelConfig
    from dora.runtime.engines.torch_rollout import RolloutConfig
    from dora.runtime.engines.torch_trainer import TrainerConfig
    from dora.runtime.tasks import MIN_RESPONSE_TOKENS, TaskConfig
    from planner.policies import PolicyConfig, admission_queue_for, early_steps_for, update_for
    from planner.workload import LengthDistribution

    check_engines(rc)
    if rc.task is None:
        raise RuntimeConfigError("task", "the local CPU runtime needs workload.task (the verifiable task)")
    rl = rc.response_length
    if rl.kind == "empirical":
        lengths = LengthDistribution.empirical(histogram=rl.histogram or (), max_tokens=rl.max_tokens,
                                               min_tokens=rl.min_tokens)
    else:
        lengths = LengthDistribution.lognormal(median=rl.median_tokens or 1, p99=rl.p99_tokens or 1,
                                               max_tokens=rl.max_tokens, min_tokens=rl.min_tokens)
    if rl.max_tokens < MIN_RESPONSE_TOKENS:  # the spec check refuses it first (dora.spec.checks.check_task_lengths)
        raise RuntimeConfigError("response_length.max_tokens", f"{rl.max_tokens} leaves no room for an answer of the "
                                 f"count task (one number and EOS): at least {MIN_RESPONSE_TOKENS}")
    task = TaskConfig(number_tokens=max(TaskConfig().number_tokens, rl.max_tokens - 1),
                      warmup_steps=rc.task.warmup_steps)
    m = rc.model
    model = TinyModelConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_attention_heads,
                            num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, ffn_size=m.ffn_hidden_size,
                            vocab_size=task.vocab_size, tie_embeddings=m.tie_embeddings,
                            rope_theta=m.rope_theta or TinyModelConfig.rope_theta,
                            norm_eps=m.norm_eps or TinyModelConfig.norm_eps, mlp="swiglu")
    megatron = _megatron_for_torch_engines(rc, task.vocab_size)
    a = rc.algorithm
    policy = PolicyConfig(
        mode=rc.mode, max_version_lag=rc.max_version_lag, num_rollout_groups=rc.rollout_workers,
        slots_per_group=rc.max_num_seqs, prompts_per_step=rc.prompts_per_step,
        samples_per_prompt=rc.samples_per_prompt, total_steps=rc.steps,
        allow_version_mixing=rc.allow_version_mixing, update=update_for(rc.mode, rc.allow_version_mixing),
        max_versions_per_engine=rc.versions_per_engine,
        consolidation_batch=rc.consolidation_batch,
        colocated=rc.colocated, admission_queue=admission_queue_for(rc.mode, rc.accelerator, rc.samples_per_prompt),
        early_steps=early_steps_for(rc.mode, rc.colocated, a.minibatches_per_step * a.ppo_epochs),
    )
    # A request still ingesting its prompt has no token yet: resumed on new weights it would start on a version
    # other than the one it was admitted on. Modes that interrupt in-flight requests prefill in one forward.
    nodes = [float(os.cpu_count() or 2)] if cpus is None else [cpus] if isinstance(cpus, int | float) else list(cpus)
    share = actor_share(nodes, rc.rollout_workers + 1)  # Ray CPU reservation per actor
    # the trainer's torch threads: the cores of its reservation; a colocated trainer's engines idle or stop while it
    # trains, so it may take a whole node's (on a cluster, the largest node's: which one Ray gives it is not known here)
    trainer_threads = max(1, min(rc.train_accelerators, int(max(nodes, default=0.0) if rc.colocated else share)))
    out = base_dir / rc.output_dir
    extra: dict[str, Any] = {} if watchdog_s is None else {"watchdog_s": watchdog_s}
    return ControllerConfig(
        policy=policy,
        rollout=RolloutConfig(model=model, engine=rc.rollout_engine, eos_token_id=task.eos_token_id,
                              max_num_seqs=rc.max_num_seqs,
                              max_model_len=max(rc.max_model_len, 4 + rl.max_tokens + 1), num_threads=1,
                              **({"decode_ingest_max_tokens": 0} if policy.interrupts else {})),
        trainer=TrainerConfig(model=model, learning_rate=a.learning_rate, off_policy_correction=a.off_policy_correction,
                              is_weight_cap=a.tis_cap, ppo_clip_eps=a.clip_ratio, num_minibatches=a.minibatches_per_step,
                              ppo_epochs=a.ppo_epochs, kl_coef=a.kl_coef, temperature=a.temperature,
                              num_threads=trainer_threads,
                              seed=rc.seed),
        megatron=megatron,
        task=task, response_lengths=lengths, temperature=a.temperature, seed=rc.seed, output_dir=out,
        warmup_cache_dir=warmup_cache_dir or out / "cache", worker_num_cpus=share, trainer_num_cpus=share,
        config_key=config_key(json.loads(rc.to_json())), **extra,
    )


def _megatron_for_torch_engines(rc: RuntimeConfig, vocab_size: int) -> dict[str, Any] | None:
    """``rc.megatron`` with the task's vocabulary (the runtime's model has the task's, not the preset's), after
    checking that the torch engines' model computes what it describes; None for the torch trainer."""
    if rc.megatron is None:
        return None
    from dora.runtime.engines.megatron_trainer import unsupported

    m = rc.model
    problems = unsupported(rc.megatron) + [
        f"model.{field} (the torch engines' model has none)"
        for field, present in (("qk_norm", m.qk_norm), ("qkv_bias", m.qkv_bias), ("num_experts", m.num_experts),
                               ("mla", m.mla is not None)) if present]
    if problems:
        raise RuntimeConfigError("megatron", "the Megatron trainer cannot train this model beside the torch "
                                 "engines: " + "; ".join(problems))
    config = json.loads(json.dumps(rc.megatron))
    config["gpt_model"]["vocab_size"] = vocab_size
    return config


def run_job(rc: RuntimeConfig, *, console: Any = None, live: bool = True, base_dir: Path = Path(),
            warmup_cache_dir: Path | None = None, watchdog_s: float | None = None) -> JobResult:
    """Run ``rc`` to the end (Ray started here if needed), resuming from its checkpoint if there is one;
    audit the whole trace, write the outputs. The output directory is locked meanwhile (``run_dir_lock``).

    Raises ``JobStopped`` when the run cannot go on (stalled, worker or trainer lost, foreign checkpoint, another run
    holding the output directory). ``KeyboardInterrupt`` propagates after the actors are stopped, the trace is flushed and
    the Ray instance this call started is shut down.
    """
    from dora.runtime.runlock import RunDirBusy, run_dir_lock

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(run_dir_lock(base_dir / rc.output_dir))
        except RunDirBusy as exc:
            raise JobStopped(str(exc)) from None
        return _run_job(rc, console=console, live=live, base_dir=base_dir, warmup_cache_dir=warmup_cache_dir,
                        watchdog_s=watchdog_s)


def _run_job(rc: RuntimeConfig, *, console: Any, live: bool, base_dir: Path, warmup_cache_dir: Path | None,
             watchdog_s: float | None) -> JobResult:
    import ray
    from rich.console import Console

    from dora.runtime.checkpoint import CheckpointError, prepare_resume
    from dora.runtime.controller import Controller, PipelineStalled, TrainerLost, WorkerLost
    from dora.runtime.display import LiveDisplay

    check_engines(rc)  # before Ray starts
    try:  # so is a resolution of the whole config: values that do not fit together (a group wider than an engine)
        controller_config(rc, base_dir=base_dir, warmup_cache_dir=warmup_cache_dir, watchdog_s=watchdog_s)
    except RuntimeConfigError:
        raise
    except ValueError as exc:
        raise RuntimeConfigError("", f"its values do not fit together: {exc}") from None
    console = console or Console(stderr=True)
    out = base_dir / rc.output_dir
    try:
        resume = prepare_resume(out, json.loads(rc.to_json()))
    except CheckpointError as exc:
        raise JobStopped(str(exc)) from None
    title = f"{rc.spec_name} ({rc.mode})"
    if resume is not None and resume.step >= rc.steps:
        say(console, f"{out}/ already holds {resume.step} trained steps (--steps {rc.steps}): auditing it; "
                     "raise --steps to train further, or use a new --output-dir to start over")
        return finish_job(out, _audited_again_summary(out, rc, resume.step), k=rc.max_version_lag,
                          allow_version_mixing=rc.allow_version_mixing, title=title, whole_run=True)
    if resume is not None:
        say(console, f"resuming {out}/ after step {resume.step}: {len(resume.regenerate)} admitted, untrained "
                     f"prompt group(s) regenerated on v{resume.step}")
    started = joined = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):  # inside a Ray job: join the cluster, never size it
            ray.init(log_to_driver=False, configure_logging=False)
            joined = True
        else:  # an instance of its own ("local"), even when a `ray start` cluster runs on this machine
            _quiet_token_auth_notice()
            ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        started = True
    else:
        joined = True  # the caller's Ray: others may hold its CPUs
    try:
        if joined:
            nodes = _free_cpus()
            total = float(ray.cluster_resources().get("CPU", 0.0))
        else:  # the instance just started with every core: Ray's resource view may lag its start
            nodes = [float(os.cpu_count() or 2)]
            total = nodes[0]
        config = controller_config(rc, base_dir=base_dir, warmup_cache_dir=warmup_cache_dir, cpus=nodes,
                                   watchdog_s=watchdog_s)
        config = dataclasses.replace(config, resume=resume)
        _check_room(config, nodes=nodes, total=total, place=joined, console=console)
        header = f"dora apply {rc.spec_name} — {rc.mode}, k={rc.max_version_lag}, " \
                 f"{rc.rollout_workers}x{rc.max_num_seqs} rollout slots"
        with LiveDisplay(console, header, enabled=live) as display:
            try:
                stats = Controller(config, on_progress=display.update, on_phase=display.phase).run()
            except (PipelineStalled, TrainerLost, WorkerLost) as exc:
                raise JobStopped(f"{exc}\n  trace and last checkpoint in {out}/; re-run the same command to "
                                 "resume from the checkpoint") from None
            except CheckpointError as exc:  # a checkpoint whose file reads as a zip but not as the trainer's state
                raise JobStopped(str(exc)) from None
    finally:
        if started:
            ray.shutdown()
    from dora.calibrate import machine_description

    # where this attempt's steps ran (a local run's actors run on this host): `dora calibrate --from-run` names it
    summary = {**stats.summary(), "machine": machine_description()}
    if resume is not None and stats.steps:  # the stats hold this attempt; metrics.jsonl every attempt's steps
        from dora.runtime.trace import read_jsonl, training_figures

        summary.update(training_figures(read_jsonl(config.output_dir / "metrics.jsonl")))
    return finish_job(config.output_dir, summary, k=rc.max_version_lag,
                      allow_version_mixing=rc.allow_version_mixing, title=title)


MIN_FREE_CPUS = 1.0
"""The least CPU the run's actors (the trainer and the rollout workers) may share: they compute, and each reserves an
equal share of what is free (``controller_config``); with less than one core between them they would run on cores Ray
has given to others."""
PLACEMENT_TIMEOUT_S = 60.0
"""How long a run on a shared Ray cluster waits for its actors' CPU reservations to be placed before it stops: a
request the cluster cannot grant would leave the actors pending without end (Ray waits for resources forever)."""


FREE_CPU_SETTLE_S = 5.0
"""How long a run on a shared Ray waits for its free CPUs to settle: the actors of a run that just ended (an earlier
attempt, an earlier run in the same process) give theirs back a moment after they stop."""


def actor_share(node_free_cpus: Sequence[float], actors: int) -> float:
    """The largest CPU reservation, in steps of 0.01, that each of ``actors`` can hold with every reservation on one
    node: a node with f CPUs free holds floor(f / share) of them. 0 when not even 0.01 each fits.

    The best share is one node's free CPUs split k ways, k <= ``actors``: at the best share s, cap each node's count
    at ``actors`` (the counts still add up to ``actors``); the smallest of the counted nodes' free CPUs split into
    their counts keeps every count and is no less than s, so it is s. On one node this is int(100 * f / actors) / 100.
    """
    cents = [int(f * 100 + 1e-6) for f in node_free_cpus if f > 0]  # Ray's figures are of 1e-4 CPU; 0.29 * 100 < 29
    shares = {c // k for c in cents for k in range(1, actors + 1)}
    return max((s for s in shares if s > 0 and sum(c // s for c in cents) >= actors), default=0) / 100


def _free_cpus() -> list[float]:
    """The CPUs free on each node of the Ray this process joined (no "CPU" key: none), largest first, once two reads a
    moment apart agree and at least ``MIN_FREE_CPUS`` are free in all, or after ``FREE_CPU_SETTLE_S``. Per node: each
    actor's reservation must fit on one (``actor_share``)."""
    import time

    deadline = time.monotonic() + FREE_CPU_SETTLE_S
    last = None
    while True:
        free = _node_free_cpus()
        if (sum(free) >= MIN_FREE_CPUS and free == last) or time.monotonic() > deadline:
            return free
        last = free
        time.sleep(0.25)


def _node_free_cpus() -> list[float]:
    """The CPUs free on each live node, largest first: Ray's developer API, of which ``ray.available_resources()`` is
    the sum over the nodes (and, should a Ray release move that API, the sum as if it were one node: the placement
    probe of ``_check_room`` then says when the shares do not fit)."""
    import ray

    try:
        from ray._private.state import available_resources_per_node

        per_node = available_resources_per_node().values()
    except (ImportError, AttributeError):
        return [float(ray.available_resources().get("CPU", 0.0))]
    return sorted((float(r.get("CPU", 0.0)) for r in per_node), reverse=True)


def _check_room(config: Any, *, nodes: Sequence[float], total: float, place: bool, console: Any) -> None:
    """Stop (``JobStopped``) before any actor is created when the cluster cannot hold them: less than
    ``MIN_FREE_CPUS`` free, or (``place``: a cluster shared with others, where a node's free CPUs are not another's)
    their reservations not placed within ``PLACEMENT_TIMEOUT_S``. Reservations are never more than was free, and fit
    on the nodes' free CPUs as they were (``actor_share``)."""
    free = sum(nodes)
    n = config.policy.num_rollout_groups
    actors = f"the trainer and {n} rollout worker{'s' if n != 1 else ''}"
    need = config.trainer_num_cpus + n * config.worker_num_cpus
    fix = ("\n  to fix: free CPUs on the cluster (stop jobs that hold them, or start its nodes with more: "
           "`ray start --num-cpus N`), or run fewer rollout workers (--rollout-workers)")
    if free < MIN_FREE_CPUS:
        own = (" (this job's driver holds its entrypoint_num_cpus of them)"
               if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") else "")
        raise JobStopped(f"not enough free CPU on the Ray cluster: {actors} need at least {MIN_FREE_CPUS:g} CPU "
                         f"between them, and the cluster has {free:g} free of {total:g}{own}" + fix)
    if config.worker_num_cpus <= 0 or config.trainer_num_cpus <= 0:  # shares are rounded down to 0.01 CPU
        raise JobStopped(f"not enough free CPU on the Ray cluster: {actors} reserve equal shares of the {free:g} CPU "
                         f"free{_per_node(nodes)}, in steps of 0.01, each on one node, and {n + 1} shares of 0.01 need "
                         f"{(n + 1) / 100:g}" + fix)
    if not place:
        return
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [{"CPU": config.trainer_num_cpus}] + [{"CPU": config.worker_num_cpus}] * n
    group = placement_group(bundles, strategy="PACK")
    try:
        ready = group.wait(timeout_seconds=2)
        if not ready:
            say(console, f"waiting up to {PLACEMENT_TIMEOUT_S:g} s for the Ray cluster to place {actors} "
                         f"({need:g} CPU)")
            ready = group.wait(timeout_seconds=max(0.0, PLACEMENT_TIMEOUT_S - 2))
    finally:
        remove_placement_group(group)
    if not ready:
        now = _node_free_cpus()
        raise JobStopped(f"the Ray cluster could not place {actors} in {PLACEMENT_TIMEOUT_S:g} s: they reserve "
                         f"{config.trainer_num_cpus:g} CPU (trainer) + {n} x {config.worker_num_cpus:g} (rollout "
                         f"workers) = {need:g}, and the cluster has {sum(now):g} CPU free of {total:g}{_per_node(now)}, "
                         "not where they fit (each reservation must fit on one node, and others may have taken CPUs "
                         "meanwhile)" + fix)


def _per_node(nodes: Sequence[float]) -> str:
    return f" (per node: {', '.join(f'{f:g}' for f in nodes)})" if len(nodes) > 1 else ""


def _quiet_token_auth_notice() -> None:
    """Drop Ray's notice that it turned token authentication on for the local instance dora starts (Ray's secure
    default, which stays on): a line about Ray's settings in the middle of the run's output. Only that notice;
    asking for the mode with RAY_AUTH_MODE=token instead would silence it too, but Ray reads that variable at import
    and its processes then disagree about the token."""
    import logging

    notice = "Token authentication is enabled for this Ray cluster"
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        lambda record: not record.getMessage().startswith(notice))


def _whole_run_counts(events: list[dict[str, Any]], report: Any) -> dict[str, Any]:
    """Weight loads, migrated, version-mixed, unfinished and regenerated trajectories, worker restarts and the steps
    resumed at, over every attempt of a resumed run: from its trace and the checker's report of it (a trajectory
    regenerated after a resume counts once, as it last finished; the leftovers of a killed attempt, which the resume
    recorded, count as unfinished unless regenerated)."""
    return {"weight_loads": sum(e.get("type") == "weights_loaded" for e in events),
            "migrated_trajectories": sum(len(e.get("trajs", ())) for e in events if e.get("type") == "migrated"),
            "mixed_trajectories": len(report.mixed), "unfinished_at_end": len(report.unfinished_at_end),
            "regenerated_trajectories": sum(e.get("type") == "regenerated" for e in events),
            "worker_restarts": sum(e.get("type") == "worker_restarted" for e in events),
            "resumed_at_steps": [e.get("step") for e in events if e.get("type") == "resumed"]}


def read_summary(out: Path) -> dict[str, Any]:
    """The run summary a finished run left in ``out/summary.json``; {} where there is none to read."""
    try:
        return dict(json.loads((out / "summary.json").read_text(encoding="utf-8"))["summary"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _audited_again_summary(out: Path, rc: RuntimeConfig, steps: int) -> dict[str, Any]:
    """The summary of a run that already holds its ``steps`` (the checkpoint's) and is only audited again: nothing
    runs, so it has no speed, wall time or warm-up of its own, and those of an earlier attempt (``summary.json`` is of
    the last attempt that reached its end, maybe not the last one) are not this run's. What the trained batches were
    comes from every step's ``metrics.jsonl`` row; the counts from the trace (``finish_job``'s ``whole_run``), with
    the resumes and restarts of every attempt. ``resumed_from_step`` and ``machine`` stay those of the attempt
    summary.json was of (``dora calibrate --from-run`` tells by them whether the engine steps are of the last attempt,
    and where they ran)."""
    from dora.runtime.trace import SPEED_PREFIXES, read_jsonl, training_figures

    previous = read_summary(out)
    summary: dict[str, Any] = {"mode": rc.mode, "steps": steps, "total_steps": steps, "audited_again": True,
                               "rollout_workers": rc.rollout_workers, "slots_per_worker": rc.max_num_seqs,
                               "resumed_from_step": previous.get("resumed_from_step")}
    if "machine" in previous:
        summary["machine"] = previous["machine"]
    # the only record of how fast the run went: kept, apart, as the attempt it measured
    earlier = {k: v for k, v in previous.items()
               if k.startswith(tuple(f"{p}_" for p in SPEED_PREFIXES)) or k in ("steps", "wall_s", "warmup_s",
                                                                                   "warmup_steps", "resumed_from_step")}
    if earlier:
        summary["earlier_attempt"] = earlier
    # rows edited by hand (or a file gone): the summary has no training figures, and the audit still runs
    with contextlib.suppress(OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
        rows = [r for r in read_jsonl(out / "metrics.jsonl") if isinstance(r, dict) and r.get("step", 0) <= steps]
        summary.update(training_figures(rows) if rows else {})
    return summary


def finish_job(output_dir: Path, summary: dict[str, Any], *, k: int, allow_version_mixing: bool,
               title: str, whole_run: bool = False) -> JobResult:
    """Audit ``trace.jsonl`` with the planner's checker; write ``timeline.html`` and ``summary.json``.

    The counts the trace holds come from the trace (``_whole_run_counts``) for a resumed attempt, whose counters
    held that attempt only, and with ``whole_run`` (a run audited again: ``_audited_again_summary``, which has no
    counters of its own).

    The timeline is only a picture: if drawing it fails, the audit and ``summary.json`` are written all the same, with
    the reason under ``timeline_error`` (and no stale ``timeline.html`` of an earlier attempt is left behind)."""
    from dora.runtime.trace import read_jsonl, write_json_atomic, write_text_atomic
    from planner.schedule import TraceError, check_trace, timeline_html

    events = read_jsonl(output_dir / "trace.jsonl")
    timeline_error: str | None = None
    try:
        report = check_trace(events, k=k, allow_version_mixing=allow_version_mixing)
        if whole_run or summary.get("resumed_from_step") is not None:  # the trace holds every attempt
            summary = {**summary, **_whole_run_counts(events, report)}
            if "recovery_s" in summary:  # the restart times are in no trace: this attempt's only, and named so
                summary["attempt_recovery_s"] = summary.pop("recovery_s")
        audit = {
            "ok": report.ok, "num_trajectories": report.num_trajectories, "num_consumed": report.num_consumed,
            "mixed": len(report.mixed), "unfinished_at_end": len(report.unfinished_at_end),
            "staleness_histogram": [list(p) for p in report.staleness_histogram],
            "violations": [{"constraint": v.constraint, "traj": v.traj, "step": v.step, "message": v.message}
                           for v in report.violations[:50]],
            "num_violations": len(report.violations),
        }
    except TraceError as exc:
        audit = {"ok": False, "num_trajectories": 0, "num_consumed": 0, "num_violations": len(exc.problems),
                 "violations": [{"constraint": "trace", "traj": "", "step": None, "message": p}
                                for p in exc.problems[:50]]}
        timeline_error = "not drawn: the trace is malformed (see the audit)"
    if timeline_error is None:
        try:
            write_text_atomic(output_dir / "timeline.html", timeline_html(events, title=f"dora apply — {title}"))
        except Exception as exc:  # a picture must never cost the audit and the summary
            timeline_error = f"drawing it failed: {type(exc).__name__}: {exc}"
    if timeline_error is not None:
        (output_dir / "timeline.html").unlink(missing_ok=True)
    record: dict[str, Any] = {"summary": summary, "audit": audit}
    if timeline_error is not None:
        record["timeline_error"] = timeline_error
    write_json_atomic(output_dir / "summary.json", record)
    return JobResult(summary=summary, audit=audit, output_dir=output_dir, timeline_error=timeline_error)


def report(result: JobResult, console: Any) -> int:
    """Print the summary and the audit; the exit code (violations are loud and fail the run)."""
    from dora.runtime.display import render_summary

    console.print(render_summary(result.summary, result.audit))
    if result.timeline_error is not None:
        error(console, f"no {result.output_dir / 'timeline.html'}: {result.timeline_error}", label="timeline")
    if not result.ok:
        for v in result.audit["violations"][:10]:
            console.print(Text.assemble("  ", (str(v["constraint"]), "red"), f": {v['message']}"))
        error(console, f"{result.audit['num_violations']} violation(s); see {result.output_dir / 'trace.jsonl'} and "
                       f"{result.output_dir / 'summary.json'}", label="audit failed")
        return EXIT_FAILED
    files = "trace.jsonl, metrics.jsonl, " + ("" if result.timeline_error is not None else "timeline.html, ")
    say(console, f"outputs in {result.output_dir}/ ({files}summary.json)")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    ap = argparse.ArgumentParser(prog="python -m dora.runtime.driver", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path, help="runtime.json written by lowering")
    ap.add_argument("--no-live", action="store_true", help="plain per-step lines instead of the live panel")
    ap.add_argument("--watchdog-s", type=float, help="stop with a report after this long without progress")
    args = ap.parse_args(argv)
    console = Console(stderr=True, highlight=False)
    try:
        rc = RuntimeConfig.from_json(args.config.read_text(encoding="utf-8"))
    except (OSError, RuntimeConfigError) as exc:
        error(console, f"{args.config}: {exc}")
        return EXIT_BAD_CONFIG
    try:
        result = run_job(rc, console=console, live=not args.no_live, watchdog_s=args.watchdog_s)
    except RuntimeConfigError as exc:
        error(console, f"{args.config}: {exc}")
        return EXIT_BAD_CONFIG
    except JobStopped as exc:
        error(console, str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        from dora.runtime.checkpoint import resume_hint

        say(console, f"interrupted: actors stopped, trace flushed to {rc.output_dir}/trace.jsonl"
                     f"{resume_hint(Path(rc.output_dir))}")
        return interrupted_exit_code(exc)
    code = report(result, console)
    # One machine-readable line on stdout: `dora apply --address` reads the audit back from the job's logs.
    print(AUDIT_PREFIX + json.dumps({"ok": result.ok, "audit": result.audit, "output_dir": str(result.output_dir)},
                                    sort_keys=True), flush=True)
    return code


AUDIT_PREFIX = "DORA_AUDIT "


if __name__ == "__main__":
    sys.exit(main())
