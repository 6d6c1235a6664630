"""The two-stage search: screen every candidate analytically, simulate the most promising few.

Stage 1 enumerates placements (colocated time-sharing, and disaggregated splits x rollout engine layout x the
fastest fitting training layout for the split) and every (mode, k) the spec allows, scoring each with
``planner.search.screen``. Disaggregated splits start on a coarse grid and are refined around the best ones.
Stage 2 runs the discrete-event simulator (the same policy objects the runtime drives) on the finalists: the
screen's best few overall, the best of each mode, the best colocated and disaggregated sync plans and the screen's
best few sync plans (the speedup baseline), then, on the placements that tie for the lead, every (mode, k) that would
win the tie. The leaders and the best simulated sync plan are then simulated again over more steps
(``REFINE_STEPS``), until the best few and the best sync plan all have the longer run. From the plans within
``SPLIT_MARGIN`` of the best and the best sync plan, a split search steps to the neighbouring disaggregated splits of
the same engine layout (from a colocated plan, to that layout's best split by the screen) and simulates them, for up
to ``SPLIT_STEPS`` rounds: the screen ranks one layout's splits less well than the layouts. The chosen plan is the
finalist with the highest simulated trained tokens/s; ties (within 1%) go to lower staleness, then the preferred
mode. A chosen streaming or bounded-async plan whose trainer stalls on the oldest version's tail (``tail_stall``) is
simulated again at k + 1: within the budget as one more candidate (until the chosen one no longer stalls or already
beat its k + 1), beyond it as a what-if the report quotes (``SearchOutcome.one_more_version``). A large batch is
simulated at a reduced scale (``scale_for``), which runs a little fast; before that last step the leader and the sync
plans near the best sync plan run again on the whole cluster, until every reduced-scale run that could still lead has
(``WHOLE_MARGIN``): the chosen plan, its what-if and the baseline are whole-cluster runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.hardware import gib
from planner.policies import PolicyConfig, admission_queue_for, early_steps_for, update_for
from planner.policies.config import Mode
from planner.search.inputs import SearchInputs
from planner.search.screen import Placement, Screen, Screened, host_memory, train_state_bytes
from planner.search.space import Rejection, Space
from planner.sim import SimResult, StepTiming, simulate
from planner.sim.costmodel import cost_model_timing
from planner.workload import Workload

TIE_FRACTION = 0.01
"""Simulated throughputs within 1% are a tie, broken towards lower staleness (fresher data), then the mode that
keeps every constraint with the least machinery (``MODE_PREFERENCE``), then the label."""
TIE_SCREEN_MARGIN = 0.10
"""The tie check skips a candidate whose screen estimate, times the highest simulation/screen ratio among the
finalists and this margin, stays below the tie band (the ratio spans 0.93-1.23 on the 10,240-GPU spec)."""
MODE_PREFERENCE = ("streaming", "one-step-off", "bounded-async", "sync", "partial-rollout")
"""Streaming neither drains nor interrupts; bounded-async drains engines at every update; partial-rollout mixes."""


class InfeasibleError(Exception):
    """Nothing fits; carries the closest candidate and what it lacks."""

    def __init__(self, message: str, closest: Rejection | None, headline: str | None = None,
                 also: tuple[Rejection, ...] = ()):
        super().__init__(message)
        self.closest = closest
        self.also = also
        """The closest candidate of each other side that has no layout either (training, when the rollout is short
        too)."""
        self.headline = message if headline is None else headline
        """The message without the closest candidate's detail, for a caller that prints that detail itself."""


@dataclass(frozen=True, kw_only=True)
class Simulated:
    screened: Screened
    sim: SimResult
    sim_steps: int
    scale: float = 1.0
    """The simulation ran about 1/scale of the replicas and of the batch (see ``scale_for``); rates scale back."""

    @property
    def trained_tokens_per_s(self) -> float:
        return self.sim.tokens_per_s * self.scale

    @property
    def samples_per_s(self) -> float:
        return self.sim.samples_per_s * self.scale


@dataclass(frozen=True, kw_only=True)
class SearchOutcome:
    chosen: Simulated
    best_sync: Simulated | None
    """The best simulated sync plan, over the refined steps: the baseline of the reported speedup. When the spec pins
    another mode it is a baseline only (not among ``finalists``)."""
    finalists: tuple[Simulated, ...]
    screened: tuple[Screened, ...]
    """Every screened candidate, best first."""
    rejections: tuple[Rejection, ...]
    modes_not_allowed: tuple[tuple[str, str], ...]
    """(mode, why) for modes the spec's constraints exclude."""
    overlap_ceiling: tuple[float, str] | None = None
    """(trained tokens/s, placement label): the best ``Screen.overlap_ceiling`` over every placement searched, what a
    perfect schedule would reach under the cost model: no simulated plan should beat it by more than the sampling of
    its drawn lengths (the ceiling takes the distribution's means; the review found 17 of 606 simulated candidates of
    the dense examples above their placement's ceiling, by at most 0.05%) (``ceiling_by_kind`` splits it)."""
    ceiling_by_kind: tuple[tuple[str, float, str], ...] = ()
    """(``colocated`` or ``disaggregated``, trained tokens/s, placement label): the best ceiling of each kind of
    placement searched."""
    one_more_version: Simulated | None = None
    """When the chosen plan's trainer stalls on the oldest version's tail (``tail_stall``) and the spec's budget
    stops at its k: the same placement and mode at k + 1, simulated as long, to say what a larger budget buys."""


def tail_stall(c: Simulated) -> tuple[float, float]:
    """(trainer wait per step the schedule could avoid, step time) for a streaming or bounded-async plan; (0, step)
    otherwise. The wait is the steady steps' mean (the first, which waits for a whole batch, only when it is the sole
    step), less what no schedule avoids: rollout at full occupancy needing longer than the trainer's own work."""
    step = c.sim.step_time_s
    if c.screened.mode not in ("streaming", "bounded-async") or not c.sim.steps:
        return 0.0, step
    wait = trainer_wait(c)
    return wait - forced_wait(c, wait), step


def trainer_wait(c: Simulated) -> float:
    """The trainer's mean wait per step for finished groups (``tail_stall``)."""
    waits = [st.trainer_wait_s for st in c.sim.steps[1:]] or [c.sim.steps[0].trainer_wait_s]
    return sum(waits) / len(waits)


