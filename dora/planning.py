"""From a resolved spec to a Plan: build the planner's inputs, run the search, assemble the plan.

This is the seam between the spec layer (files, YAML) and the pure planner: everything the planner needs is
passed explicitly, and the planner never sees the spec object.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dora import __version__
from dora.parallel import fork_map
from dora.spec import ResolvedSpec, SpecError
from dora.spec.diagnostics import Diagnostic, did_you_mean
from dora.spec.files import InputFileError, loads_json, read_input_file
from dora.spec.models import ALL_MODES
from dora.spec.yamlio import YamlDoc
from planner.architecture import ACTIVATION_BYTES, DTYPE_BYTES
from planner.calibration import DEFAULT_CALIBRATION, Calibration, catalog_calibration
from planner.hardware import get_accelerator, with_overrides
from planner.plan import Plan
from planner.search import InfeasibleError, Pins, SearchInputs, SearchOutcome, build_plan, search
from planner.search.core import MapFn, Screen, Simulated, Space, _placements, mode_ks
from planner.search.screen import fits_host_memory

GB = 1e9
GIB = 1024**3
VLLM_MAX_NUM_SEQS = 256
"""vLLM's default cap on concurrently scheduled sequences per engine (EngineArgs.max_num_seqs)."""
CPU_MAX_NUM_SEQS = 64
"""The torch CPU engine's slot cap: beyond ~64 sequences a 2-core decode step is compute-bound."""


class CalibrationFileError(Exception):
    pass


MAX_JSON_FILE_BYTES = 16 << 20
"""Largest plan or calibration file read (a plan.json is about 13 KB)."""


