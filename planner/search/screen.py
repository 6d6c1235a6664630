"""The analytic screen: a closed-form step time for every (placement, mode, k) candidate.

Notation (seconds unless noted): N = samples per step, Lbar = mean response, Lmax = expected longest of N
responses (the N/(N+1) quantile, capped at the generation limit; over the P prompt groups when a group's samples
share one length), R = rollout replicas, S = slots each,
t(B) = decode step time of one replica at batch B and the mean context, T_train = training step,
T_pub = trainer-side publish (gather/convert), T_load = replica weight load. On a colocated placement T_train includes
moving the trainer's state to host memory and back (``weight_sync.trainer_swap_s``): the engines have its memory
while they roll out. Trained tokens/s = N * (Pbar + Lbar) / T,
with Pbar the mean prompt: prompt and response tokens, the simulator's definition.

    T_thr   = N * Lbar / (R * S / t(S))             generation at full occupancy (no tail)
    T_tail  = Lmax * t(max(1, S/8))                 the longest response, decoded while its replica drains
    T_prefill = (N / G) / R * prefill(Pbar)        one prefill of each prompt group's shared prompt (G samples each);
                                                    on CPU a prompt of <= 8 tokens is fed through decode instead:
                                                    T_prefill = 0 and T_thr counts Lbar + Pbar - 1 positions
    T_gen   = max(T_thr, T_tail) + T_prefill        a synchronous batch in one wave (N <= R*S)
            = T_thr + T_tail + T_prefill            several waves: long samples admitted last run past the rest
    sync        T = T_gen + T_train + T_pub + T_load          (colocated: on all accelerators, + engine reload)
    one-step-off T = max(T_gen, T_train + T_pub) + T_load
    bounded-async (drain)  T = max(T_thr + T_tail / (k+1), T_train + T_pub) + T_load
    partial-rollout / bounded-async (interrupt)  T = max(T_thr, T_train + T_pub) + T_load
    streaming   T = max(T_thr, T_train + T_pub, Lmax * t_pack / (k+1)) + T_load / R
    streaming, colocated  T = max(T_thr + T_prefill, Lmax * t_pack / (k+1)) + T_train + T_pub + 2 T_swap + T_load / R
                (rollout and training take turns; the tails continue in the next turns, so only the rollout turns
                bound them; T_swap = ``host_swap_s`` of one replica's weights and full KV cache, suspend and resume)
    ceiling     T = max(T_thr + T_prefill, T_train + T_pub)   (``overlap_ceiling``: every slot always busy, training fully
                overlapped, no tail, no exposed load: what no schedule on the placement beats, under this model)
                T = T_thr + T_prefill + T_train + T_pub        on a colocated placement, where rollout and training take
                turns on the same devices (every slot busy while it rolls out, no tail, no exposed load)
                with T_thr at min(S, (k+1) N / R) sequences per replica: no schedule within the budget k holds more
                than (k+1) N trajectories in flight (``ceiling_batch``); and, unless the spec allows version mixing,
                T >= (Lmax * t(1) + T_train + T_pub) / (k+1) (colocated: T_train + T_pub + Lmax * t(1) / (k+1);
                with early steps, (Lmax * t(1) + T_pub) / (k+1)): the longest response, decoded alone, is trained
                within k+1 steps of its version (``tail_bound``)
The last streaming term is the staleness bound: a tail trajectory of the oldest live version must finish within
k+1 steps or the trainer waits for it. It decodes where streaming packs an older version's tails, at t_pack = the
decode step of ``consolidation_batch`` sequences at the tail context (``Space.ctx_tail``), and never faster than alone
(``tail_bound``). Charging it a full batch's step, t(S), made the screen put every streaming plan on engines with
attention data parallelism (whose full batch steps slowest against their pack) 40% under its simulation: on the
560B and 10,240-GPU examples no such plan was a finalist and the search chose plans 9% and 5% slower than the best
it could find when held to streaming. Streaming loads weights peer to peer onto a few replicas at a time, so
only a 1/R share of a load is exposed. The screen only ranks candidates; the simulator measures the best few.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.policies.config import Mode, early_steps_for
from planner.rollout_cost import CPU_DECODE_INGEST_MAX_TOKENS, RolloutCostModel, make_rollout_cost_model
from planner.search.inputs import SearchInputs
from planner.search.space import RolloutOption, Space, TrainOption
from planner.weight_sync import WeightSyncTime, host_swap_s, trainer_swap_s, weight_sync_time_s


@dataclass(frozen=True, kw_only=True)
class Placement:
    colocated: bool
    rollout: RolloutOption
    rollout_accelerators: int
    train: TrainOption

    @property
    def replicas(self) -> int:
        return self.rollout_accelerators // self.rollout.devices

    @property
    def label(self) -> str:
        kind = "coloc" if self.colocated else "disagg"
        r = f"R{self.rollout_accelerators}({self.rollout.label}x{self.replicas})"
        t = f"T{self.train.accelerators}({self.train.label})"
        return f"{kind} {r} {t}"


def train_state_bytes(p: Placement) -> float:
    """The trainer's parameters, gradients and optimizer state per device on placement ``p`` (what a colocated
    trainer moves to host memory and back every step)."""
    m = p.train.memory
    return m.params_bytes + m.grads_bytes + m.optimizer_bytes


HOST_MEMORY_RESERVED_SHARE = 0.4
"""Share of a node's host memory a colocated plan leaves to others: Ray's object store takes 30% of the node's memory
by default (docs.ray.io, "Memory Management": object_store_memory), and 10% is kept for the operating system, the Ray
workers' own processes and the data pipeline (a prior). The rest may hold what the accelerators park there."""


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    """One accelerator's share of its node's host memory on a colocated placement, and what is parked in it."""

    need_bytes: float
    """The larger of the two things parked, plus the reserve: the trainer's state while the engines roll out, or the
    engines' state while the trainer trains (never both at once)."""
    have_bytes: float
    """The node's host memory over its accelerators."""
    detail: dict[str, float]
    """The parts of ``need_bytes``: the larger side's, and ``reserved``."""

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.have_bytes