def forced_wait(c: Simulated, wait: float) -> float:
    """The part of a trainer wait per step that rollout at full occupancy forces (``tail_stall``): what it needs beyond
    the trainer's own work; colocated, where the two take turns, all of it."""
    if c.screened.placement.colocated:
        return min(wait, c.screened.rollout_full_s)
    return min(wait, max(0.0, c.screened.rollout_full_s - (c.sim.step_time_s - wait)))


def one_more_version_of(c: Simulated, sims: Sequence[Simulated]) -> Simulated | None:
    """The simulation in ``sims`` of ``c``'s placement and mode at k + 1, as long as ``c``'s, if there is one."""
    return next((s for s in sims if s.screened.placement == c.screened.placement and s.screened.mode == c.screened.mode
                 and s.screened.k == c.screened.k + 1 and s.sim_steps == c.sim_steps and s.scale == c.scale), None)


STALL_FRACTION = 0.10
"""A tail stall above this share of the step is reported, with what one more version of staleness would buy."""


EVERY_K_UP_TO = 8
"""Staleness budgets up to this are searched at every k; above it, on a ladder (``staleness_ladder``)."""


def staleness_ladder(budget: int) -> list[int]:
    """The k searched under a staleness budget: every k up to EVERY_K_UP_TO, then 12, 16, 24, 32, 48, ... and the
    budget itself. Neighbouring large k simulate within a tie of each other, and the leading placement's every k
    was simulated (67 steps each at k = 64): dense-8b with a budget of 64 and version mixing took 55 s to plan, 192
    (mode, k) simulations of one placement, and chose k=7."""
    ladder = set(range(1, min(budget, EVERY_K_UP_TO) + 1))
    ladder |= {b << i for b in (8, 12) for i in range(budget.bit_length()) if (b << i) <= budget}
    return sorted(ladder | ({budget} if budget >= 1 else set()))


def mode_ks(inputs: SearchInputs, colocated: bool) -> list[tuple[Mode, int]]:
    k = inputs.max_version_lag
    out: list[tuple[Mode, int]] = []
    for mode in inputs.modes:
        if colocated and mode not in ("sync", "streaming"):
            continue  # the other modes overlap rollout with training, which needs separate accelerators
        if mode == "sync":
            out.append((mode, 0))
        elif mode == "one-step-off":
            if k >= 1:
                out.append((mode, 1))
        elif k >= 1:
            out.extend((mode, kk) for kk in staleness_ladder(k))
    return out


def _placements(space: Space, screen: Screen) -> list[Placement]:
    inp = space.inp
    n = inp.total_accelerators
    pins = inp.pins
    out: list[Placement] = []
    for ro in space.rollout_options:
        if pins.colocated is not False and n % ro.devices == 0 and not (
                (pins.rollout_accelerators and pins.rollout_accelerators != n)
                or (pins.train_accelerators and pins.train_accelerators != n)):  # colocated: all N do both
            train = space.best_train(n)
            if train is not None:
                out.append(Placement(colocated=True, rollout=ro, rollout_accelerators=n, train=train))
        if pins.colocated is True or n < 2:
            continue
        sizes = space.train_sizes(ro.devices)
        disagg = _disaggregated(space, ro, sizes)
        if disagg and not (pins.train_accelerators or pins.rollout_accelerators):
            best = max(disagg, key=lambda p: (screen.evaluate(p, "streaming" if inp.max_version_lag else "sync",
                                                               min(1, inp.max_version_lag)).trained_tokens_per_s))
            disagg += _disaggregated(space, ro, [t for t in space.refine_sizes(best.train.accelerators, ro.devices)
                                                 if t not in sizes])
        out.extend(disagg)
    return out


def _fits_host(space: Space, p: Placement, mode: Mode, seen: set[tuple[str, str]]) -> bool:
    """Whether colocated placement ``p`` in ``mode`` fits its host memory (``screen.host_memory``); each one that does
    not is recorded once in ``space.rejections``."""
    host = host_memory(p, mode, space.inp)
    if host is None or host.fits:
        return True
    if (p.label, mode) not in seen:
        seen.add((p.label, mode))
        inp = space.inp
        node = inp.accelerator.host_memory_bytes_per_node or 0.0
        parts = ", ".join(f"{name} {gib(v)}" for name, v in host.detail.items() if v)
        space.rejections.append(Rejection(
            what=f"{p.label} {mode}", need_over_have=host.need_bytes / host.have_bytes,
            reason=(f"does not fit host memory: {gib(host.need_bytes)} GiB per accelerator ({parts} GiB) against its "
                    f"{gib(host.have_bytes)} GiB share of the node's {gib(node, 0)} GiB over {inp.accelerators_per_node}"
                    " accelerators (cluster.host_memory_gib_per_node: set it to the servers' host memory; or pin "
                    "placement.colocated: false)")))
    return False


def _with_pack(p: Placement, pack: int) -> Placement:
    return dataclasses.replace(p, rollout=dataclasses.replace(p.rollout, consolidation_batch=pack, pack_stepped=True))


