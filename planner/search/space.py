"""The search space: engine layouts for rollout, parallel layouts for training, and accelerator splits.

Everything here is enumeration plus the memory checks that prune it; nothing is timed yet.

Rollout replica: ``tp`` accelerators, experts split by TP (``ep = 1``) or one whole expert set per rank
(``ep = tp``, vLLM's expert parallel), or for MoE models ``dp`` attention data-parallel ranks of ``tp`` (at most a
node) with whole experts over all of them (``ep = tp * dp``). Slots per replica (continuous-batching sequences) are
bounded by the KV capacity at the time-averaged context of a sequence:
    ctx_avg = P + E[L^2] / (2 E[L])     (a sequence of length L spends time proportional to L, during which its
                                         context grows from P to P + L: the length-biased mean of P + l/2)
    slots   = min(max_num_seqs_cap, floor(kv_capacity_tokens / ctx_avg))
and the replica must hold at least one sequence of the full context ``P_max + L_max``. Streaming packs an older
version's tails up to the batching knee at a tail's context, within the KV cache (``RolloutOption.consolidation_batch``):
    ctx_tail = P + E[L^2] / E[L]        (the final context of the request a busy slot holds)
    pack     = min(slots, knee(ctx_tail), floor(kv_capacity_tokens / ctx_tail))

Training: ``tp * pp * cp * dp = T`` with tp dividing the KV heads (GQA; attention heads for MLA) and at most one
node, pp splitting the layers as Megatron does (equal middle stages, the rest on the first and last:
``train_cost.pipeline_stage_layers``), cp > 1 only for long contexts, ep dividing the experts and ``tp * dp * cp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from planner.rollout_cost import RolloutMemory, make_rollout_cost_model, rollout_instance_memory
from planner.search.inputs import SearchInputs
from planner.train_cost import TrainCostModel, TrainMemory, pipeline_stage_layers, train_memory_per_device

MAX_EP_NODES = 16
"""Expert parallelism of an attention-data-parallel rollout engine spans at most this many nodes (128 H800s): the
range DeepEP's low-latency kernels were published for (EP 8-256 on H800, docs/legacy.md), where the cost model's
all-to-all (``hardware.all_to_all_s``) reads 202 us for their EP128 dispatch of 128 tokens against 192 measured
(tests/unit/test_rollout_cost.py), and near DeepSeek's decode deployment (EP144 over 18 nodes). A wider engine holds
fewer experts per device and more KV cache; past 16 nodes the search grows slower for gains made where the model's
imbalance (``RolloutCostModel.ep_imbalance``) has not been checked."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two_upto(n: int) -> list[int]:
    out, p = [], 1
    while p <= n:
        out.append(p)
        p *= 2
    return out


@dataclass(frozen=True, kw_only=True)
class RolloutOption:
    tp: int
    ep: int
    slots: int
    """Sequences the whole replica runs at once (over all its attention data-parallel ranks)."""
    memory: RolloutMemory
    consolidation_batch: int
    """streaming: the most requests a replica takes in when an older version is consolidated (``PolicyConfig.
    consolidation_batch``) unless pinned: its batching knee (``RolloutCostModel.batching_knee``) at the context of
    the requests it packs, the tails (``Space.ctx_tail``), and no more of them than its KV cache holds."""
    versions: int = 1
    """Policy versions one replica may host in streaming (``placement.rollout.versions_per_engine``; default 1,
    searched over 1..k+1 on ``cpu``), with ``memory`` sized for them."""
    versions_searched: bool = False
    """True when ``versions`` is one of several the search tries (not a pin)."""
    dp: int = 1
    """Attention data-parallel ranks (vLLM's ``data_parallel_size``; the experts then run over all ``tp * dp``
    devices, ep = tp * dp): each rank attends to its own sequences and keeps only their KV cache."""
    pack_stepped: bool = False
    """True when ``consolidation_batch`` is one the search stepped to from the knee rule's (``search.core``, the
    packing step), not the rule's own: the label then shows it (``c96``)."""

    @property
    def devices(self) -> int:
        """Accelerators of one replica."""
        return self.tp * self.dp

    @property
    def label(self) -> str:
        return (f"tp{self.tp}" + (f"dp{self.dp}" if self.dp > 1 else "") + (f"ep{self.ep}" if self.ep > 1 else "")
                + (f"v{self.versions}" if self.versions > 1 else "")
                + (f"c{self.consolidation_batch}" if self.pack_stepped else ""))


