"""Efficiency factors of the cost model, gathered in one frozen, serialisable object.

Every analytical estimate in `planner` is an idealised count (bytes moved, FLOPs executed, bytes sent over a
link) divided by a peak rate from the hardware catalog.  Real kernels, collectives and engines reach only part of
those peaks, and pay fixed per-step costs.  Those fractions and fixed costs live here, and nowhere else, so that a
measured run can replace all of them at once (`dora calibrate` writes a `Calibration` whose `source` says what was
measured) and the plan file can record which values produced it (`fingerprint()`).

Notation used in the docstrings of the cost modules:
    eta_mem      achieved / peak HBM bandwidth for memory-bound kernels (decode GEMV, KV reads)
    eta_dec      achieved / peak FLOP/s for decode-phase matmuls
    eta_pre      achieved / peak FLOP/s for prefill-phase matmuls
    eta_train    achieved / peak FLOP/s for the compute part of a training step (dense or MoE prior)
    eta_up       achieved / peak scale-up (NVLink-class) link bandwidth in collectives
    eta_out      achieved / peak scale-out (NIC) bandwidth in collectives

The defaults are priors, not measurements of this project; each says where it comes from.  When an accelerator is
the local `cpu` entry, `resolved_for("cpu")` swaps in the CPU-specific constants (see the `cpu_*` fields).  Those
are fitted on dora's torch engine; vLLM's CPU engine runs the same model at other speeds, and `catalog_calibration`
gives it its own entry (`VLLM_CPU_ENGINE`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

_GIB = 1024**3

ROLLOUT_ENGINES = ("torch", "vllm")
"""The rollout engines a `cpu` calibration can describe (``runtime.rollout_engine``)."""


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """All efficiency factors and fixed overheads of the cost model (see module docstring for notation)."""

    source: str = "catalog defaults"
    """Where the values come from: "catalog defaults", or "measured: <what, where, when>"."""

    hbm_bandwidth_efficiency: float = 0.80
    """eta_mem.  Prior: memory-bound copy/GEMV kernels on H100-class parts sustain roughly 70-90% of the data-sheet
    HBM bandwidth (NVIDIA's nvbandwidth and STREAM-style device copies); 0.8 is the round middle."""

    decode_compute_efficiency: float = 0.50
    """eta_dec.  Prior: decode matmuls are skinny (batch rows x weight), far from the large-GEMM peak."""

    prefill_compute_efficiency: float = 0.60
    """eta_pre.  Prior: prefill runs large GEMMs plus flash attention; cuBLAS BF16 GEMMs reach ~60-75% of the
    H100 dense peak at LLM shapes, and attention/normalisation kernels pull the mean down."""

    train_mfu_dense: float = 0.50
    """eta_train for dense models: efficiency of the *compute part* of a step, before pipeline bubble and exposed
    communication, which the train model adds explicitly.  Megatron-LM's README reports up to 47% end-to-end MFU on
    H100 (github.com/NVIDIA/Megatron-LM); Llama 3 reports 38-43% BF16 MFU on 8K-16K H100 (arXiv 2407.21783).
    The compute-only prior sits a little above those end-to-end figures."""

    train_mfu_moe: float = 0.30
    """eta_train for MoE models (compute part only).  Megatron-MoE-ModelZoo (NVIDIA, best_practice/Qwen3) reports
    Qwen3-235B-A22B BF16 at 167-276 TFLOP/s per H100, i.e. 17-28% end-to-end MFU; grouped expert GEMMs are smaller
    and less efficient than dense GEMMs."""

    scale_up_efficiency: float = 0.80
    """eta_up.  Prior: NCCL all-reduce bus bandwidth inside an NVLink/NVSwitch node is typically ~75-85% of the
    per-direction link rate (nccl-tests on DGX-class nodes)."""

    scale_out_efficiency: float = 0.80
    """eta_out.  Prior: NCCL over 400 Gb/s InfiniBand/RoCE typically reaches ~80-90% of line rate at large
    message sizes (nccl-tests); 0.8 leaves room for imperfect rail alignment."""

    host_link_efficiency: float = 0.60
    """eta_host.  Achieved / peak device <-> host (PCIe) bandwidth when every accelerator of a node moves data to or
    from host memory at once (colocated streaming suspending its engines).  Prior: pinned-memory copies on one PCIe
    Gen5 x16 link reach roughly 80-85% of its 64 GB/s per direction; all eight GPUs of a node at once share the
    host's PCIe switches and memory, so the prior is lower.  Not measured here."""

    collective_latency_s: float = 20e-6
    """Fixed latency per collective call (s).  Prior: NCCL small-message latency is on the order of 10-30 us
    inside a node."""

    decode_step_overhead_s: float = 0.002
    """Fixed cost per engine step (s): scheduling, sampling, input preparation, CUDA-graph launch.  Prior for
    vLLM V1 with CUDA graphs on a GPU host."""

    train_step_overhead_s: float = 0.05
    """Fixed cost per training step (s): data loading, loss bookkeeping, synchronisation.  Prior."""

    moe_imbalance_factor: float = 1.2
    """Load on the busiest expert-parallel rank divided by the mean load (>= 1), from the routing's popularity skew.
    Prior: DeepSeek's EPLB exists because routed load is uneven (github.com/deepseek-ai/EPLB); 1.2 is a moderate
    imbalance after balancing.  Rollout engines multiply it by the chance maximum of their devices' loads, which grows
    as each device sees fewer tokens (``RolloutCostModel.ep_imbalance``)."""

    dp_comm_overlap_fraction: float = 0.8
    """Fraction of data-parallel gradient reduce-scatter / parameter all-gather hidden behind backward/forward
    compute (Megatron --overlap-grad-reduce / --overlap-param-gather).  Prior."""

    tp_comm_overlap_fraction: float = 0.0
    """Fraction of tensor-parallel collectives hidden behind compute.  0 = Megatron default (no
    --tp-comm-overlap)."""

    ep_comm_overlap_fraction: float = 0.3
    """Fraction of expert-parallel all-to-all hidden behind compute (Megatron MoE a2a overlap is partial).
    Prior."""

    rollout_reserved_bytes_per_device: float = 0.51 * _GIB
    """The fixed part of a rollout device's non-KV, non-weight memory (bytes), which vLLM's start-up profiling
    takes before it sizes the KV cache (``rollout_cost.vllm_reserved_bytes`` adds the parts that depend on the
    engine): the activation peak's base, 0.24 GiB, plus the CUDA/NCCL memory outside torch of a one-device engine,
    0.27 GiB.  Measured: vLLM 0.19.0 start-up logs on H100 80GB, 50 runs over 29 models (llm-d-incubation/
    llm-d-planner, accuracy/results/v0.19.0/accuracy_report.md): non-torch memory 0.27 GiB mean at TP 1; the
    activation peak is 0.24 GiB + ``rollout_sampler_bytes_per_logit`` x max_num_seqs x vocabulary, a least-squares
    fit to Granite-3.1, CodeLlama-7B, Phi-4 and Gemma-2 (the README lists the held-out checks).  CUDA graphs are
    captured after the KV cache is sized, inside the 1 - gpu_memory_utilization margin, so they are not counted."""

    rollout_tp_comm_bytes_per_device: float = 1.85 * _GIB
    """Extra memory outside torch on each device of a multi-device rollout engine (bytes): NCCL channels and vLLM's
    custom all-reduce buffers.  Measured (same report): non-torch memory 2.08 GiB at TP 2 and 2.17 GiB at TP 4 for
    Llama-3.1-8B and Qwen2.5-7B, against 0.27 GiB at TP 1."""

    rollout_sampler_bytes_per_logit: float = 13.9
    """vLLM's profiling run ends with a dummy sampler pass over max_num_seqs rows of fp32 logits (logits,
    probabilities, log-probabilities: about 3.5 copies of 4 bytes), which sets the activation peak of every dense
    model measured: bytes per row per vocabulary entry.  Fitted as described under
    ``rollout_reserved_bytes_per_device``; predicts the held-out Llama-3.1-8B (1.94 vs 1.89 GiB), Qwen2.5-7B and
    Qwen3-8B (2.26 and 2.25 vs 2.21 GiB) and Mistral-Small-3.1 (1.98 vs 2.03-2.18 GiB)."""

    train_reserved_bytes_per_device: float = 4.0 * _GIB
    """Memory per training device that the model cannot use (bytes): CUDA context, NCCL buffers, allocator
    fragmentation.  Prior."""

    weight_sync_bucket_overhead_s: float = 0.002
    """Fixed cost per weight-sync bucket (s): collective launch, synchronisation, (de)serialisation of the
    bucket's metadata.  Prior."""

    weight_publish_per_tensor_s: float = 1e-4
    """Per-tensor cost on the trainer when it publishes a version whose layout differs from its own (s): each named
    tensor is gathered from its shards (one collective launch) and copied into a send bucket (one copy launch), in a
    Python loop.  Prior, the same order as ``weight_reload_per_tensor_s``; verl's NCCL checkpoint engine
    (verl/checkpoint_engine/nccl_checkpoint_engine.py) works this way, and its README's ~7 s for Qwen3-30B-A3B
    (18,867 tensors, 8.25 GB/s effective, against 50 GB/s NICs) is the mechanism at about 3x this value."""

    weight_reload_per_tensor_s: float = 1e-4
    """Per-tensor cost of loading received weights into the rollout engine (s): vLLM's load_weights runs a
    Python loop over named tensors.  Prior."""

    weight_reload_fixed_s: float = 0.5
    """Fixed cost per weight update on the rollout side (s): pausing the engine, resetting the prefix cache,
    resuming.  Prior."""

    # The cpu_* defaults but cpu_prefill_compute_efficiency are fitted in situ, on 2026-12-07 (51st session), on the
    # development machine class (AMD EPYC VM, 2 cores; one torch thread per engine, one per trainer core) and the
    # SwiGLU tiny-local model: `python bench/predict_vs_measure.py --calib-steps 60 --steps 20` twice (each time two
    # sync runs of 60 steps, one with one engine and one colocated with one engine per core, and a streaming run, all
    # seed 1), then `dora calibrate specs/local-tiny.yaml --from-run` over the six runs (31,285 engine steps, 317
    # training steps; median residuals: decode 10%, train 10%, weights 21%, round trip 13%, the contention,
    # engine and extra-version terms 22-34%). The two rounds alone fitted within 6% of each other but the
    # contentions (1.15-1.26). Rerun it on yours: this machine's speed has varied 2-4x between sessions, and `dora
    # apply` prints the commands when a run misses its plan by more than 25%. The fit they replace (2026-11-24, 39th
    # session, a machine about 2.2x faster: the main job trained 27.6K tokens/s where it trained 10.5-13.8K on
    # 2026-12-07) had decode compute efficiency 0.2736 and step overhead 0.42 ms, training compute efficiency 0.5495
    # and step overhead 10.1 ms, contentions 1.45 (rollout), 1.33 (train), 1.43 (engines); the 2026-11-21 fit, on a
    # GELU model, a 2.38 ms decode step overhead.
    cpu_compute_efficiency: float = 0.09803
    """On the local `cpu` entry, replaces the decode compute efficiency: tiny PyTorch matmuls on one core reach only
    a small fraction of the FMA peak. Fitted in situ (above)."""

    cpu_memory_efficiency: float = 1.0
    """On `cpu`, replaces eta_mem: the decode step's bytes (weights, KV) over this fraction of the core's nominal
    memory rate, the catalog's rough 20 GB/s. The fit trades it against the compute efficiency and the step
    overhead, so read the three together. Fitted in situ (above), at its bound: the tiny model's decode steps move
    too few bytes to pin it, so the memory term is a small part of a step whatever it is."""

    cpu_step_overhead_s: float = 0.001009
    """On `cpu`, replaces decode_step_overhead_s: Python and operator-dispatch cost of one engine step for the tiny
    model. Fitted in situ (above)."""

    cpu_train_step_overhead_s: float = 0.01501
    """On `cpu`, replaces train_step_overhead_s: what a training step costs beyond the trainer's own work, which more
    threads do not speed up. In a run: the Ray call, the batch's serialisation and the checkpoint the step saves.
    Fitted in situ (above) as the mean of a step's span on the controller's clock less the trainer's own time
    (``train_time_s``), 15.1 and 14.9 ms in the two rounds."""

    # Optional CPU constants: None means "fall back" (named in each docstring).  They are left out of `to_dict`
    # while None, so calibration files and plan fingerprints written before they existed stay valid.
    cpu_prefill_compute_efficiency: float | None = 0.43
    """On `cpu`, replaces eta_pre (None: `cpu_compute_efficiency`).  A prefill is a few large batched matmuls,
    while a decode step is dozens of tiny ones, so the two reach very different fractions of the FMA peak on one
    core; `dora calibrate` fits them separately.  Default measured by the micro-benchmarks of `dora calibrate
    specs/local-tiny.yaml` on the development machine class (AMD EPYC VM, 2 cores, 1 torch thread per engine) on
    2026-11-21 (the local runs ingest prompts through the decode batch, so `--from-run` does not refit it)."""

    cpu_train_compute_efficiency: float | None = 0.3163
    """On `cpu`, replaces eta_train (None: `cpu_compute_efficiency`): forward + backward + AdamW of the packed GRPO
    step. A step on n torch threads (the colocated trainer has every core) is charged as data parallel over
    ``n * cpu_train_parallel_efficiency`` cores. Fitted in situ (above)."""

    cpu_train_parallel_efficiency: float | None = 0.7888
    """On `cpu`: what each core adds to a training step that runs on n > 1 torch threads (the colocated trainer has
    every core), as a fraction of one core: the step's compute is charged over ``n * this`` cores, not n (None: 1,
    ideal data parallelism). Fitted in situ (above) on the trainer's own times of the colocated sync runs' two-thread
    steps against the one-thread steps of the others: 0.78 and 0.79 in the two rounds. The trainer alone does better
    (`python bench/train_step.py --threads 1` against `--threads 2`, 2026-11-24: 1.42x and 1.60x, 0.75 per core):
    in a run the engines' and the controller's processes share the cores. A calibration file that gives
    `cpu_train_compute_efficiency` without this key loads it as None (see `from_dict`)."""

    cpu_extra_version_step_s: float | None = 0.0003952
    """On `cpu`: what each extra policy version with running requests adds to one decode step of a multi-version
    engine (the torch engine stacks the versions' weights and runs one batched matmul per linear over rows padded
    per version, so a version costs a few pad/unpad ops, not a forward).  None: a full `decode_step_overhead_s` per
    extra version (a separate forward, as an engine without stacking would run).  (Engine alone, `python
    bench/engine_speed.py`: B=64, V=2 1.66 ms and V=3 1.81 ms vs V=1 1.46 ms.) Fitted in situ (above)."""

    cpu_weight_reload_fixed_s: float | None = 0.005083
    """On `cpu`, replaces weight_reload_fixed_s (None: keep it): from the start of a load to the engine serving the
    version, beyond the formula's per-tensor term (fetching the state dict from Ray's object store and building the
    engine's model; the engine pauses only to install it). The GPU prior (0.5 s engine pause/resume) is far too slow
    for the tiny CPU model. Fitted in situ (above)."""

    cpu_weight_publish_fixed_s: float | None = 0.006169
    """On `cpu`: trainer-side time to publish a version beyond the formula's gather/convert terms (the local runtime
    checkpoints the step, exports the state dict and puts it in Ray's object store before the version is published;
    the trainer is busy, the engines keep decoding).  None: 0.  `dora calibrate --from-run` measures it as the mean
    train-step end -> weights-published interval. Fitted in situ (above)."""

    cpu_rollout_contention: float | None = 1.258
    """On `cpu` with rollout and training on disjoint cores of one host: a decode step takes this many times longer
    while the trainer runs (they share the host's caches and memory bus, and with the controller, its cores).  None:
    1 (no contention).  `dora calibrate --from-run` measures it as sum measured / sum predicted-alone over the
    engine steps that overlap a training step. Fitted in situ (above)."""

    cpu_train_contention: float | None = 1.203
    """On `cpu` with rollout and training on disjoint cores of one host: a training step runs this many times slower
    while some engine decodes (the simulator re-evaluates its end as engines start and stop decoding).  None: 1.
    `dora calibrate --from-run` fits it over the training steps that engine steps cover for at least half their
    span, so that the predicted spans sum to the measured ones (``dora.calibrate_run.fit_train_contention``).
    Fitted in situ (above)."""

    cpu_engine_contention: float | None = 1.162
    """On `cpu`: a decode step takes this many times longer while another engine replica of the host decodes at the
    same time (the engines share the host's caches and memory bus, and with the controller, its cores).  None: 1.
    `dora calibrate --from-run` measures it as sum measured / sum predicted-alone over the engine steps of a run
    with several engines (a sync run on 2 cores) that overlap another engine's steps; the decode constants are
    fitted on the steps that do not. Fitted in situ (above)."""

    cpu_controller_round_trip_s: float | None = 0.006591
    """On `cpu`: from a rollout worker's poll returning its finished trajectories to the admissions they made being in
    its engine (the Ray reply, the controller's processing, the next poll carrying the requests). The simulator idles
    the slots freed meanwhile, and batches the reports as the polls do (``planner.policies.poll_batching``). None: 0,
    the policy hears of a finish at once. `dora calibrate --from-run` measures it as the mean of the runs' ``poll``
    rows (``engine_steps.jsonl``). Fitted in situ (above): the mean of the 2,522 polls of the six runs, sync's
    included. The 38th session measured the mean of 2,467 polls of three local-tiny streaming runs of 150 steps
    (`dora apply`, and `python bench/local_modes.py --seeds 0 1`): 3.96-4.34 ms per run, median 3.3-3.7 ms, p90
    6.5-7.1 ms; the sync, one-step-off and bounded-async runs of the same bench measured 3.3-3.5 ms (their
    controller does less per message). On GPUs it is left out (``admission_queue_for``)."""

    cpu_rollout_engine: str | None = None
    """On `cpu`: the rollout engine whose runs the `cpu_*` constants describe, "torch" (dora's) or "vllm" (its CPU
    backend); `dora calibrate` records it, and a plan of a spec with the other engine warns. None: the torch
    engine's (the catalog default); a file without this key takes it from the spec's catalog entry, as any constant it
    leaves out."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            name = field.name
            if name == "source":
                if not isinstance(self.source, str) or not self.source:
                    raise ValueError("Calibration.source must be a non-empty string")
                continue
            if name == "cpu_rollout_engine":
                if self.cpu_rollout_engine not in (None, *ROLLOUT_ENGINES):
                    raise ValueError(f"Calibration.cpu_rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, got "
                                     f"{self.cpu_rollout_engine!r}")
                continue
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"Calibration.{name} must be a number, got {value!r}")
            # the upper bounds (and the efficiencies' lower one) keep the cost model's arithmetic finite: far past
            # anything measured, they only catch typos
            if name.endswith("efficiency") or name.startswith("train_mfu"):
                if not 0.0 < value <= 1.0:
                    raise ValueError(f"Calibration.{name} = {value} must lie in (0, 1]")
                if value < 1e-6:
                    raise ValueError(f"Calibration.{name} = {value} must be at least 1e-06")
            elif name.endswith("overlap_fraction"):
                if not 0.0 <= value <= 1.0:
                    raise ValueError(f"Calibration.{name} = {value} must lie in [0, 1]")
            elif name == "moe_imbalance_factor" or name.endswith("_contention"):
                if not 1.0 <= value <= 1000.0:
                    raise ValueError(f"Calibration.{name} = {value} must lie in [1, 1000]")
            elif name.endswith("_s"):
                if not 0.0 <= value <= 3600.0:
                    raise ValueError(f"Calibration.{name} = {value} must lie in [0, 3600] seconds")
            elif not 0.0 <= value <= 1e15:
                raise ValueError(f"Calibration.{name} = {value} must lie in [0, 1e15]")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (optional fields only when set)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not (f.name in _OPTIONAL_FIELDS and getattr(self, f.name) is None)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: Calibration | None = None) -> Calibration:
        """Inverse of `to_dict`.  Missing keys take ``base``'s values (a catalog entry; None: the class defaults), but
        one: a train efficiency given without `cpu_train_parallel_efficiency` keeps ideal thread scaling (None), the
        model it was fitted under by every `dora calibrate` before that key existed (its fingerprint and predictions
        stay what they were).  An unknown key raises ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"unknown calibration key {key!r}; valid keys: {', '.join(sorted(known))}")
        if "cpu_train_compute_efficiency" in data and "cpu_train_parallel_efficiency" not in data:
            data = {**data, "cpu_train_parallel_efficiency": None}
        return cls(**data) if base is None else dataclasses.replace(base, **data)

    def with_overrides(self, **overrides: Any) -> Calibration:
        """Copy with some fields replaced; an unknown name raises ValueError naming it."""
        known = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in known:
                raise ValueError(f"unknown calibration key {key!r}")
        return dataclasses.replace(self, **overrides)

    def fingerprint(self) -> str:
        """First 16 hex digits of sha256 over the sorted JSON of `to_dict()`: stable across runs and machines."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def extra_version_step_s(self, accelerator_name: str) -> float:
        """Overhead one more hosted version (with running requests) adds to a decode step, on top of reading its
        weights (s); see `cpu_extra_version_step_s`."""
        if accelerator_name == "cpu" and self.cpu_extra_version_step_s is not None:
            return self.cpu_extra_version_step_s
        return self.resolved_for(accelerator_name).decode_step_overhead_s

    def publish_fixed_s(self, accelerator_name: str) -> float:
        """Trainer-side publish time beyond the formula (`cpu_weight_publish_fixed_s` on `cpu`, else 0)."""
        if accelerator_name == "cpu" and self.cpu_weight_publish_fixed_s is not None:
            return self.cpu_weight_publish_fixed_s
        return 0.0

    def contention(self, accelerator_name: str, *, colocated: bool) -> tuple[float, float]:
        """(rollout, train) slow-down factors while the other side runs at the same time on the same host: the
        `cpu_*_contention` constants for disaggregated `cpu` plans, else 1 (separate devices; colocated
        plans never run both at once)."""
        if accelerator_name != "cpu" or colocated:
            return 1.0, 1.0
        return self.cpu_rollout_contention or 1.0, self.cpu_train_contention or 1.0

    def engine_contention(self, accelerator_name: str) -> float:
        """Slow-down of a decode step while another replica on the same host decodes (`cpu_engine_contention` on
        `cpu`, else 1: a GPU replica has its devices to itself)."""
        if accelerator_name != "cpu":
            return 1.0
        return self.cpu_engine_contention or 1.0

    def controller_round_trip_s(self, accelerator_name: str) -> float:
        """The controller's round trip from a poll's reply to the admissions it makes (`cpu_controller_round_trip_s` on
        `cpu`, else 0: left out)."""
        if accelerator_name != "cpu":
            return 0.0
        return self.cpu_controller_round_trip_s or 0.0

    def resolved_for(self, accelerator_name: str) -> Calibration:
        """The calibration the formulas should use on `accelerator_name`.

        On "cpu" the generic GPU-oriented factors are replaced by the `cpu_*` constants, so the cost formulas
        stay identical for every accelerator; elsewhere this returns `self`.
        """
        if accelerator_name != "cpu":
            return self
        prefill = self.cpu_prefill_compute_efficiency or self.cpu_compute_efficiency
        train = self.cpu_train_compute_efficiency or self.cpu_compute_efficiency
        reload_s = self.weight_reload_fixed_s if self.cpu_weight_reload_fixed_s is None else self.cpu_weight_reload_fixed_s
        return dataclasses.replace(
            self,
            hbm_bandwidth_efficiency=self.cpu_memory_efficiency,
            decode_compute_efficiency=self.cpu_compute_efficiency,
            prefill_compute_efficiency=prefill,
            train_mfu_dense=train,
            train_mfu_moe=train,
            decode_step_overhead_s=self.cpu_step_overhead_s,
            train_step_overhead_s=self.cpu_train_step_overhead_s,
            weight_reload_fixed_s=reload_s,
            # The local runtime holds one copy of the tiny model; there is no sizeable reserve to keep.
            rollout_reserved_bytes_per_device=min(self.rollout_reserved_bytes_per_device, 0.25 * _GIB),
            rollout_tp_comm_bytes_per_device=0.0,  # one thread per replica: no collectives
            rollout_sampler_bytes_per_logit=0.0,  # the torch engine samples in place, from its step's logits
            weight_publish_per_tensor_s=0.0,  # cpu_weight_publish_fixed_s, fitted in situ, is the whole publish
            train_reserved_bytes_per_device=min(self.train_reserved_bytes_per_device, 0.25 * _GIB),
        )


_OPTIONAL_FIELDS = frozenset({"cpu_prefill_compute_efficiency", "cpu_train_compute_efficiency", "cpu_train_parallel_efficiency",
                              "cpu_weight_reload_fixed_s", "cpu_extra_version_step_s", "cpu_rollout_contention",
                              "cpu_train_contention", "cpu_weight_publish_fixed_s",
                              "cpu_engine_contention", "cpu_controller_round_trip_s", "cpu_rollout_engine"})

DEFAULT_CALIBRATION = Calibration()

CATALOG_SOURCE = DEFAULT_CALIBRATION.source
"""The ``source`` of every catalog entry begins with this; a measured or hand-written calibration's does not."""