def host_memory(p: Placement, mode: Mode, inp: SearchInputs) -> HostMemory | None:
    """Host memory per accelerator of colocated placement ``p`` in ``mode``; None where nothing is parked (a
    disaggregated placement) or device memory is host memory (``cpu``).

    While the engines roll out the trainer's parameters, gradients and optimizer state wait in host memory
    (``train_state_bytes``); while the trainer trains the engines' weights do (vLLM's sleep mode, level 1, offloads them
    there), every version an engine hosts, and in streaming also the KV cache of the requests kept across the turn (its
    whole pool: the engine may be full when it stops)."""
    node = inp.accelerator.host_memory_bytes_per_node
    if not p.colocated or node is None:
        return None
    have = node / inp.accelerators_per_node
    m = p.rollout.memory
    engine = {"weights": m.weights_bytes_per_device, "extra_versions": m.extra_version_bytes_per_device}
    if mode == "streaming":
        engine["kv_cache"] = m.kv_bytes_per_device
    trainer = {"trainer_state": train_state_bytes(p)}
    parked = max((engine, trainer), key=lambda d: sum(d.values()))
    reserved = HOST_MEMORY_RESERVED_SHARE * have
    return HostMemory(need_bytes=sum(parked.values()) + reserved, have_bytes=have,
                      detail={**parked, "reserved": reserved})


def fits_host_memory(p: Placement, mode: Mode, inp: SearchInputs) -> bool:
    host = host_memory(p, mode, inp)
    return host is None or host.fits


@dataclass(frozen=True, kw_only=True)
class Screened:
    placement: Placement
    mode: Mode
    k: int
    step_time_s: float
    trained_tokens_per_s: float
    gen_s: float
    train_s: float
    sync_s: float
    rollout_full_s: float
    """T_thr + T_prefill: one batch's generation with every slot busy, the least time rollout needs per step."""

    @property
    def label(self) -> str:
        return f"{self.placement.label} {self.mode} k={self.k}"