def _pack_step(sims: list[Simulated], screen: Screen, inputs: SearchInputs,
               simulated: Callable[[Screened, int], Simulated], map_fn: MapFn) -> list[Simulated]:
    """The packing step (see ``search``): from the best ``PACK_TOP`` simulated streaming plans within ``SPLIT_MARGIN``
    of the best plan, and the best of each kind of placement within it, the same plan with its packing cap halved and
    doubled (within 1 .. its slots), then on in the direction that gained more than a tie, up to ``PACK_STEPS`` more
    times. Returns the simulations that gained more than a tie over the plan they stepped from (one that only ties it
    is noise, not a better plan)."""
    best_rate = max(objective_rate(s, inputs) for s in sims)
    near = [s for s in sims if s.screened.mode == "streaming" and not s.screened.placement.rollout.pack_stepped
            and objective_rate(s, inputs) >= best_rate * (1 - SPLIT_MARGIN)]
    # and the best of each kind of placement: the 560B example's colocated plan, third, gains 12% from its cap
    starts = near[:PACK_TOP] + [s for s in (next((s for s in near if s.screened.placement.colocated == colocated), None)
                                            for colocated in (False, True)) if s is not None and s not in near[:PACK_TOP]]
    done = {s.screened.label for s in sims}
    out: list[Simulated] = []  # the gains

    def pack(s: Simulated) -> int:
        return s.screened.placement.rollout.consolidation_batch

    def step(todo: list[tuple[Simulated, float]]) -> list[tuple[Simulated, float, Simulated]]:
        """Simulate each (plan, factor)'s plan with its cap times factor: (the new one, factor, the plan)."""
        todo = [(s, x) for s, x in todo if 1 <= round(pack(s) * x) <= s.screened.placement.rollout.slots
                and round(pack(s) * x) != pack(s)]
        cands = [(s, x, screen.evaluate(_with_pack(s.screened.placement, round(pack(s) * x)), s.screened.mode,
                                        s.screened.k)) for s, x in todo]
        cands = [(s, x, c) for s, x, c in cands if c.label not in done]
        done.update(c.label for _, _, c in cands)
        found: list[tuple[Simulated, float, Simulated]] = []
        for n in sorted({s.sim_steps for s, _, _ in cands}):  # each at the length of the run it steps from
            at_n = [(s, x, c) for s, x, c in cands if s.sim_steps == n]
            found += [(f, x, s) for (s, x, _), f in zip(at_n, map_fn(_at_steps(simulated, n), [c for *_, c in at_n]),
                                                        strict=True)]
        out.extend(f for f, _, origin in found if gains(f, origin))
        return found

    def gains(new: Simulated, old: Simulated) -> bool:
        return objective_rate(new, inputs) > objective_rate(old, inputs) * (1 + TIE_FRACTION)

    first = step([(s, x) for s in starts for x in (0.5, 2.0)])
    walks: list[tuple[Simulated, float]] = []  # each start's better neighbour, where it gains, and its direction
    for s in starts:
        better = [(f, x) for f, x, origin in first if origin is s and gains(f, s)]
        walks += [max(better, key=lambda fx: objective_rate(fx[0], inputs))] if better else []
    for _ in range(PACK_STEPS):
        walks = [(f, x) for f, x, origin in step(walks) if gains(f, origin)]
        if not walks:
            break
    return out


def _at_steps(simulated: Callable[[Screened, int], Simulated], steps: int) -> Callable[[Screened], Simulated]:
    def run(c: Screened) -> Simulated:
        return simulated(c, steps)

    return run


def _neighbour_splits(placements: list[Placement], p: Placement) -> list[Placement]:
    """The disaggregated placements of ``p``'s engine layout with the next smaller and the next larger training share."""
    same = sorted((q for q in placements if not q.colocated and q.rollout == p.rollout),
                  key=lambda q: q.train.accelerators)
    i = next((j for j, q in enumerate(same) if q == p), None)
    if i is None:
        return []
    return [same[j] for j in (i - 1, i + 1) if 0 <= j < len(same)]


def _disaggregated(space: Space, ro, sizes: list[int]) -> list[Placement]:
    inp = space.inp
    out = []
    for t in sizes:
        r = inp.pins.rollout_accelerators or inp.total_accelerators - t
        if r % ro.devices or r < ro.devices or r + t > inp.total_accelerators:
            continue
        train = space.best_train(t)
        if train is not None:
            out.append(Placement(colocated=False, rollout=ro, rollout_accelerators=r, train=train))
    return out


SIM_SAMPLES_BUDGET = 60_000
"""Trajectories one finalist's simulation may generate; larger runs are simulated at a reduced scale."""
SEARCH_SAMPLES_BUDGET = 500_000
"""Trajectories all finalists together may generate (about 3-4 s of simulation on one core)."""
MAX_SCALE = {"sync": 8.0}
"""How far a finalist's simulation may be scaled down (see ``scale_for``). Measured on the 10,240-accelerator example
(bench/simulate_scale.py): streaming's simulated step time at 1/2 scale is within 7% of the full cluster's but 31%
optimistic at 1/4 (fewer replicas hold the oldest version's tail on fewer, faster-decoding engines); sync stayed within
5% of the full cluster down to 1/8 then, and ran 7-8% fast at 1/8 on 2026-11-25 (``WHOLE_MARGIN``): the search ranks
at these scales and reruns its leaders on the whole cluster."""
DEFAULT_MAX_SCALE = 2.0
SYNC_SCALE_BIAS = 0.08
"""How much faster than on the whole cluster a sync plan may run at its reduced scale (``MAX_SCALE``; see
``WHOLE_MARGIN``): the sync plans this close to the best are run on the whole cluster with it."""
MIN_SCALED_REPLICAS = 2
"""A reduced-scale simulation keeps at least this many replicas (all of them, if fewer): one replica holds one
version's tail and no other engine finishes early. The 235B example's best sync plan, 4 replicas simulated as 1, ran
18% faster than on the whole cluster (75.6K trained tokens/s against 62.1K), as 2 within 1.4%."""
WHOLE_MARGIN = 0.01
"""The last look runs the leading plan, and the best sync plan, again on the whole cluster, then every reduced-scale
run within this of the best whole-cluster one (of the best sync one), until none is left: the chosen plan and the
baseline are whole-cluster runs. A reduced-scale run is faster than the whole cluster, so one below the best whole run
cannot lead; the margin covers the rest, noise. Against the whole cluster, on the MoE examples' chosen plans
(2026-11-25): sync at 1/2 scale ran 1.4-1.5% fast, at 1/4 3.5-6.0% (8 to 20 replicas), at 1/8 7.0-7.9%, 4 replicas as
1 18%; streaming at 1/2 3.8% fast on 4 replicas and 0.2% slow to 0.1% fast on 32 and 56: fewer replicas draw fewer
chances of one slow one."""
MAX_BATCH_SAMPLES = 1_000_000
"""The largest batch (prompts x samples per step) the search plans. A finalist is simulated at no less than 1/2 scale
(1/8 in sync) for at least 3 steps, so its shortest simulation generates at least 1.5 trajectories per batch sample:
~15 s for this batch at the simulator's ~100K trajectories/s (bench/simulate_scale.py), a few minutes for a whole
search. The largest example spec (moe-scale-x10240) has 65,536."""
MAX_CPU_CORES = 1024
"""The largest ``cpu`` cluster the search plans. The ``cpu`` accelerator is dora's embedded runtime on one host: its
engines and trainer slow each other down (``StepTiming.engine_contention``), which the simulator re-checks across
every replica as engines start and stop decoding, so its cost grows with the square of the replicas. 1,024 cores
plan in ~7 s (local-tiny's workload); 8,192 took ~6 min."""
MAX_ACCELERATORS = 1 << 17
"""The largest cluster the search plans, 131,072 accelerators: its simulations grow with the replicas (every replica
loads every version), so that a spec plans in under a minute. On 131,072 H800 the dense-32b workload plans in ~25 s
and the dense-8b one in ~43 s (on 1,024,000 the dense-32b workload took 107-180 s, with no way to tell it from a
hang). The largest example has 10,240; the largest RL runs published use tens of thousands. ``cpu`` clusters have
their own, lower limit (``MAX_CPU_CORES``)."""



