"""Assemble the deterministic ``Plan`` from a search outcome: placement, predictions, memory, candidates, warnings."""

from __future__ import annotations

from typing import Any

from planner import architecture, hardware
from planner.calibration import catalog_calibration, engine_of, is_catalog
from planner.hardware import gib
from planner.plan import (
    FORMAT_VERSION,
    Candidate,
    MemoryReport,
    Plan,
    Predictions,
    RolloutPlan,
    TrainPlan,
    format_rate,
)
from planner.policies import early_steps_for
from planner.search.core import (
    MODE_PREFERENCE,
    REFINE_MARGIN,
    REFINE_SAMPLES_BUDGET,
    REFINE_STEPS,
    STALL_FRACTION,
    TIE_FRACTION,
    SearchOutcome,
    Simulated,
    consolidation_batch,
    forced_wait,
    objective_rate,
    one_more_version_of,
    tail_stall,
    trainer_wait,
    versions_per_engine,
)
from planner.search.inputs import SearchInputs
from planner.search.screen import Screened, host_memory, train_state_bytes
from planner.weight_sync import trainer_swap_s

MAX_CONSIDERED_ROWS = 16
_GIB = float(1 << 30)


def _catalog_fingerprint() -> str:
    return f"{hardware.catalog_fingerprint()}-{architecture.catalog_fingerprint()}"


def _mean_staleness(s: Simulated) -> float:
    hist = s.sim.staleness_histogram
    total = sum(n for _, n in hist)
    return sum(k * n for k, n in hist) / total if total else 0.0


def _rollout_share(outcome: SearchOutcome) -> float:
    """Share of a synchronous step spent generating, from the best simulated sync plan (1 - trainer busy)."""
    ref = outcome.best_sync or outcome.chosen
    return max(0.0, 1.0 - ref.sim.train_busy_fraction)


def _faster_sync_elsewhere(outcome: SearchOutcome, any_placement: Simulated | None) -> Simulated | None:
    """``any_placement`` (the best sync plan with the spec's pins lifted) if it is faster than the pinned baseline."""
    pinned = outcome.best_sync.trained_tokens_per_s if outcome.best_sync else 0.0
    return any_placement if any_placement is not None and any_placement.trained_tokens_per_s > pinned else None


def _run(s: Simulated) -> str:
    """How ``s`` was simulated: its steps, and its scale when reduced (``core.scale_for``: a little fast)."""
    return f"{s.sim_steps} steps" + ("" if s.scale == 1.0 else f" at 1/{s.scale:.3g} scale")