def read_json_object(path: str, what: str, error: type[Exception]) -> dict:
    """The JSON object in ``path``; ``error`` (naming ``what`` and the path) when missing, not a regular file, over
    ``MAX_JSON_FILE_BYTES``, not JSON that dora reads (nested too deeply, an integer beyond any float) or not an
    object."""
    try:
        raw = read_input_file(path, MAX_JSON_FILE_BYTES)
    except InputFileError as exc:
        raise error(f"{what} '{path}' {exc.why}") from None
    try:
        data = loads_json(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{what} '{path}' is not readable JSON: not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:  # bad syntax, nesting too deep for the parser, an integer beyond any float
        raise error(f"{what} '{path}' is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{what} '{path}' must hold a JSON object")
    return data


CALIBRATION_FILE_KEYS = frozenset({"calibration", "format", "spec", "machine", "measurements", "fits"})
"""The top-level keys of a calibration file (``dora.calibrate.calibration_document``); only "calibration" is read."""


def catalog_for(resolved: ResolvedSpec) -> Calibration:
    """The catalog's constants for this spec's accelerator and rollout engine (``catalog_calibration``)."""
    return catalog_calibration(resolved.spec.cluster.accelerator, resolved.spec.runtime.rollout_engine)


def load_calibration(path: str | None, base: Calibration = DEFAULT_CALIBRATION) -> Calibration:
    """The calibration file at ``path`` over ``base`` (the spec's catalog entry, ``catalog_for``): the constants the
    file leaves out keep base's values. No path: ``base``."""
    if path is None:
        return base
    from dora.calibrate import FORMAT

    data = read_json_object(path, "calibration file", CalibrationFileError)
    if "format" in data and data["format"] != FORMAT:
        raise CalibrationFileError(f"calibration file '{path}' has format {json.dumps(data['format'])[:60]}, and this "
                                   f"dora reads \"{FORMAT}\": write it again with this dora's `dora calibrate`")
    beside = sorted(set(data) & (CALIBRATION_FILE_KEYS - {"calibration"}))
    if "calibration" not in data and beside:  # read as a bare constants object, it said "unknown key 'fits'"
        raise CalibrationFileError(f"calibration file '{path}' has no \"calibration\" object: its top-level keys "
                                   f"({', '.join(beside)}) are those of a file `dora calibrate` writes, whose constants "
                                   "are under \"calibration\"; write it again with `dora calibrate`, or put the "
                                   "constants back under \"calibration\"")
    values = data.get("calibration", data)
    if "calibration" in data and (unknown := sorted(set(data) - CALIBRATION_FILE_KEYS)):
        known = ", ".join(sorted(CALIBRATION_FILE_KEYS - {"calibration"}))
        raise CalibrationFileError(f"calibration file '{path}' has an unknown top-level key '{unknown[0]}': beside "
                                   f"\"calibration\" it holds only {known} (what `dora calibrate` writes); remove "
                                   "it, or move a constant into \"calibration\""
                                   + did_you_mean(unknown[0], CALIBRATION_FILE_KEYS))
    if not isinstance(values, dict):
        raise CalibrationFileError(f"calibration file '{path}': \"calibration\" must be an object of constants "
                                   f"(name: value), got {json.dumps(values)[:60]}; `dora calibrate` writes one")
    if not set(values) - {"source"}:  # planned as catalog defaults, but reported as calibrated by the file
        raise CalibrationFileError(f"calibration file '{path}' sets no constants (its \"calibration\" object is "
                                   f"{json.dumps(values)[:60]}); `dora calibrate` writes one, or leave out --calibration")
    if "source" not in values:
        values = {**values, "source": f"file {path}"}  # not "catalog defaults": it sets some of them
    try:
        return Calibration.from_dict(values, base)
    except (TypeError, ValueError) as exc:
        raise CalibrationFileError(f"calibration file '{path}': {exc}") from None


def _extra_forward_passes(resolved: ResolvedSpec) -> int:
    a = resolved.spec.algorithm
    # Proximal (old) log-probs: a no-grad forward over the batch only when the step takes several optimizer
    # steps; with one, they are the training forward's own, detached (what `TorchTrainer.train_step` does).
    passes = 1 if _optimizer_steps(resolved) > 1 else 0
    if a.kl_coef > 0:
        passes += 1  # reference model
    passes += 3 * (a.ppo_epochs - 1)
    if a.name == "ppo":
        passes += 4  # a same-size critic: forward, backward, value inference
    return passes


def _optimizer_steps(resolved: ResolvedSpec) -> int:
    a = resolved.spec.algorithm
    return a.minibatches_per_step * a.ppo_epochs


def search_inputs(resolved: ResolvedSpec, calibration: Calibration | None = None,
                  *, unpinned: bool = False) -> SearchInputs:
    spec = resolved.spec
    c = spec.cluster
    acc = get_accelerator(c.accelerator)
    if c.scale_up_bandwidth_gb_per_s or c.scale_out_bandwidth_gb_per_s or c.host_memory_gib_per_node:
        acc = with_overrides(
            acc,
            scale_up_bandwidth_bytes_per_s=c.scale_up_bandwidth_gb_per_s * GB if c.scale_up_bandwidth_gb_per_s else None,
            scale_out_bandwidth_bytes_per_s=(c.scale_out_bandwidth_gb_per_s * GB
                                             if c.scale_out_bandwidth_gb_per_s else None),
            host_memory_bytes_per_node=c.host_memory_gib_per_node * GIB if c.host_memory_gib_per_node else None)
    st = spec.staleness
    if st.mode == "auto":
        modes = tuple(m for m in ALL_MODES if m != "partial-rollout" or st.allow_version_mixing)
    else:
        modes = (st.mode,)
    pins, pinned_seqs = Pins(), None
    if spec.placement != "auto" and not unpinned:
        p = spec.placement
        pins = Pins(colocated=p.colocated, rollout_accelerators=p.rollout.accelerators, rollout_tp=p.rollout.tp,
                    rollout_ep=p.rollout.ep, versions_per_engine=p.rollout.versions_per_engine,
                    consolidation_batch=p.rollout.consolidation_batch,
                    train_accelerators=p.train.accelerators, train_tp=p.train.tp, train_pp=p.train.pp,
                    train_ep=p.train.ep, train_dp=p.train.dp, train_cp=p.train.cp)
        pinned_seqs = p.rollout.max_num_seqs  # the engines' slot cap: searched nowhere, so not a Pins field
    return SearchInputs(
        arch=resolved.arch, accelerator=acc, nodes=c.nodes, accelerators_per_node=c.accelerators_per_node,
        dtype_bytes=ACTIVATION_BYTES[spec.model.dtype], rollout_weight_bytes=DTYPE_BYTES[spec.model.dtype],
        prompts_per_step=spec.workload.prompts_per_step,
        samples_per_prompt=spec.workload.samples_per_prompt, prompt_lengths=resolved.prompt_lengths,
        response_lengths=resolved.response_lengths, steps=spec.workload.steps, max_version_lag=st.max_version_lag,
        modes=modes, allow_version_mixing=st.allow_version_mixing,
        extra_forward_passes=_extra_forward_passes(resolved), optimizer_steps=_optimizer_steps(resolved),
        samples_per_minibatch=max(1, spec.workload.prompts_per_step * spec.workload.samples_per_prompt
                                  // spec.algorithm.minibatches_per_step),
        gpu_memory_utilization=spec.runtime.gpu_memory_utilization,
        max_num_seqs_cap=pinned_seqs or (CPU_MAX_NUM_SEQS if c.accelerator == "cpu" else VLLM_MAX_NUM_SEQS),
        pins=pins, price_per_accelerator_hour_usd=c.price_per_accelerator_hour_usd, objective=spec.objective,
        seed=spec.runtime.seed, calibration=catalog_for(resolved) if calibration is None else calibration,
        # the local `count` task's prompt fixes the answer's length: every sample of a group has the same one
        lengths_per_prompt=spec.workload.task is not None,
        rollout_engine=spec.runtime.rollout_engine)


def _pinned_slowdown(resolved: ResolvedSpec, calibration: Calibration, outcome: SearchOutcome) -> float | None:
    """How much slower the pinned placement's best screen estimate is than the unpinned best (None: no pins)."""
    if resolved.spec.placement == "auto":
        return None
    inputs = search_inputs(resolved, calibration, unpinned=True)
    space = Space(inputs)
    screen = Screen(space)
    best = max((screen.evaluate(p, m, k).trained_tokens_per_s for p in _placements(space, screen)
                for m, k in mode_ks(inputs, p.colocated) if fits_host_memory(p, m, inputs)), default=None)
    pinned = outcome.screened[0].trained_tokens_per_s
    return None if best is None else max(0.0, 1 - pinned / best)


@dataclasses.dataclass(frozen=True)
class Planned:
    plan: Plan
    outcome: SearchOutcome
    inputs: SearchInputs


def pin_problems(resolved: ResolvedSpec, calibration: Calibration | None = None) -> list[Diagnostic]:
    """A pinned training size (``placement.train.accelerators``, or the whole cluster with ``colocated: true``) that
    no training layout can take, by the planner's own rule (``Space.has_train_layout``): the field, its line and the
    nearest sizes that have one. `dora validate` said "ok" to a pin of 63 of 64 accelerators, and `dora plan` then
    said only "nothing fits"."""
    spec = resolved.spec
    if spec.placement == "auto":
        return []
    pins = spec.placement
    size = pins.train.accelerators or (spec.total_accelerators if pins.colocated else None)
    if size is None:
        return []
    space = Space(search_inputs(resolved, calibration))
    if space.has_train_layout(size):
        return []
    # the sizes the pins leave room for: the whole cluster colocated, beside the rollout side otherwise
    room = spec.total_accelerators - ((pins.rollout.accelerators or 1) if pins.colocated is False else 0)
    nearest = sorted((n for n in range(max(1, size - 64), min(room, size + 64) + 1)
                      if n != size and space.has_train_layout(n)), key=lambda n: (abs(n - size), n))[:3]
    path = ("placement", "train", "accelerators") if pins.train.accelerators else ("placement", "colocated")
    samples = space.inp.samples_per_minibatch
    pinned = ", ".join(f"{k}={v}" for k, v in (("tp", pins.train.tp), ("pp", pins.train.pp), ("cp", pins.train.cp),
                                                 ("dp", pins.train.dp)) if v is not None)
    return [Diagnostic(
        path=path, line=(doc.line_of(path) if (doc := spec_doc(resolved.file)) is not None else None),
        message=(f"no training layout takes {size} accelerators: none of tp x pp x cp x dp = {size} has tp dividing "
                 f"the heads, pp within the layers and a dp dividing the {samples:,} samples of an optimizer step"
                 + (f" with the pinned {pinned}" if pinned else "")),
        hint=(f"train on {' or '.join(map(str, sorted(nearest)))} accelerators instead"
              if nearest and pins.train.accelerators else
              f"change or remove the pinned {pinned} (colocated, training takes all {size} accelerators)"
              if pinned else "remove the pinned training sizes, or change the batch (prompts_per_step x "
                             "samples_per_prompt)"))]


def spec_doc(file: str) -> YamlDoc | None:
    """The spec ``file`` read again for its line numbers (``YamlDoc.line_of``), or None where it no longer reads as
    YAML (gone or changed since it was loaded)."""
    from dora.spec.yamlio import MAX_FILE_BYTES, parse_yaml

    try:
        return parse_yaml(read_input_file(file, MAX_FILE_BYTES).decode("utf-8"), file)
    except (InputFileError, UnicodeDecodeError, ValueError):
        return None


def make_plan(resolved: ResolvedSpec, calibration: Calibration | None = None, *, workers: int = 1,
              progress: Callable[[int, int], None] | None = None) -> Planned:
    """Search and assemble the plan with ``calibration`` (None: the spec's catalog entry, ``catalog_for``); raises
    ``SpecError`` for a pinned training size no layout takes (``pin_problems``) and ``InfeasibleError`` when nothing
    fits.

    ``workers`` > 1 runs the search's simulations in that many forked processes (``dora.parallel``): only from a
    process with no threads yet (the ``dora plan`` command). The plan is the same either way. ``progress(done,
    running)`` is called before and after each batch of simulations: how many have run, how many are running."""
    calibration = catalog_for(resolved) if calibration is None else calibration
    problems = pin_problems(resolved, calibration)
    if problems:
        raise SpecError(resolved.file, problems)
    inputs = search_inputs(resolved, calibration)
    map_fn = _counted(fork_map(workers), progress)
    outcome = search(inputs, map_fn=map_fn)
    plan = build_plan(outcome, inputs, dora_version=__version__, spec_name=resolved.spec.name,
                      spec_file=_portable(resolved.file), spec_hash=resolved.spec_hash, spec_inputs=resolved.inputs,
                      pinned_slowdown=_pinned_slowdown(resolved, calibration, outcome),
                      any_placement_sync=_any_placement_sync(resolved, calibration, map_fn))
    return Planned(plan=plan, outcome=outcome, inputs=inputs)


def _counted(map_fn: MapFn, progress: Callable[[int, int], None] | None) -> MapFn:
    """``map_fn``, calling ``progress(done, running)`` before and after each call: the items mapped so far, and
    those of the call under way (0 after it)."""
    if progress is None:
        return map_fn
    done = 0

    def run(fn: Any, items: Sequence[Any]) -> list[Any]:
        nonlocal done
        if not items:
            return map_fn(fn, items)
        progress(done, len(items))
        out = map_fn(fn, items)
        done += len(out)
        progress(done, 0)
        return out

    return run


def _any_placement_sync(resolved: ResolvedSpec, calibration: Calibration, map_fn: MapFn) -> Simulated | None:
    """Where the spec pins the placement: the best sync plan of a sync-only search with the pins lifted, so that the
    report can say what asynchrony buys over sync on any placement too (local-tiny pins a disaggregated placement,
    and sync runs faster colocated). None when nothing is pinned."""
    if resolved.spec.placement == "auto":
        return None
    inputs = dataclasses.replace(search_inputs(resolved, calibration, unpinned=True), modes=("sync",))
    return search(inputs, map_fn=map_fn).best_sync


def _portable(file: str) -> str:
    """The spec path relative to the working directory, '/'-separated (no absolute paths in plan files; a spec
    outside the working directory gets a ``../`` path)."""
    p = Path(file)
    if p.is_absolute():
        p = Path(os.path.relpath(p, Path.cwd()))
    return p.as_posix()


__all__ = ["CalibrationFileError", "InfeasibleError", "Planned", "catalog_for", "load_calibration", "make_plan",
           "search_inputs"]