def sim_steps_for(inputs: SearchInputs) -> int:
    """Enough steps for the pipeline to fill (k + 3) and show a steady state."""
    return max(3, min(inputs.steps, max(6, inputs.max_version_lag + 3)))


REFINE_STEPS = 24
"""Steps of the leading finalists' second, longer simulation. The short runs (``sim_steps_for``) mostly show the
pipeline filling: on the dense-32b and 235B examples the asynchronous finalists' throughput moved by 7-16% between
6 and 24 simulated steps, and their order changed (streaming's stalls at the staleness bound come in bursts a few
steps apart; bounded-async's backlog builds up over several steps)."""
REFINE_SAMPLES_BUDGET = 200_000
"""Trajectories one refined simulation may generate (at the usual reduced scale)."""
REFINE_TOP = 3
"""The refined simulation runs on the top candidates until the best REFINE_TOP all have it."""
REFINE_MARGIN = 0.12
"""A finalist whose short run is within this of the best long one gets the long run too. Between 6 and 24 steps the
dense-8b finalists at k=3 moved by -21% to +14% (a streaming candidate 9.7% behind after 6 steps led by 2.8% after
24), so a short-run gap this size decides nothing."""
SPLIT_MARGIN = 0.06
"""The split search steps from the simulated plans within this of the best, and from the best sync plan. dense-8b at
k=5 stepped from a tp2 split 4.8% behind the best to one 4.9% ahead of it."""
SPLIT_TOP = 8
"""At most this many plans to step from per round: the best k of each placement and mode (its other k step alike)."""
SPLIT_STEPS = 2
"""Rounds of the split search: each simulates the neighbouring splits of the plans that lead after the last. Two
reach dense-8b's best at k=4 and 5; a third cost the 4,096- and 10,240-GPU MoE plans 0.5 s and changed nothing."""
PACK_TOP = 2
"""The packing step starts from this many of the best simulated streaming plans (see ``search``)."""
PACK_STEPS = 3
"""Doublings (or halvings) of the packing cap the step tries beyond the first pair, while each gains."""
SYNC_BASELINE_CANDIDATES = 4
"""Sync candidates simulated, best by the screen first, for the baseline of the speedup figure; the best of them by
simulation also gets the refined run."""