@dataclass(frozen=True, kw_only=True)
class TrainOption:
    accelerators: int
    tp: int
    pp: int
    dp: int
    ep: int
    cp: int
    micro_batch_tokens: int
    recompute: str
    step_s: float
    memory: TrainMemory

    @property
    def label(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Rejection:
    what: str
    reason: str
    need_over_have: float
    """How far from fitting (1.0 = exactly fits); ranks the 'closest' infeasible candidate."""


class Space:
    """Lazily computed, cached pieces of the search space for one ``SearchInputs``."""

    def __init__(self, inputs: SearchInputs):
        self.inp = inputs
        self.rejections: list[Rejection] = []
        self._train_cache: dict[int, TrainOption | None] = {}

    # ------------------------------------------------------------------ workload moments
    @cached_property
    def response_mean(self) -> float:
        return self.inp.response_lengths.mean_tokens()

    @cached_property
    def response_sq_mean(self) -> float:
        """E[L^2] of the capped distribution, exact (a 400-point quadrature over quantiles lost any tail mass under
        1/400: half of E[L^2] for a histogram with 0.1% of 16K-token responses)."""
        return self.inp.response_lengths.second_moment_tokens()

    @cached_property
    def prompt_mean(self) -> float:
        return self.inp.prompt_lengths.mean_tokens()

    @cached_property
    def longest_seq_tokens(self) -> float:
        """Expected longest sequence (prompt + response) among one optimizer step's samples: the response quantile at
        the largest order statistic's mean rank, S / (S + 1)."""
        return self.prompt_mean + self.expected_longest_response(self.inp.samples_per_minibatch)

    def expected_longest_response(self, samples: int) -> float:
        """Expected longest response among ``samples`` samples: the response quantile at the largest of ``m``
        independent draws' mean rank, ``m / (m + 1)``, with ``m = samples``, or the number of prompt groups they
        span when a group's samples share one length (``lengths_per_prompt``)."""
        m = -(-samples // self.inp.samples_per_prompt) if self.inp.lengths_per_prompt else samples
        return float(self.inp.response_lengths.quantile(m / (m + 1)))

    @cached_property
    def ctx_avg(self) -> float:
        return self.prompt_mean + self.response_sq_mean / (2 * self.response_mean)

    @cached_property
    def ctx_tail(self) -> float:
        """Context of the requests an older version still runs when streaming consolidates them: the final context of
        the request a busy slot holds (a slot holds a request for a time proportional to its length, so that request's
        length is E[L^2] / E[L] on average; ``ctx_avg`` is its midpoint)."""
        return self.prompt_mean + self.response_sq_mean / self.response_mean

    @cached_property
    def step_tokens(self) -> float:
        """Prompt + response tokens one training step processes."""
        return self.inp.batch_samples * (self.prompt_mean + self.response_mean)

    @cached_property
    def step_sum_sq(self) -> float:
        p = self.prompt_mean
        return self.inp.batch_samples * (p * p + 2 * p * self.response_mean + self.response_sq_mean)

    # ------------------------------------------------------------------ rollout
    @cached_property
    def rollout_options(self) -> tuple[RolloutOption, ...]:
        inp, arch, pins = self.inp, self.inp.arch, self.inp.pins
        if pins.versions_per_engine:
            version_counts = [pins.versions_per_engine]
        elif inp.accelerator.name == "cpu" and not inp.single_version_engines:
            # dora's CPU engine hosts several versions in one batched step (``extra_version_step_s``); on GPUs
            # DORA gives each replica one version and moves replicas between versions instead.
            version_counts = list(range(1, inp.max_version_lag + 2))
        else:
            version_counts = [1]
        heads = arch.num_attention_heads
        max_tp = min(inp.total_accelerators, 4 * inp.accelerators_per_node)
        tps = [pins.rollout_tp] if pins.rollout_tp else [t for t in powers_of_two_upto(max_tp)
                                                         if heads % t == 0 and arch.tp_shards_kv_heads(t)]
        out: list[RolloutOption] = []
        if inp.accelerator.name == "cpu":
            # dora's CPU engine is one single-threaded process per replica: a second core serves a second replica.
            # (Two torch threads in one engine decode local-tiny's batches 2x slower than one, measured 2026-11-22.)
            if pins.rollout_tp and pins.rollout_tp > 1:
                self.rejections.append(Rejection(what=f"rollout tp{pins.rollout_tp}", reason=(
                    "the CPU engine runs one thread per replica: pin rollout tp 1 (more replicas use more cores)"),
                    need_over_have=float(pins.rollout_tp)))
            tps = [t for t in tps if t == 1]
        layouts = [(tp, ep, 1) for tp in tps for ep in ([1, tp] if arch.is_moe and tp > 1 else [1])]
        if arch.is_moe and inp.accelerator.name != "cpu":
            # attention data parallelism: dp ranks of tp devices (at most a node), the experts over all tp x dp: how
            # DeepSeek-style MoE models are served at scale, and with tp 1 the only layout where an MLA latent is not
            # copied onto every device. A spec pins one as tp and ep = tp x dp (a replica spans ep accelerators).
            wide = min(inp.total_accelerators, MAX_EP_NODES * inp.accelerators_per_node)
            eps = sorted(set(powers_of_two_upto(wide)) | ({pins.rollout_ep} if pins.rollout_ep else set()))
            layouts += [(tp, ep, ep // tp) for tp in tps if tp <= inp.accelerators_per_node
                        for ep in eps if ep > tp and ep % tp == 0]
        for tp, ep, dp in layouts:
            if pins.rollout_ep and ep != pins.rollout_ep:
                continue
            if arch.is_moe and ep > 1 and arch.num_experts % ep:
                continue
            name = f"rollout tp{tp}" + (f"dp{dp}" if dp > 1 else "") + (f"ep{ep}" if ep > 1 else "")
            knee: int | None = None  # the engine's batching knee at a tail's context, computed once per layout
            for versions in version_counts:
                mem = rollout_instance_memory(
                    arch, inp.accelerator, tp=tp, ep=ep, dtype_bytes=inp.dtype_bytes,
                    weight_dtype_bytes=inp.rollout_weight_bytes,
                    gpu_memory_utilization=inp.gpu_memory_utilization, extra_versions=versions - 1,
                    context_tokens=inp.max_context_tokens, max_num_seqs=inp.max_num_seqs_cap,
                    calib=inp.calibration, dp=dp)
                if not mem.fits:
                    ratio = mem.needed_bytes_per_device / max(mem.usable_bytes_per_device, 1.0)
                    self.rejections.append(Rejection(what=name, reason=mem.message, need_over_have=ratio))
                    continue
                # max_num_seqs is each data-parallel rank's (each is an engine core of its own)
                slots = min(dp * inp.max_num_seqs_cap, int(mem.kv_capacity_tokens // self.ctx_avg))
                slots = max(slots, 1)
                if slots < inp.samples_per_prompt:
                    self.rejections.append(Rejection(
                        what=name, need_over_have=inp.samples_per_prompt / slots,
                        reason=(f"does not fit: a prompt group of {inp.samples_per_prompt} samples "
                                f"(workload.samples_per_prompt) needs {inp.samples_per_prompt} slots on one "
                                f"engine, which holds {slots} (its KV cache at the mean context "
                                f"{self.ctx_avg:.0f} tokens, at most {inp.max_num_seqs_cap} sequences"
                                f"{f' on each of its {dp} ranks' if dp > 1 else ''}: "
                                f"placement.rollout.max_num_seqs or the engine's default)")))
                    continue
                pack = pins.consolidation_batch
                if pack is None:
                    if knee is None:
                        knee = make_rollout_cost_model(
                            arch, inp.accelerator, tp=tp, ep=ep, dtype_bytes=inp.dtype_bytes,
                            weight_dtype_bytes=inp.rollout_weight_bytes,
                            calib=inp.calibration, accelerators_per_node=inp.accelerators_per_node, dp=dp,
                        ).batching_knee(self.ctx_tail, dp * inp.max_num_seqs_cap)
                    pack = max(1, min(knee, int(mem.kv_capacity_tokens // self.ctx_tail)))
                out.append(RolloutOption(tp=tp, ep=ep, dp=dp, slots=slots, memory=mem, versions=versions,
                                         versions_searched=len(version_counts) > 1,
                                         consolidation_batch=min(slots, pack)))
        return tuple(out)

    # ------------------------------------------------------------------ training
    def has_train_layout(self, accelerators: int) -> bool:
        """Whether some tp x pp x cp x dp split of ``accelerators`` meets the heads, the layers, the optimizer step's
        samples and the pins (memory aside): a pinned training size without one can never be planned."""
        return bool(self._train_layouts(accelerators))

    def _train_layouts(self, accelerators: int) -> list[tuple[int, int, int, int, int]]:
        inp, arch, pins = self.inp, self.inp.arch, self.inp.pins
        shard_heads = arch.num_attention_heads if arch.mla is not None else arch.num_kv_heads
        long_ctx = inp.max_context_tokens > 16384
        tps = [t for t in powers_of_two_upto(min(inp.accelerators_per_node, accelerators)) if shard_heads % t == 0]
        # uneven splits too (Megatron's first/last stage layer counts); the cost model charges the busiest stage
        pps = [p for p in range(1, min(arch.num_layers, 32) + 1) if pipeline_stage_layers(arch.num_layers, p)]
        cps = [c for c in (1, 2, 4, 8) if c == 1 or long_ctx]
        out: list[tuple[int, int, int, int, int]] = []
        for tp in ([pins.train_tp] if pins.train_tp else tps):
            for pp in ([pins.train_pp] if pins.train_pp else pps):
                for cp in ([pins.train_cp] if pins.train_cp else cps):
                    if accelerators % (tp * pp * cp):
                        continue
                    dp = accelerators // (tp * pp * cp)
                    if (pins.train_dp and dp != pins.train_dp) or inp.samples_per_minibatch % dp:
                        continue
                    if arch.is_moe:
                        eps = [e for e in divisors(arch.num_experts) if (tp * dp * cp) % e == 0 and e <= 64]
                        if pins.train_ep:
                            eps = [pins.train_ep] if pins.train_ep in eps else []
                        # the largest few EP sizes: smaller ones only add expert replicas and memory
                        eps = sorted(eps)[-3:]
                    else:
                        eps = [1]
                    out.extend((tp, pp, cp, dp, ep) for ep in eps)
        return out

    def blocked_sides(self) -> tuple[str, ...]:
        """The sides ("rollout", "train") with no layout that fits, among those tried so far: where an infeasible
        spec's rejections that matter are."""
        out = () if self.rollout_options else ("rollout",)
        tried = self._train_cache.values()
        return out + (("train",) if tried and all(t is None for t in tried) else ())

    def best_train(self, accelerators: int) -> TrainOption | None:
        """Fastest training layout on ``accelerators`` that fits in memory (cached per size)."""
        if accelerators in self._train_cache:
            return self._train_cache[accelerators]
        inp = self.inp
        best: TrainOption | None = None
        closest: tuple[float, str] | None = None
        for tp, pp, cp, dp, ep in self._train_layouts(accelerators):
            # a microbatch packs sequences up to 8192 tokens, and holds at least the longest one whole: context
            # parallelism splits it, mbt / cp tokens per rank (train_memory_per_device)
            mbt = max(8192, inp.max_context_tokens)
            for recompute in ("none", "full"):
                mem = train_memory_per_device(
                    inp.arch, inp.accelerator, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, micro_batch_tokens=mbt,
                    recompute=recompute, dtype_bytes=inp.dtype_bytes, calib=inp.calibration)  # type: ignore[arg-type]
                if not mem.fits:
                    ratio = mem.total_bytes / max(mem.capacity_bytes, 1.0)
                    if closest is None or ratio < closest[0]:
                        closest = (ratio, f"train {accelerators} ({tp=} {pp=} {dp=} {ep=} {cp=}): {mem.message}")
                    continue
                model = TrainCostModel(
                    arch=inp.arch, acc=inp.accelerator, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, micro_batch_tokens=mbt,
                    extra_forward_passes=inp.extra_forward_passes, recompute=recompute,  # type: ignore[arg-type]
                    optimizer_steps=inp.optimizer_steps, longest_seq_tokens=self.longest_seq_tokens,
                    dtype_bytes=inp.dtype_bytes, calib=inp.calibration,
                    accelerators_per_node=inp.accelerators_per_node)
                step_s = model.train_step_s(self.step_tokens, self.step_sum_sq, inp.batch_samples)
                option = TrainOption(accelerators=accelerators, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp,
                                     micro_batch_tokens=mbt, recompute=recompute, step_s=step_s, memory=mem)
                if best is None or (step_s, option.label) < (best.step_s, best.label):
                    best = option
                break  # recompute only when needed to fit
        if best is None and closest is not None:
            self.rejections.append(Rejection(what=f"train on {accelerators}", reason=closest[1],
                                             need_over_have=closest[0]))
        elif best is None:  # no layout at all: never the "closest" to fitting (sorts after every size that ran out)
            self.rejections.append(Rejection(
                what=f"train on {accelerators}", need_over_have=math.inf,
                reason=(f"no layout tp*pp*cp*dp = {accelerators} has a dp dividing the {inp.samples_per_minibatch} "
                        "samples of an optimizer step (and tp dividing the heads, pp splitting the layers)")))
        self._train_cache[accelerators] = best
        return best

    # ------------------------------------------------------------------ splits
    def train_sizes(self, replica: int) -> list[int]:
        """Candidate training sizes for a disaggregated split with rollout replicas of ``replica`` accelerators.

        Whole nodes when the cluster has several, and a trainer or a rollout pool smaller than one node (the two
        sides then share that node: verl's one-step-off runs Qwen2.5-7B with 4 rollout and 12 training GPUs on two
        nodes of 8); every feasible size on a single node. Large clusters get a coarse grid (about 48 points, denser
        at small training shares) that ``refine_sizes`` sharpens.
        """
        inp = self.inp
        n, g = inp.total_accelerators, inp.accelerators_per_node
        pins = inp.pins
        if pins.train_accelerators:
            sizes = [pins.train_accelerators]
        elif pins.rollout_accelerators:
            sizes = [n - pins.rollout_accelerators]
        else:
            unit = g if inp.nodes > 1 else 1
            sizes = list(range(unit, n, unit))
            if len(sizes) > 48:
                grid = {sizes[min(len(sizes) - 1, round((len(sizes) - 1) * (i / 47) ** 1.5))] for i in range(48)}
                # sizes whose data-parallel degree can divide a power-of-two batch (pp may be 3, 5 or 7 x 2^i)
                grid |= {m * unit * 2 ** i for m in (1, 3, 5, 7) for i in range(20) if m * unit * 2 ** i < n}
                sizes = sorted(grid)
            if inp.nodes > 1:
                sizes = sorted({*sizes, *range(1, g), *range(n - g + 1, n)})
        return [t for t in sizes if 0 < t < n and (n - t) % replica == 0 and (n - t) >= replica]

    def refine_sizes(self, around: int, replica: int) -> list[int]:
        inp = self.inp
        if inp.pins.train_accelerators or inp.pins.rollout_accelerators:
            return []
        unit = inp.accelerators_per_node if inp.nodes > 1 else 1
        n = inp.total_accelerators
        out = [around + d * unit for d in range(-6, 7) if d]
        return [t for t in out if 0 < t < n and (n - t) % replica == 0 and (n - t) >= replica]