VLLM_CPU_ENGINE: dict[str, float] = {
    "cpu_compute_efficiency": 0.04102,
    "cpu_memory_efficiency": 1.0,
    "cpu_step_overhead_s": 0.002375,
    "cpu_engine_contention": 1.304,
    "cpu_rollout_contention": 1.234,
    "cpu_train_contention": 1.391,
    "cpu_train_compute_efficiency": 0.3457,
    "cpu_train_parallel_efficiency": 0.609,
    "cpu_train_step_overhead_s": 0.01606,
    "cpu_weight_publish_fixed_s": 0.006447,
    "cpu_weight_reload_fixed_s": 0.01971,
    "cpu_controller_round_trip_s": 0.01301,
}
"""The `cpu_*` constants of plans whose rollout engine is vLLM's CPU backend (the vllm-cpu extra,
``runtime.rollout_engine: vllm`` on ``cpu``), fitted in situ on 2026-12-08 (52nd session) on the development machine
class (AMD EPYC VM, 2 cores) by `dora calibrate specs/local-tiny-vllm.yaml --from-run` over five `dora apply` runs of
that spec (a streaming run of 60 steps, sync runs of 20 and 60 steps, a colocated sync run of 60 steps with one engine
per core, and a streaming run of 60 steps with seed 1, the last three from `python bench/predict_vs_measure.py
--spec specs/local-tiny-vllm.yaml --calib-steps 60`): 17,593 engine steps and 250 training steps, less 6 engine steps
of 1.5-10.3 s, over 100x the median, and each run's first 2 training steps (warm-up). Residuals (median): decode 7%, train 11%, weights 20%, round trip 12%, the two
contention fits 22-28%. Against the torch engine's: a decode step costs 2.4 ms fixed and runs at 0.041 of the FMA
peak (torch 1.0 ms and 0.098: vLLM's scheduler and input preparation cost more than the forward of a ~100K-parameter
model), a load 20 ms (5 ms), a round trip 13 ms (6.6 ms). The trainer is dora's torch trainer either way, but runs
beside vLLM's engine process slower than beside torch's (contention 1.39 against 1.20, 0.61 of a core per extra
thread against 0.79): the whole set is this one fit's, so that its constants agree with each other. The two
constants no vLLM run measures stay the torch engine's: `cpu_prefill_compute_efficiency` (prompts go through the
decode batch) and `cpu_extra_version_step_s` (vLLM hosts one version per engine)."""

VLLM_CPU_CALIBRATION = DEFAULT_CALIBRATION.with_overrides(source=f"{CATALOG_SOURCE}, vLLM's CPU engine",
                                                          cpu_rollout_engine="vllm", **VLLM_CPU_ENGINE)


def catalog_calibration(accelerator_name: str, rollout_engine: str) -> Calibration:
    """The catalog's constants for plans of ``rollout_engine`` on ``accelerator_name``: vLLM's CPU engine has its own
    `cpu_*` constants (`VLLM_CPU_ENGINE`); everything else plans with the defaults."""
    if accelerator_name == "cpu" and rollout_engine == "vllm":
        return VLLM_CPU_CALIBRATION
    return DEFAULT_CALIBRATION


def engine_of(calibration: Calibration) -> str:
    """The rollout engine whose `cpu` runs ``calibration``'s `cpu_*` constants describe (`cpu_rollout_engine`)."""
    return calibration.cpu_rollout_engine or "torch"


def is_catalog(calibration: Calibration) -> bool:
    """Whether ``calibration`` is a catalog entry (no file, no measurement changed it)."""
    return calibration.source.startswith(CATALOG_SOURCE)
