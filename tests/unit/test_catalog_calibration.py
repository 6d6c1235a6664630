"""The catalog's constants depend on the rollout engine on `cpu`: vLLM's CPU engine plans with its own entry
(``planner.calibration.catalog_calibration``), and a calibration file sets only what it names over the spec's entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_lower_plans import example_plan, load_example

from dora.apply import _calibration_flag
from dora.planning import CalibrationFileError, catalog_for, load_calibration, make_plan
from planner.calibration import (
    DEFAULT_CALIBRATION,
    VLLM_CPU_CALIBRATION,
    VLLM_CPU_ENGINE,
    catalog_calibration,
    is_catalog,
)


def test_vllm_on_cpu_has_its_own_entry_and_it_changes_cpu_constants_only() -> None:
    assert catalog_calibration("cpu", "vllm") is VLLM_CPU_CALIBRATION
    for accelerator, engine in (("cpu", "torch"), ("h800", "vllm"), ("h100", "torch")):
        assert catalog_calibration(accelerator, engine) is DEFAULT_CALIBRATION
    assert is_catalog(VLLM_CPU_CALIBRATION) and is_catalog(DEFAULT_CALIBRATION)
    assert VLLM_CPU_CALIBRATION.fingerprint() != DEFAULT_CALIBRATION.fingerprint()
    default, vllm = DEFAULT_CALIBRATION.to_dict(), VLLM_CPU_CALIBRATION.to_dict()
    changed = {k for k in default if default[k] != vllm[k]} - {"source"}
    assert changed == {k for k, v in VLLM_CPU_ENGINE.items() if v != default[k]}
    assert changed and all(k.startswith("cpu_") for k in changed)  # a GPU plan of a vLLM spec is what it was
    # vLLM's step on the tiny model costs more than the torch engine's: more fixed cost, less of the peak
    assert vllm["cpu_step_overhead_s"] > default["cpu_step_overhead_s"]
    assert vllm["cpu_compute_efficiency"] < default["cpu_compute_efficiency"]


def test_the_vllm_spec_is_planned_with_vllms_constants_and_the_plan_says_so() -> None:
    resolved = load_example("local-tiny-vllm")
    assert catalog_for(resolved) is VLLM_CPU_CALIBRATION
    plan = example_plan(resolved, "local-tiny-vllm")
    assert plan.calibration_source == "catalog defaults, vLLM's CPU engine"
    assert plan.calibration_fingerprint == VLLM_CPU_CALIBRATION.fingerprint()
    assert any(w.startswith("uncalibrated: ") for w in plan.warnings)  # still the catalog's, not this machine's
    as_torch = make_plan(resolved, DEFAULT_CALIBRATION).plan  # the torch engine's constants, as before this entry
    assert plan.predictions.trained_tokens_per_s < 0.7 * as_torch.predictions.trained_tokens_per_s
    # a saved plan of the catalog entry is re-planned without --calibration
    assert _calibration_flag(plan, Path(".")) == ("", "")
    assert catalog_for(load_example("local-tiny")) is DEFAULT_CALIBRATION
    assert example_plan(load_example("local-tiny"), "local-tiny").calibration_source == "catalog defaults"


def test_a_calibration_file_sets_what_it_names_over_the_specs_catalog_entry(tmp_path: Path) -> None:
    """A hand-written file that sets one constant leaves the others at the spec's catalog entry: vLLM's for the vLLM
    spec, not the torch engine's."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"calibration": {"cpu_step_overhead_s": 0.003}}), encoding="utf-8")
    vllm_spec = load_example("local-tiny-vllm")
    cal = load_calibration(str(path), catalog_for(vllm_spec))
    assert cal.cpu_step_overhead_s == 0.003 and cal.source == f"file {path}" and not is_catalog(cal)
    for name in ("cpu_compute_efficiency", "cpu_weight_reload_fixed_s", "cpu_controller_round_trip_s"):
        assert getattr(cal, name) == VLLM_CPU_ENGINE[name] != getattr(DEFAULT_CALIBRATION, name)
    torch = load_calibration(str(path), catalog_for(load_example("local-tiny")))
    assert torch.cpu_weight_reload_fixed_s == DEFAULT_CALIBRATION.cpu_weight_reload_fixed_s
    assert load_calibration(None, catalog_for(vllm_spec)) is VLLM_CPU_CALIBRATION
    # the plan names what the file left at the catalog's values, and not what it set
    warnings = make_plan(vllm_spec, cal).plan.warnings
    partly = [w for w in warnings if w.startswith("partly calibrated")]
    assert partly and "cpu_compute_efficiency" in partly[0] and "cpu_step_overhead_s" not in partly[0]


def test_a_plan_calibrated_on_the_other_engines_runs_says_so(tmp_path: Path) -> None:
    """`dora calibrate` records the engine its runs rolled out with (``cpu_rollout_engine``); a plan of a spec with the
    other engine warns that the constants describe another engine's steps. The torch main job's fit, used to plan its
    vLLM twin, would have predicted twice the throughput."""
    fitted = {**{k: getattr(DEFAULT_CALIBRATION, k) for k in VLLM_CPU_ENGINE}, "source": "measured in situ: test"}
    vllm_spec, torch_spec = load_example("local-tiny-vllm"), load_example("local-tiny")
    warned = "calibrated for another rollout engine"
    for engine, spec, warns in (("torch", vllm_spec, True), ("vllm", vllm_spec, False), ("torch", torch_spec, False),
                                ("vllm", torch_spec, True)):
        path = tmp_path / f"{engine}.json"
        path.write_text(json.dumps({"calibration": {**fitted, "cpu_rollout_engine": engine}}), encoding="utf-8")
        cal = load_calibration(str(path), catalog_for(spec))
        assert cal.cpu_rollout_engine == engine
        warnings = [w for w in make_plan(spec, cal).plan.warnings if w.startswith(warned)]
        assert bool(warnings) == warns, (engine, spec.spec.name, warnings)
        if warns:
            assert f"describe the {engine} engine's runs" in warnings[0] and "dora calibrate SPEC --from-run" in warnings[0]
    assert VLLM_CPU_CALIBRATION.cpu_rollout_engine == "vllm" and DEFAULT_CALIBRATION.cpu_rollout_engine is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"calibration": {"cpu_rollout_engine": "sglang"}}), encoding="utf-8")
    with pytest.raises(CalibrationFileError, match="cpu_rollout_engine must be one of torch, vllm, got 'sglang'"):
        load_calibration(str(bad), catalog_for(vllm_spec))