def _candidate_rows(outcome: SearchOutcome, inputs: SearchInputs,
                    elsewhere: Simulated | None = None) -> tuple[Candidate, ...]:
    chosen = outcome.chosen

    def rate(s: Simulated) -> float:  # what the search ranked by: the objective's rate (``objective_rate``)
        return objective_rate(s, inputs)

    best = rate(chosen)
    top = max(rate(s) for s in outcome.finalists)  # ties are judged against it, as in _rank_key
    measure = "" if inputs.objective == "throughput" else ", samples/s over the whole run"
    rows: list[Candidate] = []
    sim_labels = {s.screened.label for s in outcome.finalists}

    def row(c: Screened, *, stage: str, tps: float | None, status: str, reason: str) -> Candidate:
        p = c.placement
        return Candidate(label=c.label, mode=c.mode, max_version_lag=c.k, colocated=p.colocated,
                         rollout_accelerators=p.rollout_accelerators, train_accelerators=p.train.accelerators,
                         stage=stage, trained_tokens_per_s=tps, status=status, reason=reason)  # type: ignore[arg-type]

    # the longer runs first: a short run's figure still holds the pipeline filling, so it ranks only among its like
    for s in sorted(outcome.finalists, key=lambda s: -s.sim_steps):
        if s is chosen:
            why = (f"highest simulated {'trained tokens/s' if not measure else 'samples/s over the whole run'} "
                   f"({_run(s)})" if rate(s) >= top else
                   f"ties the fastest within 1% at the lowest staleness, in the preferred mode ({_run(s)})")
            rows.append(row(s.screened, stage="simulated", tps=s.trained_tokens_per_s, status="chosen", reason=why))
            continue
        slower = 1 - rate(s) / best if best else 0.0
        if rate(s) >= top * (1 - TIE_FRACTION) and s.screened.k > chosen.screened.k:
            reason = f"ties within 1% but needs staleness k={s.screened.k} > {chosen.screened.k}"
        elif rate(s) >= top * (1 - TIE_FRACTION) and s.screened.mode != chosen.screened.mode:
            reason = (f"ties within 1% ({100 * -slower:+.1f}%) at the same staleness; {chosen.screened.mode} is "
                      f"preferred (order: {', '.join(MODE_PREFERENCE)})")
        elif s.sim_steps < chosen.sim_steps:
            reason = (f"slower by {100 * slower:.1f}% ({_run(s)}{measure}, still filling its pipeline; only plans "
                      f"near the lead run {chosen.sim_steps})")
        else:
            reason = f"slower by {100 * slower:.1f}% (simulated, {_run(s)}{measure})"
        rows.append(row(s.screened, stage="simulated", tps=s.trained_tokens_per_s, status="rejected", reason=reason))
    base = outcome.best_sync
    if base is not None and base.screened.label not in sim_labels:
        # a pinned placement holds the baseline too: say so, the speedup is not over every sync plan then
        placed = {True: " and a colocated placement", False: " and a disaggregated placement", None: ""}
        rows.append(row(base.screened, stage="simulated", tps=base.trained_tokens_per_s, status="rejected",
                        reason=f"the sync baseline of the speedup figure (the spec pins {chosen.screened.mode}"
                               f"{placed[inputs.pins.colocated]}; {_run(base)})"))
        sim_labels.add(base.screened.label)
    if elsewhere is not None and elsewhere.screened.label not in sim_labels:
        rows.append(row(elsewhere.screened, stage="simulated", tps=elsewhere.trained_tokens_per_s, status="rejected",
                        reason=f"the best sync plan on any placement (the spec's placement pins lifted; "
                               f"{_run(elsewhere)}): this plan is "
                               f"{chosen.trained_tokens_per_s / elsewhere.trained_tokens_per_s:.2f}x it"))
        sim_labels.add(elsewhere.screened.label)
    screen_best = outcome.screened[0].trained_tokens_per_s
    for c in outcome.screened:
        if len(rows) >= MAX_CONSIDERED_ROWS - 4:
            break
        if c.label in sim_labels:
            continue
        slower = 1 - c.trained_tokens_per_s / screen_best
        # its figure is the screen's estimate, not comparable with the simulated rows' (the screen ignores the tail
        # and runs high): compared with the best screen estimate, which was simulated
        rows.append(row(c, stage="screen", tps=c.trained_tokens_per_s, status="rejected",
                        reason=f"screen estimate {100 * slower:.1f}% below the best screen estimate "
                               f"({format_rate(screen_best)}); not simulated"))
    for r in outcome.rejections[:3]:
        rows.append(Candidate(label=r.what, mode=chosen.screened.mode, max_version_lag=0, colocated=False,
                              rollout_accelerators=0, train_accelerators=0, stage="screen",
                              trained_tokens_per_s=None, status="rejected", reason=r.reason))
    for mode, why in outcome.modes_not_allowed[:1]:
        rows.append(Candidate(label=f"any placement {mode}", mode=mode, max_version_lag=inputs.max_version_lag,  # type: ignore[arg-type]
                              colocated=False, rollout_accelerators=0, train_accelerators=0, stage="screen",
                              trained_tokens_per_s=None, status="rejected", reason=why))
    return tuple(rows)


