"""`dora apply`'s closing comparison of a finished local run with its plan's prediction (``dora.apply.plan_check``)."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
from test_lower_plans import example_plan, load_example

from dora.apply import (
    PLAN_CHECK_MIN_STEPS,
    PLAN_CHECK_TOLERANCE,
    ApplyOverrides,
    plan_check,
    plan_spec,
    runtime_config_for,
)

SPEC = "specs/local-tiny.yaml"


def _planned(**overrides):
    resolved = load_example("local-tiny")
    plan = example_plan(resolved, "local-tiny")
    rc = runtime_config_for(resolved, ApplyOverrides(output_dir="runs/my run", **overrides), plan=plan)
    return resolved, plan, rc


def _summary(plan, ratio: float, steps: int = 150) -> dict:
    """A run's summary whose steady throughput is ``ratio`` times the plan's prediction."""
    return {"steps": steps, "resumed_from_step": None,
            "steady_trained_tokens_per_s": plan.predictions.trained_tokens_per_s * ratio,
            "steady_step_time_s": plan.predictions.step_time_s / ratio}


def test_a_run_near_its_prediction_gets_one_line_with_both_figures() -> None:
    resolved, plan, rc = _planned()
    lines = plan_check(SPEC, resolved, plan, rc, _summary(plan, 1.1))
    assert len(lines) == 1
    predicted = plan.predictions.trained_tokens_per_s
    assert f"{predicted * 1.1:,.0f} tokens/s against the {predicted:,.0f} predicted (+10%)" in lines[0]
    assert f"(constants: {plan.calibration_source})" in lines[0]


@pytest.mark.parametrize("ratio", [1 - PLAN_CHECK_TOLERANCE - 0.01, 0.5, 1.6])
def test_a_run_far_from_its_prediction_gets_the_commands_that_fit_this_machine(ratio: float) -> None:
    resolved, plan, rc = _planned()
    assert rc.mode != "sync"
    lines = plan_check(SPEC, resolved, plan, rc, _summary(plan, ratio))
    assert f"({ratio - 1:+.0%})" in lines[0] and "more than 25% off" in lines[1]
    commands = [shlex.split(line) for line in lines[2:]]
    # the fit needs a sync run beside this one (training steps with no rollout running); paths quoted for the shell
    assert commands == [
        ["dora", "apply", SPEC, "--mode", "sync", "--steps", "20", "--output-dir", "runs/my run-sync"],
        ["dora", "calibrate", SPEC, "--from-run", "runs/my run", "--from-run", "runs/my run-sync",
         "--out", "calibration.json"],
        ["dora", "plan", SPEC, "--calibration", "calibration.json"]]


def test_a_sync_run_is_fitted_alone() -> None:
    resolved, plan = plan_spec(load_example("local-tiny"), "sync", None)
    rc = runtime_config_for(resolved, ApplyOverrides(mode="sync", output_dir="runs/s"), plan=plan)
    lines = plan_check(SPEC, resolved, plan, rc, _summary(plan, 0.5))
    assert [shlex.split(line)[:2] for line in lines[2:]] == [["dora", "calibrate"], ["dora", "plan"]]
    assert shlex.split(lines[2])[3:5] == ["--from-run", "runs/s"] and lines[2].count("--from-run") == 1


def test_no_comparison_for_a_run_that_overrode_the_plans_engines_or_slots() -> None:
    resolved, plan, rc = _planned()
    for changes, named in (({"rollout_workers": rc.rollout_workers + 1}, "rollout workers"),
                           ({"max_num_seqs": rc.max_num_seqs - 1}, "slots per worker")):
        lines = plan_check(SPEC, resolved, plan, dataclasses.replace(rc, **changes), _summary(plan, 0.5))
        assert lines == [f"plan vs run: not compared: this run overrode the plan's {named}, and the plan predicts "
                         "its own configuration"]


def test_no_comparison_for_a_run_too_short_for_a_steady_figure() -> None:
    resolved, plan, rc = _planned()
    short = _summary(plan, 0.5, steps=PLAN_CHECK_MIN_STEPS - 1)
    assert plan_check(SPEC, resolved, plan, rc, short)[0].startswith(
        f"plan vs run: not compared: {PLAN_CHECK_MIN_STEPS - 1} step(s) ran")
    # a resumed run counts the steps of this attempt only
    resumed = _summary(plan, 0.5, steps=150) | {"resumed_from_step": 145}
    assert "not compared: 5 step(s) ran" in plan_check(SPEC, resolved, plan, rc, resumed)[0]
    one = {"steps": 1, "resumed_from_step": None, "first_step_trained_tokens_per_s": 1.0}
    assert "not compared: 1 step(s) ran" in plan_check(SPEC, resolved, plan, rc, one)[0]


def test_a_submitted_runs_summary_is_read_from_its_output_directory(tmp_path) -> None:
    """`dora apply --address`: the job writes summary.json to the output directory the cluster shares; apply compares
    it with the plan once the job has succeeded, and says so when the file is not there."""
    from dora.apply import _plan_check_of_run_dir

    resolved, plan, rc = _planned()
    rc = dataclasses.replace(rc, output_dir=str(tmp_path))
    assert _plan_check_of_run_dir(SPEC, resolved, plan, rc)[0].startswith(
        f"plan vs run: not compared: no readable summary in {tmp_path / 'summary.json'}")
    (tmp_path / "summary.json").write_text(json.dumps({"audit": {}, "summary": _summary(plan, 1.05)}))
    assert _plan_check_of_run_dir(SPEC, resolved, plan, rc) == plan_check(SPEC, resolved, plan, rc,
                                                                           _summary(plan, 1.05))
    assert "(+5%)" in _plan_check_of_run_dir(SPEC, resolved, plan, rc)[0]
