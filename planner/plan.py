"""The Plan: the one serialisable, deterministic output of the planner.

A plan is what `dora plan --out` writes as plan.json and what lowering and `dora apply` consume. It is
versioned (``format_version``; a major change is a new integer), carries the hashes of everything it was
computed from (spec, catalogs, calibration), and serialises deterministically: sorted keys, no timestamps, no
absolute paths, floats rounded to a fixed number of significant digits so that the same inputs give a
byte-identical file on any machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

FORMAT_VERSION = 8
"""Bump on any change that an older dora could not read correctly."""

Mode = Literal["sync", "one-step-off", "bounded-async", "partial-rollout", "streaming"]

Objective = Literal["throughput", "cost", "time"]
"""What the search ranks candidates by (the spec's ``objective``)."""


def _round(x: Any) -> Any:
    """Round floats to 6 significant digits (deterministic text across platforms); recurse into containers."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_round(v) for v in x]
    return x



def format_rate(x: float) -> str:
    """Tokens/s as plans and reports print them: 12345.6 -> '12.35K', 2.5e6 -> '2.50M', 512 -> '512.0'.

    A value whose rounding reaches 1000 of its unit takes the next one (999_999 -> '1.00M', 999.96 -> '1.00K'), and a
    non-zero one that would print as 0.0 prints as '<0.1'."""
    if not math.isfinite(x):
        return f"{x}"  # 'nan', 'inf': no unit to scale
    units = (("", 1.0, 1), ("K", 1e3, 2), ("M", 1e6, 2))
    i = max((k for k, (_, div, _) in enumerate(units) if x >= div), default=0)
    for unit, div, decimals in units[i:]:
        text = f"{x / div:.{decimals}f}"
        if float(text) < 1000 or unit == "M":
            break
    if x > 0 and float(text) == 0:
        return "<0.1"
    return f"{text}{unit}"

@dataclass(frozen=True, kw_only=True)
class RolloutPlan:
    accelerators: int
    """Accelerators running rollout engines (all of them when colocated)."""
    tp: int
    """Tensor-parallel size of one engine replica."""
    ep: int
    """Expert-parallel size of one engine replica (1 for dense; = tp x attention-dp for MoE)."""
    replicas: int
    """Engine replicas (rollout groups): accelerators / accelerators_per_replica."""
    accelerators_per_replica: int
    max_num_seqs: int
    """Concurrent sequences per replica (continuous-batching slots), over all its attention data-parallel ranks
    (``accelerators_per_replica / tp``; vLLM's ``max_num_seqs`` is one rank's)."""
    max_model_len: int
    """Prompt cap + response cap, tokens."""
    versions_per_engine: int
    """Policy versions one replica holds at once (1 on GPUs)."""
    consolidation_batch: int | None
    """streaming: the most requests a replica takes in when an older version's requests are packed onto fewer
    replicas (its batching knee); None in other modes."""
    gpu_memory_utilization: float
    kv_capacity_tokens: int
    """KV-cache capacity of one replica, tokens."""

    @property
    def attention_dp(self) -> int:
        """Attention data-parallel ranks of one replica, accelerators_per_replica / tp (at least 1, also for a plan
        file whose sizes do not divide: the checks that read it report that)."""
        return max(1, self.accelerators_per_replica // max(1, self.tp))


@dataclass(frozen=True, kw_only=True)
class TrainPlan:
    accelerators: int
    tp: int
    pp: int
    ep: int
    dp: int
    cp: int
    num_microbatches: int
    micro_batch_tokens: int
    recompute: bool


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    side: Literal["rollout", "train", "host"]
    """``host``: on a colocated plan, each accelerator's share of its node's host memory (``screen.host_memory``)."""
    need_bytes: float
    have_bytes: float
    detail: dict[str, float]
    """Named components of need_bytes (weights, kv, extra_versions, optimizer, activations, ...)."""

    @property
    def headroom_fraction(self) -> float:
        return 1.0 - self.need_bytes / self.have_bytes if self.have_bytes else 0.0


@dataclass(frozen=True, kw_only=True)
class Predictions:
    step_time_s: float
    """Steady-state mean wall time per training step."""
    generated_tokens_per_s: float
    trained_tokens_per_s: float
    """Prompt + response tokens trained per second: what the trainer processes (verl's ``perf/throughput``
    convention; the fair cross-mode throughput). ``dora apply`` measures the same figure."""
    samples_per_s: float
    bubble_fraction: float
    """Fraction of accelerator time idle on the critical path (rollout slots empty or trainer waiting)."""
    rollout_occupancy: float
    """Mean fraction of rollout slots busy."""
    rollout_share: float
    """Fraction of a synchronous step spent generating (from the best simulated sync plan)."""
    trainer_utilization: float
    weight_sync_s: float
    engine_swap_s: float
    """Colocated streaming: wall seconds per step from stopping rollout until every engine has moved its weights and KV
    cache to host memory, plus from resuming until every one is back (simulated; the slowest engine each time). 0
    otherwise."""
    trainer_swap_s: float
    """Colocated plans: seconds per step moving the trainer's parameters, gradients and optimizer state to host memory
    and back (``weight_sync.trainer_swap_s``), inside ``step_time_s``. 0 on separate accelerators."""
    kv_preemptions_per_step: float
    """Sequences per step that an engine put back in its queue because its KV cache was full (vLLM's recompute
    preemption; simulated: the run's total over its steps)."""
    kv_recomputes_per_step: float
    """Sequences per step that started again without their KV cache: the preempted ones, and requests migrated to an
    engine whose cache could not hold them (streaming)."""
    kv_recomputed_tokens_per_step: float
    """Prompt and response tokens per step prefilled again for them."""
    mean_staleness: float
    max_live_versions: int
    total_time_s: float
    """Predicted time for all spec steps."""
    accelerator_hours: float
    cost_usd: float | None
    speedup_vs_sync: float
    """Trained tokens/s of this plan over the best synchronous plan's, on the placements the spec allows."""
    speedup_vs_sync_any_placement: float | None
    """Where the spec pins the placement and a sync plan on another placement is faster than that baseline: trained
    tokens/s of this plan over that sync plan's (one who chose sync would not keep the pins). None otherwise."""
    overlap_ceiling_tokens_per_s: float | None
    """Trained tokens/s of a perfect schedule (every slot busy up to the staleness budget, the longest response trained
    within k + 1 steps of its version; training overlapped with rollout on a disaggregated placement, in turn with it
    on a colocated one) on the best placement searched: a bound on any schedule under the cost model, up to its
    mean-context averaging (``Screen.overlap_ceiling``). None if nothing was searched."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One considered (placement, mode, k) point and why it won or lost."""

    label: str
    """Short human description, e.g. 'disagg R96(tp4x24) T32(tp4 pp1 dp8) streaming k=3'."""
    mode: Mode
    max_version_lag: int
    colocated: bool
    rollout_accelerators: int
    train_accelerators: int
    stage: Literal["screen", "simulated"]
    trained_tokens_per_s: float | None
    status: Literal["chosen", "rejected"]
    reason: str
    """For rejected candidates: 'does not fit: needs X GiB, has Y GiB', 'slower by N%', 'violates staleness', ..."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    format_version: int
    dora_version: str
    spec_name: str
    spec_file: str
    """The spec path as given (relative), for humans; the hash is what binds the plan to the spec."""
    spec_hash: str
    inputs: dict[str, Any]
    """What ``spec_hash`` covers, as plain JSON (``dora.spec.ResolvedSpec.inputs``): the validated spec, the resolved
    architecture and a digest of each file the spec reads. Diffs against a saved plan show which of them changed.
    Kept exact (not rounded like the computed figures): its numbers were read from text."""
    catalog_fingerprint: str
    calibration_fingerprint: str
    calibration_source: str
    seed: int
    objective: Objective
    mode: Mode
    max_version_lag: int
    allow_version_mixing: bool
    colocated: bool
    early_steps: bool
    """The trainer starts a step held only by the oldest version's unfinished groups, and takes them as they finish
    (``planner.policies.PolicyConfig.early_steps``; the runtime derives the same from the mode, the placement and
    the algorithm, ``early_steps_for``)."""
    rollout: RolloutPlan
    train: TrainPlan
    memory: tuple[MemoryReport, ...]
    predictions: Predictions
    considered: tuple[Candidate, ...]
    warnings: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        inputs = out.pop("inputs")
        return _round(out) | {"inputs": inputs}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of ``to_dict``; raises ValueError naming the first missing or unknown field."""
        return _build(cls, data, "plan")


_NESTED = {"rollout": RolloutPlan, "train": TrainPlan, "predictions": Predictions}
_SIZES = (RolloutPlan, TrainPlan)
"""Their whole numbers are sizes and counts: at least 1 (``_MAY_BE_ZERO`` apart)."""
_MAY_BE_ZERO = frozenset({"kv_capacity_tokens"})


def _check_value(value: Any, hint: Any, where: str, *, positive: bool = False) -> None:
    """``value`` (read from JSON) has the type ``hint`` and a sensible range: whole numbers >= 0 (>= 1 with
    ``positive``), finite numbers; raises ValueError naming ``where``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return
        _check_value(value, next(a for a in args if a is not type(None)), where, positive=positive)
        return
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        for i, item in enumerate(value):
            _check_value(item, args[0], f"{where}[{i}]")
        return
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {value!r}")
        for k, item in value.items():
            _check_value(item, args[1], f"{where}.{k}")
        return
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= (1 if positive else 0)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    elif hint is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"{where}: no check for {hint!r}")
    if not ok:
        what = {int: f"a whole number >= {1 if positive else 0}", float: "a finite number"}.get(hint, hint.__name__)
        raise ValueError(f"{where}: expected {what}, got {value!r}")


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    missing = sorted(names - set(data))
    if unknown:
        raise ValueError(f"{where}: unknown field '{unknown[0]}'")
    if missing:
        raise ValueError(f"{where}: missing field '{missing[0]}'")
    kw: dict[str, Any] = {}
    hints = get_type_hints(cls)
    for name in names:
        value = data[name]
        if cls is Plan and name in ("memory", "considered"):
            if not isinstance(value, list):
                raise ValueError(f"{where}.{name}: expected a list, got {value!r}")
        elif cls is Plan and name == "inputs":
            for part in ("spec", "arch", "files"):
                if not isinstance(value, dict) or not isinstance(value.get(part), dict):
                    raise ValueError(f"{where}.inputs.{part}: expected an object")
        elif not (cls is Plan and name in _NESTED):  # nested objects are checked field by field below
            _check_value(value, hints[name], f"{where}.{name}", positive=cls in _SIZES and name not in _MAY_BE_ZERO)
        if cls is Plan and name in _NESTED:
            value = _build(_NESTED[name], value, f"{where}.{name}")
        elif cls is Plan and name == "memory":
            value = tuple(_build(MemoryReport, m, f"{where}.memory[{i}]") for i, m in enumerate(value))
        elif cls is Plan and name == "considered":
            value = tuple(_build(Candidate, c, f"{where}.considered[{i}]") for i, c in enumerate(value))
        elif cls is Plan and name == "warnings":
            value = tuple(value)
        kw[name] = value
    return cls(**kw)