def catalog_defaults_that_matter(outcome: SearchOutcome, inputs: SearchInputs) -> tuple[str, ...]:
    """Calibration fields the chosen plan's predicted times depend on that still hold their catalog default.

    Which fields enter the prediction follows the cost formulas: decode/prefill (memory and compute efficiency,
    step overhead), training (compute efficiency, step overhead, plus overlap/link factors when dp/tp/ep > 1),
    weight sync (reload cost; the scale-out link when disaggregated), MoE routing imbalance for MoE models.
    On the `cpu` accelerator the `cpu_*` fields stand in for the GPU ones (`Calibration.resolved_for`).
    """
    cal = inputs.calibration
    if inputs.accelerator.name == "cpu" and cal.source.startswith("measured"):
        return ()  # written by `dora calibrate`, which fits every field that matters (a fit may land on a default)
    default = catalog_calibration(inputs.accelerator.name, inputs.rollout_engine).to_dict()
    current = cal.to_dict()
    return tuple(f for f in _fields_that_matter(outcome, inputs) if f not in current or current[f] == default.get(f))


def _fields_that_matter(outcome: SearchOutcome, inputs: SearchInputs) -> list[str]:
    """The calibration fields the chosen plan's predicted times depend on (``catalog_defaults_that_matter``)."""
    cal = inputs.calibration
    p = outcome.chosen.screened.placement
    if inputs.accelerator.name == "cpu":
        fields = ["cpu_memory_efficiency", "cpu_compute_efficiency", "cpu_step_overhead_s",
                  "cpu_train_step_overhead_s", "weight_reload_fixed_s" if cal.cpu_weight_reload_fixed_s is None
                  else "cpu_weight_reload_fixed_s"]
        if cal.cpu_train_compute_efficiency is None:
            fields.append("cpu_train_compute_efficiency")
        if p.train.tp * p.train.pp * p.train.dp * p.train.cp > 1:
            fields.append("cpu_train_parallel_efficiency")
    else:
        fields = ["hbm_bandwidth_efficiency", "decode_compute_efficiency", "prefill_compute_efficiency",
                  "train_mfu_moe" if inputs.arch.is_moe else "train_mfu_dense", "decode_step_overhead_s",
                  "train_step_overhead_s", "weight_reload_fixed_s"]
        tr = p.train
        if p.rollout.devices > 1 or tr.tp > 1 or tr.ep > 1:
            fields.append("scale_up_efficiency")
        if not p.colocated or inputs.nodes > 1:
            fields.append("scale_out_efficiency")
        if tr.dp * tr.cp > 1:
            fields.append("dp_comm_overlap_fraction")
        if inputs.arch.is_moe:
            fields.append("moe_imbalance_factor")
            if tr.ep > 1:
                fields.append("ep_comm_overlap_fraction")
    return fields


def _secs(x: float) -> str:
    """Seconds for a warning: whole seconds at cluster scale, two significant digits for a sub-10 s CPU job."""
    return f"{x:.0f} s" if x >= 10 else f"{x:.2g} s"


def _stall_warning(outcome: SearchOutcome, share: float) -> str:
    """What the chosen plan's tail stall costs, from the simulation of one more version of staleness: beyond the
    budget (``one_more_version``), or within it (a finalist the chosen one beat or tied)."""
    c = outcome.chosen
    k = c.screened.k
    waits = f"the trainer waits {100 * share:.0f}% of each step for the oldest version's tail at k={k}"
    alt = outcome.one_more_version or one_more_version_of(c, outcome.finalists)
    if alt is None:  # the search simulates it whenever the chosen plan stalls
        return f"{waits}; a larger k or a lower response cap would shorten it"
    gain = alt.trained_tokens_per_s / c.trained_tokens_per_s - 1.0
    if gain >= 2 * TIE_FRACTION:  # only beyond the budget: within it, the search would have chosen k + 1
        return (f"{waits}: raising staleness.max_version_lag to {k + 1} trains {100 * gain:.0f}% more tokens/s "
                "(simulated); a lower response cap also shortens the tail")
    return (f"{waits}, but k={k + 1} changes trained tokens/s by only {100 * gain:+.1f}% (simulated): the rollout "
            "side, not the staleness budget, limits this plan")


TIGHT_MEMORY_FRACTION = 0.02
"""A chosen plan whose training side leaves less than this share of accelerator memory beyond its modelled need (the
reserve included) is warned about: 1.6 GiB on an 80 GB accelerator, less than one long packed row's activations."""