def refine_steps_for(inputs: SearchInputs, short: int) -> int:
    """Steps of the refined simulations; ``short`` (no refinement) when the budget allows less than twice that."""
    per_step = inputs.batch_samples / DEFAULT_MAX_SCALE
    steps = min(inputs.steps, REFINE_STEPS, int(REFINE_SAMPLES_BUDGET // per_step))
    return steps if steps >= 2 * short else short


@dataclass(frozen=True)
class Scaled:
    replicas: int
    prompts_per_step: int
    factor: float
    """Full batch / simulated batch: rates are multiplied by it, the trainer is charged for the full batch."""


def scale_for(inputs: SearchInputs, replicas: int, steps: int, max_factor: float = DEFAULT_MAX_SCALE,
              budget: float = SIM_SAMPLES_BUDGET) -> Scaled:
    """Reduced-scale simulation for very large specs.

    Rollout replicas are identical and share one admission queue, so R/f replicas serving P/f prompt groups, with
    the trainer charged for the full batch, follow about the same step-time dynamics as the whole cluster as long as
    the scaled batch still samples the tail and the replicas hold it as the full cluster would (``max_factor``,
    ``MIN_SCALED_REPLICAS``). The prompt count is scaled by exactly the replica ratio actually used, so the
    slots-per-prompt balance is unchanged. Fewer replicas still run a little fast (``WHOLE_MARGIN``): the search
    simulates its leaders again on the whole cluster.
    """
    f = max(1.0, inputs.batch_samples * steps / budget)
    f = min(f, max_factor, float(replicas))
    r = max(min(replicas, MIN_SCALED_REPLICAS), round(replicas / f))
    if r == replicas:
        return Scaled(replicas=replicas, prompts_per_step=inputs.prompts_per_step, factor=1.0)
    prompts = max(1, round(inputs.prompts_per_step * r / replicas))
    return Scaled(replicas=r, prompts_per_step=prompts, factor=inputs.prompts_per_step / prompts)


@dataclass(frozen=True, kw_only=True)
class _ScaledTrainTiming:
    """The trainer of the full cluster, fed 1/scale of the batch: charge it for the whole batch."""

    inner: StepTiming
    scale: float

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def train_step_s(self, num_tokens: int, sum_sq_seq_len: float, num_seqs: int) -> float:
        s = self.scale
        return self.inner.train_step_s(round(num_tokens * s), sum_sq_seq_len * s, round(num_seqs * s))


def consolidation_batch(c: Screened) -> int | None:
    """The packing cap of candidate ``c``'s policy: its engine's (``RolloutOption.consolidation_batch``) in streaming,
    None in the modes that never consolidate."""
    return c.placement.rollout.consolidation_batch if c.mode == "streaming" else None


def versions_per_engine(c: Screened) -> int:
    """Versions one engine replica hosts for candidate ``c``: only streaming hosts several (at most k+1)."""
    return min(c.placement.rollout.versions, c.k + 1) if c.mode == "streaming" else 1


def simulate_candidate(space: Space, c: Screened, *, steps: int, scale: Scaled | None = None,
                       record_events: bool = False) -> SimResult:
    inp, p = space.inp, c.placement
    timing: StepTiming = cost_model_timing(
        inp.arch, rollout_acc=inp.accelerator, train_acc=inp.accelerator, rollout_tp=p.rollout.tp,
        rollout_ep=p.rollout.ep, rollout_dp=p.rollout.dp, num_rollout_groups=p.replicas, train_tp=p.train.tp, train_pp=p.train.pp,
        train_dp=p.train.dp, train_ep=p.train.ep, train_cp=p.train.cp, train_recompute=p.train.recompute,
        colocated=p.colocated, dtype_bytes=inp.dtype_bytes, rollout_weight_bytes=inp.rollout_weight_bytes,
        micro_batch_tokens=p.train.micro_batch_tokens,
        extra_forward_passes=inp.extra_forward_passes, optimizer_steps=inp.optimizer_steps,
        longest_seq_tokens=space.longest_seq_tokens, calib=inp.calibration,
        accelerators_per_node=inp.accelerators_per_node, train_state_bytes_per_device=train_state_bytes(p))
    scale = scale or Scaled(replicas=p.replicas, prompts_per_step=inp.prompts_per_step, factor=1.0)
    if scale.factor != 1.0:
        timing = _ScaledTrainTiming(inner=timing, scale=scale.factor)  # type: ignore[assignment]
    config = PolicyConfig(
        mode=c.mode, max_version_lag=c.k, num_rollout_groups=scale.replicas, slots_per_group=p.rollout.slots,
        prompts_per_step=scale.prompts_per_step, samples_per_prompt=inp.samples_per_prompt,
        total_steps=steps, allow_version_mixing=inp.allow_version_mixing,
        update=update_for(c.mode, inp.allow_version_mixing),
        colocated=p.colocated, max_versions_per_engine=versions_per_engine(c),
        consolidation_batch=consolidation_batch(c),
        admission_queue=admission_queue_for(c.mode, inp.accelerator.name, inp.samples_per_prompt),
        early_steps=inp.early_steps and early_steps_for(c.mode, p.colocated, inp.optimizer_steps))
    workload = Workload(response_length=inp.response_lengths, prompt_tokens=max(1, round(space.prompt_mean)),
                        length_per_prompt=inp.lengths_per_prompt)
    return simulate(config, workload, timing, seed=inp.seed, record_events=record_events,
                    accelerators_per_group=p.rollout.devices,
                    train_accelerators=max(1, round(p.train.accelerators * scale.replicas / p.replicas)),
                    kv_capacity_tokens=p.rollout.memory.kv_capacity_tokens or math.inf, attention_dp=p.rollout.dp)


def _scaled_contenders(ranked: list[Simulated], rate: Callable[[Simulated], float],
                       ahead: float = 0.0) -> list[Simulated]:
    """The reduced-scale runs of ``ranked`` (best first) that could still lead once run on the whole cluster: while the
    first is one, it and those within ``ahead`` of it (the ones its whole-cluster run would likely leave in the race:
    run together, the runs wait for one another once, not once each); else those within ``WHOLE_MARGIN`` of the best
    whole-cluster run (a reduced-scale run is optimistic but for noise, ``MIN_SCALED_REPLICAS``)."""
    if not ranked:
        return []
    if ranked[0].scale != 1.0:
        first = rate(ranked[0])
        return [s for s in ranked if s.scale != 1.0 and rate(s) >= first * (1 - ahead)]
    best = max(rate(s) for s in ranked if s.scale == 1.0)
    return [s for s in ranked if s.scale != 1.0 and rate(s) >= best * (1 - WHOLE_MARGIN)]


def _pick_finalists(screened: list[Screened], limit: int, per_mode: bool) -> list[Screened]:
    chosen: dict[str, Screened] = {}

    def add(c: Screened | None) -> None:
        if c is not None and c.label not in chosen:
            chosen[c.label] = c

    for c in screened[:limit]:
        add(c)
    if per_mode:
        # the best of each mode on each kind of placement: colocated streaming's screen estimate sat above every
        # disaggregated one on local-tiny and dense-8b at k=4, so no disaggregated streaming plan was simulated, and
        # one simulated 3.3-6.9% faster than the plan chosen
        # and apart for engines with attention data parallelism (see below)
        for mode, colocated, dpa in sorted({(c.mode, c.placement.colocated, c.placement.rollout.dp > 1)
                                            for c in screened}):
            add(next((c for c in screened if c.mode == mode and c.placement.colocated == colocated
                      and (c.placement.rollout.dp > 1) == dpa), None))
        # colocated streaming's rollout turns run below full occupancy by an amount the screen does not see, and it
        # differs between engine layouts (235B: the screen puts tp8x64 6% above tp16x32, which simulates 7% faster):
        # the best of each layout is a finalist (a colocated placement per layout: a handful)
        for ro in sorted({c.placement.rollout.label for c in screened if c.placement.colocated}):
            add(next((c for c in screened if c.mode == "streaming" and c.placement.colocated
                      and c.placement.rollout.label == ro), None))
    add(next((c for c in screened if c.mode == "sync" and c.placement.colocated), None))
    add(next((c for c in screened if c.mode == "sync" and not c.placement.colocated), None))
    # the best streaming plan of each kind of placement, whatever the budget: the screen cannot see how far below full
    # occupancy colocated streaming's rollout turns run, and on the 560B example (two finalists) left out the colocated
    # plan that simulates 5.5% faster than the disaggregated one chosen
    for colocated in (False, True):
        add(next((c for c in screened if c.mode == "streaming" and c.placement.colocated == colocated), None))
    # the best engines without attention data parallelism, whatever the budget: the screen does not see a dp engine's
    # busiest rank nor its KV cache split by rank, and put the 10,240-GPU MoE's dp32 engines 16% above its tp32 ones,
    # which then simulated 30% faster
    for colocated in (False, True):
        add(next((c for c in screened if c.placement.rollout.dp == 1 and c.mode != "sync"
                  and c.placement.colocated == colocated), None))
    return list(chosen.values())


def _rank(sims: list[Simulated], inputs: SearchInputs) -> None:
    """Sort ``sims`` best first (``_rank_key``), in place."""
    best_rate = max(objective_rate(s, inputs) for s in sims)
    sims.sort(key=lambda s: _rank_key(s, best_rate, inputs))


def _syncs(sims: list[Simulated], baseline: list[Simulated]) -> list[Simulated]:
    """The simulated sync plans, candidates and baseline alike, fastest first."""
    return sorted((s for s in sims + baseline if s.screened.mode == "sync"),
                  key=lambda s: (-s.trained_tokens_per_s, s.screened.label))


def _tie_key(c: Screened) -> tuple[int, int]:
    return c.k, MODE_PREFERENCE.index(c.mode)


def _rank_key(s: Simulated, best: float, inputs: SearchInputs | None = None) -> tuple:
    """Sort key of the finalists, best first; ``best`` is the highest ``objective_rate`` among them."""
    rate = objective_rate(s, inputs)
    within_tie = rate >= best * (1 - TIE_FRACTION)
    tie_break = _tie_key(s.screened) if within_tie else (0, 0)
    return (not within_tie, *tie_break, -rate, s.screened.label)


def objective_rate(s: Simulated, inputs: SearchInputs | None) -> float:
    """What the finalists are ranked by (higher is better; ties within ``TIE_FRACTION``). ``objective: throughput``:
    trained tokens/s in the steady state. ``time``: samples per second over the whole run, the inverse of its time,
    ``inputs.steps`` steps of which the first is the simulation's own (the pipeline fills; the plan's total_time_s).
    ``cost``, dollars per sample, ranks as ``time``: every accelerator of the cluster is paid for the whole run, so
    its cost is proportional to its time."""
    if inputs is None or inputs.objective == "throughput" or not s.sim.steps:
        return s.trained_tokens_per_s
    total = s.sim.steps[0].duration_s + max(0, inputs.steps - 1) * s.sim.step_time_s
    return inputs.steps * inputs.batch_samples / total if total > 0 else s.trained_tokens_per_s


def _hosts(p: Placement, mode: Mode, k: int) -> bool:
    """Is ``p``'s versions-per-engine meaningful for ``mode`` at lag ``k``? Several versions per engine only
    in streaming, at most k + 1; a pinned count is kept for every mode (it is clamped by ``versions_per_engine``)."""
    v = p.rollout.versions
    return v == 1 or (mode == "streaming" and v <= k + 1) or not p.rollout.versions_searched


MapFn = Callable[[Callable[[Screened], Simulated], Sequence[Screened]], list[Simulated]]


def _map_in_process(fn: Callable[[Screened], Simulated], items: Sequence[Screened]) -> list[Simulated]:
    return [fn(c) for c in items]


def search(inputs: SearchInputs, *, finalists: int | None = None, exhaustive: bool = False,
           map_fn: MapFn = _map_in_process) -> SearchOutcome:
    """Plan the spec: see the module docstring. ``exhaustive`` simulates every screened candidate (tests).

    ``map_fn(fn, candidates)`` runs the simulations, in order; the caller may spread them over processes (the
    result does not depend on it)."""
    if inputs.total_accelerators > MAX_ACCELERATORS:
        raise ValueError(f"{inputs.total_accelerators:,} accelerators is over MAX_ACCELERATORS ({MAX_ACCELERATORS:,})")
    if inputs.accelerator.name == "cpu" and inputs.total_accelerators > MAX_CPU_CORES:
        raise ValueError(f"{inputs.total_accelerators:,} cpu cores is over MAX_CPU_CORES ({MAX_CPU_CORES:,})")
    if inputs.batch_samples > MAX_BATCH_SAMPLES:
        raise ValueError(f"a batch of {inputs.batch_samples:,} trajectories per step is over MAX_BATCH_SAMPLES "
                         f"({MAX_BATCH_SAMPLES:,}), the most the search simulates")
    space = Space(inputs)
    screen = Screen(space)
    placements = _placements(space, screen)
    # an exact tie of screen estimates is a k the screen cannot see (its tail term does not bind): the larger k, whose
    # pipeline has more slack, goes first (a tie in simulation still goes to the lower k, see _rank_key)
    host_rejected: set[tuple[str, str]] = set()
    screened = sorted((screen.evaluate(p, mode, k) for p in placements for mode, k in mode_ks(inputs, p.colocated)
                       if _hosts(p, mode, k) and _fits_host(space, p, mode, host_rejected)),
                      key=lambda c: (-c.trained_tokens_per_s, -c.k, c.label))
    rejections = tuple(sorted(space.rejections, key=lambda r: (r.need_over_have, r.what)))
    if not screened and host_rejected:  # every placement fits the accelerators, and none the host memory
        labels = {f"{label} {mode}" for label, mode in host_rejected}
        nearest = next(r for r in rejections if r.what in labels)
        headline = f"no placement fits {inputs.arch.name} on {inputs.total_accelerators} x {inputs.accelerator.name}"
        raise InfeasibleError(f"{headline}; closest: {nearest.what}: {nearest.reason}", nearest, headline)
    if not screened:
        # the closest rejection of each side that has no layout at all (rollout tp1 short of slots and training out
        # of memory on one accelerator: both stop it, and the rollout's shortfall alone read as the blocker)
        if inputs.pins.colocated is not False:
            space.best_train(inputs.total_accelerators)  # tried even with no rollout layout: colocated, it has them all
            rejections = tuple(sorted(space.rejections, key=lambda r: (r.need_over_have, r.what)))
        sides = space.blocked_sides()
        by_side = [next((r for r in rejections if r.what.startswith(side)), None) for side in sides]
        blockers = sorted((r for r in by_side if r is not None), key=lambda r: (r.need_over_have, r.what))
        closest = blockers[0] if blockers else rejections[0] if rejections else None
        detail = f"closest: {closest.what}: {closest.reason}" if closest else "no layout divides the accelerators"
        headline = f"no placement fits {inputs.arch.name} on {inputs.total_accelerators} x {inputs.accelerator.name}"
        raise InfeasibleError(f"{headline}; {detail}", closest, headline if closest else None,
                              also=tuple(blockers[1:]))
    steps = sim_steps_for(inputs)
    per_sim = inputs.batch_samples * steps / min(DEFAULT_MAX_SCALE, max(1.0, inputs.batch_samples * steps
                                                                        / SIM_SAMPLES_BUDGET))
    if finalists is None:
        finalists = max(2, min(12, int(SEARCH_SAMPLES_BUDGET // per_sim) - 4))
    picked = screened if exhaustive else _pick_finalists(screened, finalists, per_mode=finalists >= 6)

    def simulated(c: Screened, steps: int = steps) -> Simulated:
        scaled = scale_for(inputs, c.placement.replicas, steps, MAX_SCALE.get(c.mode, DEFAULT_MAX_SCALE))
        return Simulated(screened=c, sim=simulate_candidate(space, c, steps=steps, scale=scaled), sim_steps=steps,
                         scale=scaled.factor)

    # The sync baseline of the speedup the report gives: the screen's best few sync candidates, simulated (the screen
    # misorders close sync layouts: on the 235B example its second simulates 9% faster than its first). Where the
    # spec allows sync they are candidates like any other; where it pins another mode, a baseline only.
    sync_allowed = "sync" in inputs.modes
    sync_pool = (c for c in screened if c.mode == "sync") if sync_allowed else sorted(
        (screen.evaluate(p, "sync", 0) for p in placements if _hosts(p, "sync", 0)
         and _fits_host(space, p, "sync", host_rejected)),
        key=lambda c: (-c.trained_tokens_per_s, c.label))
    picked_labels = {c.label for c in picked}
    pool = list(sync_pool)
    # and the best of each kind of placement and engine (with attention data parallelism or not), whatever the screen
    # says: on the 10,240-GPU example it put four dp16 and dp32 sync plans first, and a tp32 one, not simulated,
    # simulated 8% faster than the best of those (356.6K trained tokens/s against 329.5K), which flattered the speedup
    sync_kinds = sorted({(c.placement.colocated, c.placement.rollout.dp > 1) for c in pool})
    firsts = [next(c for c in pool if (c.placement.colocated, c.placement.rollout.dp > 1) == kind)
              for kind in sync_kinds]
    baseline_todo = [c for c in {c.label: c for c in pool[:SYNC_BASELINE_CANDIDATES] + firsts}.values()
                     if c.label not in picked_labels]
    # The screen's leader, when it is asynchronous at the budget's k, gets its k + 1 simulated alongside, in parallel:
    # if it is chosen and stalls on the tail, the report quotes what one more version buys (a what-if, see below).
    top = screened[0]
    ahead = (screen.evaluate(top.placement, top.mode, top.k + 1) if not exhaustive and top.k == inputs.max_version_lag
             and top.mode in ("streaming", "bounded-async") else None)
    # One parallel batch for the finalists, the what-if and the baseline (none depends on another's result: a batch
    # waits for its slowest simulation, so fewer batches leave the cores idle less).
    first = map_fn(simulated, picked + ([ahead] if ahead is not None else []) + baseline_todo)
    sims = first[:len(picked)]
    what_if = {s.screened.label: s for s in first[len(picked):] if s.screened.k > inputs.max_version_lag}
    baseline = [s for s in first[len(picked):] if s.screened.k <= inputs.max_version_lag]
    if sync_allowed:
        sims += baseline
        baseline = []
    # The screen ranks the (mode, k) of one placement less well than it ranks placements. On the placements that
    # lead (within a tie of the best), simulate each (mode, k) the screen ranked too low to be a finalist but which
    # could reach the band: its screen estimate times the most optimistic simulation/screen ratio of the first
    # finalists (plus a margin). Again for the placements that lead after the longer runs below: a short-run leader
    # is not always the long-run one (small-gpu: the first check ran on a colocated placement, the long runs crowned a
    # disaggregated one whose streaming k=2, never simulated, was 2.7% faster).
    optimism = max(s.trained_tokens_per_s / s.screened.trained_tokens_per_s for s in sims) * (1 + TIE_SCREEN_MARGIN)
    checked: set[Placement] = set()
    # Second look: the leaders again over more steps, until the best REFINE_TOP all ran the long simulation; and the
    # sync baseline too, so that the speedup compares runs of the same length.
    long = refine_steps_for(inputs, steps)

    def refined(c: Screened) -> Simulated:
        return simulated(c, long)

    short: dict[str, float] = {}  # label -> trained tokens/s of its short run, for the refined ones
    while True:
        best = max(s.trained_tokens_per_s for s in sims)
        leading = {s.screened.placement for s in sims if s.trained_tokens_per_s >= best * (1 - TIE_FRACTION)} - checked
        if not leading and short:
            break
        checked |= leading
        done = {s.screened.label for s in sims + baseline}
        sims += map_fn(simulated, [c for c in screened if c.placement in leading and c.label not in done
                                   and c.trained_tokens_per_s * optimism >= best * (1 - TIE_FRACTION)])
        while True:
            best = max(s.trained_tokens_per_s for s in sims)
            _rank(sims, inputs)
            syncs = _syncs(sims, baseline)
            todo = [s for s in sims[:REFINE_TOP] + syncs[:1] if s.sim_steps < long]
            if short:
                # A short run is not comparable with a long one (the pipeline still fills): one within REFINE_MARGIN
                # of the best, or that the largest gain a refined run showed would lift within a tie of it, is
                # refined too rather than ranked out on its short figure.
                gain = max(1 + REFINE_MARGIN, *(s.trained_tokens_per_s / short[s.screened.label]
                                                for s in sims if s.screened.label in short))
                todo += [s for s in sims[REFINE_TOP:] if s.sim_steps < long
                         and s.trained_tokens_per_s * gain >= best * (1 - TIE_FRACTION)]
            if not todo:
                break
            short.update((s.screened.label, s.trained_tokens_per_s) for s in todo)
            again = {s.screened.label: s for s in map_fn(refined, list({s.screened.label: s.screened for s in todo}
                                                                       .values()))}
            sims = [again.get(s.screened.label, s) for s in sims]
            baseline = [again.get(s.screened.label, s) for s in baseline]
        if not short:  # nothing to refine (a short spec): one look at the leading placements is all
            break
    # Third look: the split. The screen ranks the disaggregated splits of one engine layout less well than the layouts
    # themselves (dense-8b at k=4: it put R40(tp2x20)/T24 streaming 31st, below R48(tp2x24)/T16, and the former
    # simulates 4.7% faster). From each of the best few simulated plans and the best sync plan, step to the
    # neighbouring splits of the same engine layout, mode and k (from a colocated plan: to its layout's split the
    # screen puts first; dense-8b at k=5 chose colocated tp2 streaming, 4.6% below tp2 on R40/T24), and again from
    # the new leaders.
    stepped: set[str] = set()
    best_tps = best_sync_tps = 0.0

    def hopeful(c: Screened) -> bool:
        """Whether ``c`` could come within the margin of the best plan (a sync one: of the best sync plan) at the most
        optimistic simulation/screen ratio of the first finalists."""
        return c.trained_tokens_per_s * optimism >= (best_sync_tps if c.mode == "sync" else best_tps) * (1 - SPLIT_MARGIN)

    for _ in range(SPLIT_STEPS):
        done = {s.screened.label for s in sims + baseline}
        best_tps = max(s.trained_tokens_per_s for s in sims)
        best_sync_tps = syncs[0].trained_tokens_per_s if syncs else 0.0
        best_rate = max(objective_rate(s, inputs) for s in sims)
        near: dict[tuple[str, str], Simulated] = {}  # the best k of each placement and mode: its others step alike
        for s in sims:
            if objective_rate(s, inputs) >= best_rate * (1 - SPLIT_MARGIN):
                near.setdefault((s.screened.placement.label, s.screened.mode), s)
        from_here = [s for s in list(near.values())[:SPLIT_TOP] + syncs[:1] if s.screened.label not in stepped]
        stepped.update(s.screened.label for s in from_here)
        todo_split: dict[str, tuple[Screened, int]] = {}
        for s in from_here:
            for p in _neighbour_splits(placements, s.screened.placement):
                cand = screen.evaluate(p, s.screened.mode, s.screened.k)
                if cand.label not in done and _hosts(p, cand.mode, cand.k) and hopeful(cand):
                    todo_split.setdefault(cand.label, (cand, s.sim_steps))
            if s.screened.placement.colocated:  # the engine layout, disaggregated: its split the screen puts first
                split = max((screen.evaluate(p, s.screened.mode, s.screened.k)
                             for p in placements if not p.colocated and p.rollout == s.screened.placement.rollout
                             and _hosts(p, s.screened.mode, s.screened.k)),
                            key=lambda c: (c.trained_tokens_per_s, c.label), default=None)
                if split is not None and split.label not in done and hopeful(split):
                    todo_split.setdefault(split.label, (split, s.sim_steps))
        if not todo_split:
            break
        found: list[Simulated] = []
        for n in sorted({n for _, n in todo_split.values()}):  # each at the length of the run it steps from
            found += map_fn(_at_steps(simulated, n), [cand for cand, m in todo_split.values() if m == n])
        if sync_allowed:
            sims += found
        else:
            sims += [f for f in found if f.screened.mode != "sync"]
            baseline += [f for f in found if f.screened.mode == "sync"]
        _rank(sims, inputs)
        syncs = _syncs(sims, baseline)
    # Fourth look: the packing of older versions. The knee rule's cap (``RolloutOption.consolidation_batch``) is a
    # closed form; simulated against caps twice and half as large it was best or within 0.2% on the dense examples'
    # plans, but 1.7% short on the 235B example's (tp4dp8 engines, colocated), 8% on the same engines disaggregated,
    # and 5.5% on the 560B's colocated tp4dp8 plan (2026-11-24). From the best streaming plans, halve and double the
    # cap (both at once, in parallel), then keep going the way that gained, while it gains.
    if inputs.pins.consolidation_batch is None:
        sims += _pack_step(sims, screen, inputs, simulated, map_fn)
        _rank(sims, inputs)
    excluded = []
    if "partial-rollout" not in inputs.modes and not inputs.allow_version_mixing:
        excluded.append(("partial-rollout", "violates consistency: resumes trajectories on new weights; the spec "
                                            "forbids version mixing"))
    if inputs.max_version_lag == 0:
        excluded.extend((m, "violates staleness: needs k >= 1, the budget is 0")
                        for m in ("one-step-off", "bounded-async", "streaming"))
    kinds: dict[str, tuple[float, str]] = {}
    for p in placements:
        kind = "colocated" if p.colocated else "disaggregated"
        kinds[kind] = max(kinds.get(kind, (0.0, "")), (screen.overlap_ceiling(p), p.label))
    by_kind = tuple((kind, *kinds[kind]) for kind in ("colocated", "disaggregated") if kind in kinds)
    ceiling = max(kinds.values(), default=None)
    # Last look: the whole cluster. A reduced-scale run is a little fast, by an amount that depends on the replica
    # count (``WHOLE_MARGIN``), so the leaders and the sync plans near the best run again on the whole cluster, until
    # every plan within the margin of the best has. The figures dora reports are these; the KV cache's too (half the
    # batch holds fewer of the longest responses: on the dense-32b example the 1/2-scale run counted 2.5 preemptions a
    # step against 9.7 for the whole cluster).
    def whole(c: Screened, steps: int) -> Simulated:
        return Simulated(screened=c, sim=simulate_candidate(space, c, steps=steps), sim_steps=steps)

    def settle(sims: list[Simulated], baseline: list[Simulated]) -> tuple[list[Simulated], list[Simulated]]:
        while True:
            _rank(sims, inputs)
            syncs = _syncs(sims, baseline)
            rerun = {s.screened.label: s for s in _scaled_contenders(sims, lambda s: objective_rate(s, inputs))}
            rerun.update((s.screened.label, s) for s in _scaled_contenders(syncs, lambda s: s.trained_tokens_per_s,
                                                                          ahead=SYNC_SCALE_BIAS))
            if not rerun:
                return sims, baseline
            todo = [(s.screened, s.sim_steps) for s in rerun.values()]
            lead = sims[0]
            stall, step = tail_stall(lead)
            if lead.scale != 1.0 and stall > STALL_FRACTION * step:  # its k + 1, which the loop below will want
                ahead = screen.evaluate(lead.screened.placement, lead.screened.mode, lead.screened.k + 1)
                known = what_if.get(ahead.label)
                if known is None or known.scale != 1.0 or known.sim_steps != lead.sim_steps:
                    todo.append((ahead, lead.sim_steps))
            # the slowest first (sync runs quickest), so that the processes finish together
            todo.sort(key=lambda cn: cn[0].mode == "sync")
            wholes: dict[str, Simulated] = {}
            for n in sorted({n for _, n in todo}):
                wholes.update((s.screened.label, s) for s in map_fn(_at_steps(whole, n), [c for c, m in todo if m == n]))
            what_if.update((label, s) for label, s in wholes.items() if label not in rerun)
            sims = [wholes.get(s.screened.label, s) for s in sims]
            baseline = [wholes.get(s.screened.label, s) for s in baseline]

    sims, baseline = settle(sims, baseline)
    # A chosen plan that stalls on the oldest version's tail: what would one more version of staleness buy? Within the
    # budget, that candidate competes (the screen may have ranked it too low to be simulated); beyond it, it is a
    # what-if for the report. Either runs as the chosen plan did: as long, on the whole cluster.
    one_more = None
    while True:
        c = sims[0]
        stall, step = tail_stall(c)
        k = c.screened.k + 1
        if stall <= STALL_FRACTION * step or one_more_version_of(c, sims) is not None:
            break
        candidate = screen.evaluate(c.screened.placement, c.screened.mode, k)
        alt = what_if.get(candidate.label)
        if alt is None or alt.sim_steps != c.sim_steps or alt.scale != c.scale:
            alt = whole(candidate, c.sim_steps) if c.scale == 1.0 else simulated(candidate, c.sim_steps)
        if k > inputs.max_version_lag:
            one_more = alt
            break
        sims = [s for s in sims if s.screened.label != alt.screened.label] + [alt]  # a shorter or scaled run of it
        sims, baseline = settle(sims, baseline)
    syncs = _syncs(sims, baseline)
    return SearchOutcome(chosen=sims[0], best_sync=syncs[0] if syncs else None, finalists=tuple(sims),
                         screened=tuple(screened), rejections=rejections, modes_not_allowed=tuple(excluded),
                         overlap_ceiling=ceiling, ceiling_by_kind=by_kind, one_more_version=one_more)