class Screen:
    """Caches per-layout cost models so screening thousands of candidates stays cheap."""

    def __init__(self, space: Space):
        self.space = space
        self._rollout: dict[tuple[int, int, int], RolloutCostModel] = {}
        self._sync: dict[tuple, WeightSyncTime] = {}

    def rollout_model(self, opt: RolloutOption) -> RolloutCostModel:
        key = (opt.tp, opt.ep, opt.dp)
        if key not in self._rollout:
            inp = self.space.inp
            self._rollout[key] = make_rollout_cost_model(
                inp.arch, inp.accelerator, tp=opt.tp, ep=opt.ep, dp=opt.dp, dtype_bytes=inp.dtype_bytes,
                weight_dtype_bytes=inp.rollout_weight_bytes,
                calib=inp.calibration, accelerators_per_node=inp.accelerators_per_node)
        return self._rollout[key]

    def weight_sync(self, p: Placement) -> WeightSyncTime:
        t = p.train
        key = (p.colocated, p.rollout.tp, p.rollout.ep, p.rollout.dp, p.rollout_accelerators, t.accelerators, t.tp,
               t.pp, t.ep)
        if key not in self._sync:
            inp = self.space.inp
            self._sync[key] = weight_sync_time_s(
                inp.arch, src_acc=inp.accelerator, dst_acc=inp.accelerator, src_devices=t.accelerators,
                dst_devices=p.rollout_accelerators, dst_tp=p.rollout.tp, dst_dp=p.rollout.dp, colocated=p.colocated,
                src_tp=t.tp,
                src_pp=t.pp, src_ep=t.ep, dst_ep=p.rollout.ep, src_dtype_bytes=inp.dtype_bytes,
                dst_dtype_bytes=inp.rollout_weight_bytes, calib=inp.calibration)
        return self._sync[key]

    def expected_max_response(self) -> float:
        """The batch's longest response (``Space.expected_longest_response``)."""
        return self.space.expected_longest_response(self.space.inp.batch_samples)

    def _full_occupancy(self, p: Placement, batch: int | None = None) -> tuple[float, float, float]:
        """(t(S), T_thr, T_prefill) of placement ``p``: a decode step at full slots, and the batch's generation and
        prefill at full occupancy (module docstring); at ``batch`` sequences per replica instead of S if given."""
        sp, n = self.space, self.space.inp.batch_samples
        model = self.rollout_model(p.rollout)
        slots = p.rollout.slots if batch is None else batch
        t_full = model.decode_step_s(slots, slots * sp.ctx_avg)
        prompt = round(sp.prompt_mean)
        if self.space.inp.accelerator.name == "cpu" and prompt <= CPU_DECODE_INGEST_MAX_TOKENS:
            # dora's CPU engine feeds a short prompt through the decode batch, one token per step (the simulator's
            # ingest steps): no prefill, prompt - 1 more decode positions per sample
            return t_full, n * (sp.response_mean + prompt - 1) * t_full / (p.replicas * slots), 0.0
        t_thr = n * sp.response_mean * t_full / (p.replicas * slots)
        # one prefill of the shared prompt per prompt group, as the simulator charges it (not one prefill of all the
        # slots' prompts as a single sequence: its attention term is quadratic in the whole batch's prompt tokens)
        groups = n / self.space.inp.samples_per_prompt
        return t_full, t_thr, model.prefill_s(prompt) * groups / p.replicas

    def overlap_ceiling(self, p: Placement) -> float:
        """Trained tokens/s of a perfect schedule on placement ``p`` (module docstring): on a disaggregated one,
        rollout at full occupancy fully overlapped with training; on a colocated one, the two in turn."""
        _, t_thr, prefill = self._full_occupancy(p, self.ceiling_batch(p))
        rollout, train = t_thr + prefill, self._trainer_s(p)
        return self.space.step_tokens / max(rollout + train if p.colocated else max(rollout, train), self.tail_bound(p))

    def train_s(self, p: Placement) -> float:
        """T_train on placement ``p``: a training step, and on a colocated one the trainer's state to host memory and
        back (``weight_sync.trainer_swap_s``)."""
        if not p.colocated:
            return p.train.step_s
        inp = self.space.inp
        return p.train.step_s + trainer_swap_s(inp.accelerator, state_bytes_per_device=train_state_bytes(p),
                                               calib=inp.calibration)

    def _trainer_s(self, p: Placement) -> float:
        """W = T_train + T_pub: the trainer's work per step on placement ``p``."""
        sync = self.weight_sync(p)
        return self.train_s(p) + sync.gather_s + sync.convert_s

    def tail_bound(self, p: Placement) -> float:
        """The least step time the staleness budget k allows with the batch's longest response, which decodes alone
        at best, t_L = Lmax * t(1), on the weights of one version v, and must be trained by step v + k + 1.

        It starts once step v has trained and v is published, and step v + k + 1 starts (k + 1) T after step v did,
        so t_L <= (k + 1) T - W, with W = T_train + T_pub: T >= (t_L + W) / (k + 1). Where the trainer can start
        a step early (``early_steps_for``) that step may start before the tail finishes and take it last, so only
        the publish precedes its window: W = T_pub (what training it alone adds after it finishes is left out: a
        bound). Colocated, it decodes only while the devices roll out, and the window holds k more steps'
        training: t_L <= (k + 1)(T - W), so T >= W + t_L / (k + 1). 0 when the spec allows version mixing (a tail
        may finish on newer weights)."""
        inp = self.space.inp
        if inp.allow_version_mixing:
            return 0.0
        l_max = self.expected_max_response()
        alone = l_max * self.rollout_model(p.rollout).decode_step_s(1, self.space.prompt_mean + l_max / 2)
        if inp.early_steps and early_steps_for("streaming", p.colocated, inp.optimizer_steps):
            sync = self.weight_sync(p)
            train = sync.gather_s + sync.convert_s
        else:
            train = self._trainer_s(p)
        k1 = inp.max_version_lag + 1
        return train + alone / k1 if p.colocated else (alone + train) / k1

    def ceiling_batch(self, p: Placement) -> int:
        """Sequences per replica in the ceiling's full occupancy: every slot, S, unless the staleness budget k holds
        fewer in flight. A trajectory in flight when V versions are published has version >= V - k (else it would
        have had to be trained already), so one of steps V + 1 .. V + k + 1 consumes it: at most (k + 1) * N are in
        flight at once, N = samples per step, whatever the schedule."""
        in_flight = (self.space.inp.max_version_lag + 1) * self.space.inp.batch_samples
        return max(1, min(p.rollout.slots, in_flight // p.replicas))

    def swap_s(self, p: Placement, versions: int = 1) -> float:
        """T_swap: one way of a suspended replica's weights (``versions`` hosted) and full KV cache to host memory
        (colocated streaming)."""
        sp, mem = self.space, p.rollout.memory
        kv = min(mem.kv_bytes_per_device, p.rollout.slots * sp.ctx_avg * mem.kv_bytes_per_token_per_device)
        return host_swap_s(sp.inp.accelerator, bytes_per_device=versions * mem.weights_bytes_per_device + kv,
                           calib=sp.inp.calibration)

    def evaluate(self, p: Placement, mode: Mode, k: int) -> Screened:
        sp, inp = self.space, self.space.inp
        model = self.rollout_model(p.rollout)
        slots = p.rollout.slots
        _, t_thr, prefill = self._full_occupancy(p)
        t_drain = model.decode_step_s(max(1, slots // 8), max(1, slots // 8) * sp.ctx_avg)
        n = inp.batch_samples
        l_max = self.expected_max_response()
        t_tail = l_max * t_drain
        waves = n / (p.replicas * slots)
        # one wave: the tail overlaps the batch; several waves: long samples admitted in the last wave run past it
        t_gen = (max(t_thr, t_tail) if waves <= 1 else t_thr + t_tail) + prefill
        sync = self.weight_sync(p)
        t_pub = sync.gather_s + sync.convert_s
        t_load = sync.total_s - t_pub
        t_train = self.train_s(p)
        if mode == "sync":
            step = t_gen + t_train + t_pub + t_load
        elif mode == "one-step-off":
            step = max(t_gen, t_train + t_pub) + t_load
        elif mode == "bounded-async":
            if inp.allow_version_mixing:
                step = max(t_thr + prefill, t_train + t_pub) + t_load
            else:
                step = max(t_thr + prefill + t_tail / (k + 1), t_train + t_pub) + t_load
        elif mode == "partial-rollout":
            step = max(t_thr + prefill, t_train + t_pub) + t_load
        else:  # streaming: the oldest version's tail, packed
            pack = p.rollout.consolidation_batch
            tail = l_max * model.decode_step_s(pack, pack * sp.ctx_tail) / (k + 1)
            if p.colocated:  # taking turns with the trainer
                swap = 2 * self.swap_s(p, min(p.rollout.versions, k + 1))
                step = max(t_thr + prefill, tail) + t_train + t_pub + swap + t_load / p.replicas
            else:
                step = max(t_thr + prefill, t_train + t_pub, tail) + t_load / p.replicas
            step = max(step, self.tail_bound(p))
        return Screened(placement=p, mode=mode, k=k, step_time_s=step, trained_tokens_per_s=sp.step_tokens / step,
                        gen_s=t_gen, train_s=t_train, sync_s=t_pub + t_load, rollout_full_s=t_thr + prefill)