def _how_to_calibrate(inputs: SearchInputs) -> str:
    """What fits the constants on the spec's accelerator: `dora calibrate --from-run` fits dora's CPU engines to
    finished runs (its micro-benchmarks alone time each engine by itself, about 1.6x fast on 2 shared cores); on a
    GPU, dora measures the Megatron trainer's MFU, and the rest are written into the file by hand."""
    if inputs.accelerator.name == "cpu":
        return ("fit them to this machine: `dora calibrate SPEC --in-situ` runs the spec here three times and fits "
                "to those runs (or `dora calibrate SPEC --from-run RUN --from-run SYNC_RUN` over finished runs, a sync "
                "run among them; a `dora apply` run prints its distance from the plan)")
    return (f"on the target machines ({inputs.accelerator.name}), fit the trainer's MFU with `python "
            "bench/megatron_train.py --spec ONE_GPU_SPEC --calibration-out FILE` (a spec of the model cut to one GPU, "
            "as in bench/specs/), add what you measured of the others to FILE, and plan with `--calibration FILE` "
            "(`dora calibrate` measures the cpu engines only)")


def _warnings(outcome: SearchOutcome, inputs: SearchInputs, preds: Predictions) -> tuple[str, ...]:
    out = []
    c = outcome.chosen
    defaults = catalog_defaults_that_matter(outcome, inputs)
    if is_catalog(inputs.calibration):
        out.append(f"uncalibrated: the constants this plan depends on are catalog defaults ({', '.join(defaults)}); "
                   f"published planners see 10-25% error before calibration; {_how_to_calibrate(inputs)}")
    elif defaults and len(defaults) == len(_fields_that_matter(outcome, inputs)):
        out.append(f"calibrated, but not for this plan: the file ({inputs.calibration.source}) sets none of the "
                   f"constants it depends on ({', '.join(defaults)}), which stay catalog defaults; "
                   f"{_how_to_calibrate(inputs)}")
    elif defaults:
        out.append(f"partly calibrated ({inputs.calibration.source}): still catalog defaults: {', '.join(defaults)}")
    fitted_on = engine_of(inputs.calibration)
    if inputs.accelerator.name == "cpu" and fitted_on != inputs.rollout_engine:
        out.append(f"calibrated for another rollout engine: the cpu_* constants ({inputs.calibration.source}) describe "
                   f"the {fitted_on} engine's runs, and this spec rolls out with {inputs.rollout_engine}, whose steps, "
                   f"loads and round trips take other times; {_how_to_calibrate(inputs)}")
    if c.sim_steps < min(inputs.steps, REFINE_STEPS):
        out.append(f"chosen on {c.sim_steps}-step simulations, not {min(inputs.steps, REFINE_STEPS)}: at this batch "
                   f"size a longer run passes the planner's budget of {REFINE_SAMPLES_BUDGET:,} simulated "
                   "trajectories; a short run still holds the pipeline filling, and finalists within "
                   f"{100 * REFINE_MARGIN:.0f}% could order differently over more steps")
    stall, step = tail_stall(c)
    if c.screened.mode in ("streaming", "bounded-async") and c.sim.steps and not c.screened.placement.colocated:
        wait = trainer_wait(c)
        forced = forced_wait(c, wait)
        if forced > STALL_FRACTION * step:
            out.append(f"rollout bounds this plan: the trainer idles {100 * forced / step:.0f}% of each step because "
                       f"generating a batch takes at least {_secs(c.screened.rollout_full_s)} with every slot busy, "
                       f"against {_secs(step - wait)} of training and publishing")
    if stall > STALL_FRACTION * step:
        out.append(_stall_warning(outcome, stall / step))
    pinned_versions = inputs.pins.versions_per_engine
    if pinned_versions and pinned_versions > versions_per_engine(c.screened):
        out.append(f"placement.rollout.versions_per_engine pins {pinned_versions}, but the chosen {c.screened.mode} "
                   f"k={c.screened.k} hosts {versions_per_engine(c.screened)} per engine (only streaming hosts "
                   "several, at most k+1); the pin still reserves their memory: remove it or set staleness.mode: "
                   "streaming")
    if outcome.best_sync is not None and preds.rollout_share < 0.5 and c.screened.mode != "sync":
        out.append(f"rollout is only {100 * preds.rollout_share:.0f}% of a synchronous step: asynchronous modes "
                   "can hide little; training dominates")
    return tuple(out)


def build_plan(outcome: SearchOutcome, inputs: SearchInputs, *, dora_version: str, spec_name: str, spec_file: str,
               spec_hash: str, spec_inputs: dict[str, Any], pinned_slowdown: float | None = None,
               any_placement_sync: Simulated | None = None) -> Plan:
    """``any_placement_sync``: where the spec pins the placement, the best sync plan of a search with the pins lifted
    (``speedup_vs_sync_any_placement``; a row of the considered plans when it beats the pinned baseline)."""
    c = outcome.chosen
    s, p = c.sim, c.screened.placement
    n = inputs.total_accelerators
    # the simulation trains prompt + response tokens with one prompt length (core.simulate_candidate): what it
    # generated is the rest, from the same drawn responses as trained tokens/s (not the distribution's mean)
    prompt = max(1, round(inputs.prompt_lengths.mean_tokens()))
    lbar = inputs.response_lengths.mean_tokens()
    steady = s.step_time_s
    first = s.steps[0].duration_s if s.steps else steady
    total_time = first + max(0, inputs.steps - 1) * steady
    acc_hours = n * total_time / 3600.0
    price = inputs.price_per_accelerator_hour_usd
    baseline = outcome.best_sync.trained_tokens_per_s if outcome.best_sync else c.trained_tokens_per_s
    elsewhere = _faster_sync_elsewhere(outcome, any_placement_sync)
    sync_t = c.screened.sync_s
    # the cost counts every accelerator of the cluster, so the bubble does too: a placement that leaves some idle
    # (pinned sizes) adds them to the simulated bubble of the ones it uses
    used = p.rollout_accelerators + (0 if p.colocated else p.train.accelerators)
    bubble = 1 - (1 - s.bubble_fraction) * min(used, n) / n
    preds = Predictions(
        step_time_s=steady, generated_tokens_per_s=c.trained_tokens_per_s - c.samples_per_s * prompt,
        trained_tokens_per_s=c.trained_tokens_per_s, samples_per_s=c.samples_per_s, bubble_fraction=bubble,
        rollout_occupancy=s.rollout_slot_occupancy, rollout_share=_rollout_share(outcome),
        trainer_utilization=s.train_busy_fraction, weight_sync_s=sync_t,
        engine_swap_s=s.suspend_wall_s_total / len(s.steps) if s.steps else 0.0,
        trainer_swap_s=trainer_swap_s(inputs.accelerator, state_bytes_per_device=train_state_bytes(p),
                                      calib=inputs.calibration) if p.colocated else 0.0,
        kv_preemptions_per_step=s.preemptions / len(s.steps) if s.steps else 0.0,
        kv_recomputes_per_step=s.recomputed_sequences / len(s.steps) if s.steps else 0.0,
        kv_recomputed_tokens_per_step=s.recomputed_tokens / len(s.steps) if s.steps else 0.0,
        mean_staleness=_mean_staleness(c),
        max_live_versions=s.max_live_versions, total_time_s=total_time, accelerator_hours=acc_hours,
        cost_usd=acc_hours * price if price is not None else None,
        speedup_vs_sync=c.trained_tokens_per_s / baseline if baseline else 1.0,
        speedup_vs_sync_any_placement=(c.trained_tokens_per_s / elsewhere.trained_tokens_per_s
                                       if elsewhere is not None else None),
        overlap_ceiling_tokens_per_s=outcome.overlap_ceiling[0] if outcome.overlap_ceiling else None,
    )
    ro, tr = p.rollout, p.train
    rollout = RolloutPlan(
        accelerators=p.rollout_accelerators, tp=ro.tp, ep=ro.ep, replicas=p.replicas, accelerators_per_replica=ro.devices,
        max_num_seqs=ro.slots, max_model_len=inputs.max_context_tokens,
        versions_per_engine=versions_per_engine(c.screened),
        consolidation_batch=consolidation_batch(c.screened),
        gpu_memory_utilization=inputs.gpu_memory_utilization, kv_capacity_tokens=ro.memory.kv_capacity_tokens)
    train = TrainPlan(accelerators=tr.accelerators, tp=tr.tp, pp=tr.pp, ep=tr.ep, dp=tr.dp, cp=tr.cp,
                      num_microbatches=max(1, round(inputs.batch_samples * (lbar + inputs.prompt_lengths.mean_tokens())
                                                    / (tr.dp * tr.micro_batch_tokens))),
                      micro_batch_tokens=tr.micro_batch_tokens, recompute=tr.recompute != "none")
    rm, tm = ro.memory, tr.memory
    memory: tuple[MemoryReport, ...] = (
        MemoryReport(side="rollout", need_bytes=rm.usable_bytes_per_device, have_bytes=inputs.accelerator.hbm_bytes,
                     detail={"weights": rm.weights_bytes_per_device, "extra_versions": rm.extra_version_bytes_per_device,
                             "kv_cache": rm.kv_bytes_per_device, "reserved": rm.reserved_bytes_per_device}),
        MemoryReport(side="train", need_bytes=tm.total_bytes, have_bytes=tm.capacity_bytes,
                     detail={"params": tm.params_bytes, "grads": tm.grads_bytes, "optimizer": tm.optimizer_bytes,
                             "activations": tm.activations_bytes, "reserved": tm.reserved_bytes}),
    )
    host = host_memory(p, c.screened.mode, inputs)
    if host is not None:
        memory += (MemoryReport(side="host", need_bytes=host.need_bytes, have_bytes=host.have_bytes,
                                detail=host.detail),)
    warnings = list(_warnings(outcome, inputs, preds))
    if tm.total_bytes > (1 - TIGHT_MEMORY_FRACTION) * tm.capacity_bytes and inputs.accelerator.name != "cpu":
        left = 1 - tm.total_bytes / tm.capacity_bytes
        warnings.append(f"training memory is planned at {gib(tm.total_bytes)} of {gib(tm.capacity_bytes)} GiB per "
                        f"accelerator ({100 * left:.2f}% left): the model's {gib(tm.reserved_bytes)} GiB reserve "
                        "(CUDA context, NCCL buffers, allocator fragmentation) is the whole margin. dora's Megatron "
                        "trainer peaked 3-17% below this model in five runs on an H100 (README), but if a run runs "
                        "out of memory, pin placement.train.pp higher" + ("" if p.colocated else
                                                                           " or placement.train.accelerators larger"))
    if used < n:
        warnings.append(f"the placement uses {used} of the cluster's {n} accelerators; the other {n - used} stay idle "
                        "and are still paid for (accelerator-hours, cost and the bubble fraction count them): pin "
                        "larger sides, or a smaller cluster")
    if pinned_slowdown is not None and pinned_slowdown > 0.02:
        warnings.append(f"the pinned placement is {100 * pinned_slowdown:.0f}% slower than the best unpinned plan "
                        "(screen estimate); remove pins to let the planner choose")
    return Plan(
        format_version=FORMAT_VERSION, dora_version=dora_version, spec_name=spec_name, spec_file=spec_file,
        spec_hash=spec_hash, inputs=spec_inputs, catalog_fingerprint=_catalog_fingerprint(),
        calibration_fingerprint=inputs.calibration.fingerprint(), calibration_source=inputs.calibration.source,
        seed=inputs.seed, objective=inputs.objective, mode=c.screened.mode, max_version_lag=c.screened.k,
        allow_version_mixing=inputs.allow_version_mixing, colocated=p.colocated,
        early_steps=inputs.early_steps and early_steps_for(c.screened.mode, p.colocated, inputs.optimizer_steps),
        rollout=rollout, train=train,
        memory=memory, predictions=preds, considered=_candidate_rows(outcome, inputs, elsewhere),
        warnings=tuple(warnings),
    )

