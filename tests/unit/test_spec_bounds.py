"""Numeric spec fields are bounded, so that no product of them (tokens, time, cost) overflows; out-of-range values
are reported at their field. Also: the context check's advice, and diffs of plans holding absurd numbers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from dora.apply import ApplyOverrides, runtime_config_for
from dora.cli import main
from dora.planning import make_plan
from dora.report import format_value, plan_diff, render_diff
from dora.spec import SpecError, load_spec, load_spec_text, models
from dora.spec.diagnostics import format_path
from dora.spec.schema import spec_json_schema
from planner.architecture import HF_INT_MAX, MAX_NORM_EPS, MAX_ROPE_THETA
from planner.search import core

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "specs" / "local-tiny.yaml"
BASE = """\
name: t
model: {MODEL}
cluster: {accelerator: h800, nodes: 2, accelerators_per_node: 8}
workload:
  prompts_per_step: 64
  samples_per_prompt: 8
  prompt_length: {median_tokens: 300, p99_tokens: 1000, max_tokens: PROMPT_MAX}
  response_length: {median_tokens: 1500, p99_tokens: 12000, max_tokens: 16384}
  steps: 10
staleness: {max_version_lag: 2}
runtime: {rollout_engine: vllm, trainer: megatron}
"""


def test_bounds_agree_with_the_planner() -> None:
    assert models.MAX_ACCELERATORS == core.MAX_ACCELERATORS
    assert models.MAX_BATCH_SAMPLES == core.MAX_BATCH_SAMPLES
    assert models.MAX_ARCH_INT == HF_INT_MAX
    assert (models.MAX_ROPE_THETA, models.MAX_NORM_EPS) == (MAX_ROPE_THETA, MAX_NORM_EPS)


def _numeric_fields(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """'Model.field' -> the JSON Schema of each integer or number field (a nullable one's non-null branch)."""
    out = {}
    for name, definition in schema["$defs"].items():
        for field, prop in definition.get("properties", {}).items():
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") in ("integer", "number"):
                    out[f"{name}.{field}"] = branch
    return out


def test_every_numeric_field_has_an_upper_bound() -> None:
    fields = _numeric_fields(spec_json_schema())
    assert len(fields) > 40 and "WorkloadSpec.steps" in fields
    unbounded = sorted(k for k, v in fields.items() if "maximum" not in v and "exclusiveMaximum" not in v)
    assert unbounded == []


@pytest.mark.parametrize(("yaml_path", "old", "new", "message"), [
    ("workload.steps", "steps: 10", "steps: 1" + "0" * 400, "must be <= 1000000, got 1000000000"),
    ("cluster.price_per_accelerator_hour_usd", "per_node: 8}", "per_node: 8, price_per_accelerator_hour_usd: 1.0e+308}",
     "must be <= 10000"),
    ("workload.prompts_per_step", "prompts_per_step: 64", "prompts_per_step: 1000001", "must be <= 1000000"),
    ("workload.response_length.max_tokens", "max_tokens: 16384", "max_tokens: 100000000", "must be <= 16777216"),
    ("algorithm.ppo_epochs", "runtime:", "algorithm: {ppo_epochs: 101}\nruntime:", "must be <= 100"),
    ("placement.rollout.versions_per_engine", "runtime:", "placement: {rollout: {versions_per_engine: 66}}\nruntime:",
     "must be <= 65"),
    # an integer beyond a float: pydantic says "not a valid number", and dora said "expected a number"
    ("algorithm.tis_cap", "runtime:", "algorithm: {tis_cap: 1" + "0" * 400 + "}\nruntime:",
     "must be > 0 and <= 1000, got 1000"),
    ("algorithm.learning_rate", "runtime:", "algorithm: {learning_rate: -0x" + "f" * 400 + "}\nruntime:",
     "must be > 0 and <= 1, got -4446"),
])
def test_a_value_over_its_bound_is_reported_at_its_field(tmp_path: Path, yaml_path: str, old: str, new: str,
                                                          message: str) -> None:
    text = BASE.replace("{MODEL}", "{preset: qwen3-8b}").replace("PROMPT_MAX", "2048")
    assert old in text
    with pytest.raises(SpecError) as info:
        load_spec_text(text.replace(old, new, 1), "s.yaml", tmp_path)
    (diag,) = info.value.diagnostics
    assert format_path(diag.path) == yaml_path and message in diag.message and diag.line


def test_a_plan_at_the_bounds_stays_finite() -> None:
    """The largest price and step count a spec may set: the cost and time are still JSON numbers."""
    text = TINY.read_text().replace("steps: 150", "steps: 1000000").replace(
        "accelerators_per_node: 2", "accelerators_per_node: 2\n  price_per_accelerator_hour_usd: 10000")
    resolved = load_spec_text(text, "tiny.yaml", TINY.parent)
    plan = make_plan(resolved).plan
    predictions = json.loads(plan.to_json())["predictions"]
    assert math.isfinite(predictions["cost_usd"]) and predictions["cost_usd"] > 0
    assert math.isfinite(predictions["total_time_s"])


def test_apply_steps_override_is_bounded() -> None:
    resolved = load_spec(str(TINY))
    plan = make_plan(resolved).plan
    with pytest.raises(ValueError, match="--steps must be at most 1,000,000"):
        runtime_config_for(resolved, ApplyOverrides(steps=10**7), plan)


# ----- the context check ----------------------------------------------------------------------------------
def _context_diag(tmp_path: Path, model: str, prompt_max: int) -> Any:
    with pytest.raises(SpecError) as info:
        load_spec_text(BASE.replace("{MODEL}", model).replace("PROMPT_MAX", str(prompt_max)), "s.yaml", tmp_path)
    (diag,) = info.value.diagnostics
    return diag


def test_a_prompt_cap_beyond_the_context_is_reported_at_the_prompt_cap(tmp_path: Path) -> None:
    config = REPO / "tests" / "data" / "hf_configs" / "qwen3-8b.json"  # rope_scaling null, 40,960 positions
    diag = _context_diag(tmp_path, f"{{hf_config: {config}}}", 50_000)
    assert format_path(diag.path) == "workload.prompt_length.max_tokens"
    assert "the prompt cap alone leaves no room for a response" in diag.message
    assert "RoPE" not in diag.message and not re.search(r"-\d", diag.hint)
    assert "at most 24,576" in diag.hint  # 40,960 - 16,384: the response cap kept


def test_a_context_too_short_for_any_caps_is_reported_at_the_config(tmp_path: Path) -> None:
    """max_position_embeddings 1: the hint asked for caps adding up to at most 1, which no two caps of at least one
    token each do."""
    qwen = json.loads((REPO / "tests" / "data" / "hf_configs" / "qwen3-8b.json").read_text())
    (tmp_path / "one.json").write_text(json.dumps(qwen | {"max_position_embeddings": 1}))
    diag = _context_diag(tmp_path, "{hf_config: one.json}", 2048)
    assert format_path(diag.path) == "model.hf_config"
    assert diag.message.startswith("the model's context of 1 token (max_position_embeddings) holds no prompt")
    assert "max_position_embeddings" in diag.hint


def test_a_response_cap_beyond_the_context_names_rope_scaling_only_when_there_is_some(tmp_path: Path) -> None:
    plain = _context_diag(tmp_path, "{preset: qwen3-8b}", 30_000)
    assert format_path(plain.path) == "workload.response_length.max_tokens"
    assert "(max_position_embeddings)" in plain.message and "at most 10,960" in plain.hint
    config = REPO / "tests" / "data" / "hf_configs" / "qwen3-8b.json"  # a config.json without rope_scaling
    unscaled = _context_diag(tmp_path, f"{{hf_config: {config}}}", 30_000)
    assert unscaled.message == plain.message
    qwen = json.loads((REPO / "tests" / "data" / "hf_configs" / "qwen3-8b.json").read_text())
    (tmp_path / "yarn.json").write_text(json.dumps(qwen | {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}))
    text = BASE.replace("{MODEL}", "{hf_config: yarn.json}").replace("PROMPT_MAX", "2048").replace(
        "max_tokens: 16384", "max_tokens: 130000")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "s.yaml", tmp_path)
    (diag,) = info.value.diagnostics
    assert "context of 131,072 (max_position_embeddings with its RoPE scaling)" in diag.message
    assert "at most 129,024" in diag.hint


# ----- diffs of plans holding absurd numbers ----------------------------------------------------------------
def test_a_diff_of_a_huge_integer_prints_it_short_without_a_percentage() -> None:
    lines = render_diff(plan_diff({"max_version_lag": 2}, {"max_version_lag": 10**400}), "a", "b")
    assert "  ~ max_version_lag: 2 -> 1.00000e+400" in lines
    assert format_value(-(10**40)) == "-1.00000e+40" and format_value(2**64 - 1) == str(2**64 - 1)
    lines = render_diff(plan_diff({"max_version_lag": 10**400}, {"max_version_lag": 2}), "a", "b")
    assert "  ~ max_version_lag: 1.00000e+400 -> 2  (-100.0%)" in lines
    lines = render_diff(plan_diff({"predictions": {"step_time_s": 1e-300}}, {"predictions": {"step_time_s": 1e300}}),
                        "a", "b")
    assert "  ~ predictions.step_time_s: 1e-300 -> 1e+300" in lines  # no "(+inf%)"


def test_dora_diff_of_a_plan_with_a_huge_lag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Diffed, or refused as a bad plan file (exit 2): never an OverflowError (exit 1, "internal error")."""
    plan = json.loads((REPO / "tests" / "golden" / "plans" / "local-tiny.plan.json").read_text())
    (tmp_path / "ok.json").write_text(json.dumps(plan))
    (tmp_path / "k_huge.json").write_text(json.dumps(plan | {"max_version_lag": 10**400}))
    rc = main(["diff", str(tmp_path / "ok.json"), str(tmp_path / "k_huge.json")])
    out, err = capsys.readouterr()
    assert rc in (0, 2) and "internal error" not in err and "Traceback" not in err
    assert rc == 2 or "max_version_lag: 3 -> 1.00000e+400" in out


def test_a_diff_lists_no_unset_field_as_added_or_removed() -> None:
    """`placement: auto` against pins that leave most fields unset (null): only the pinned field is a change."""
    from dora.report import tree_diff

    auto = {"placement": "auto", "name": "x"}
    pinned = {"placement": {"colocated": None, "train": {"accelerators": 24, "tp": None}}, "name": "x"}
    assert tree_diff(auto, pinned) == [("-", "placement", "auto", None),
                                       ("+", "placement.train.accelerators", None, 24)]
    assert tree_diff(pinned, auto) == [("+", "placement", None, "auto"),
                                       ("-", "placement.train.accelerators", 24, None)]
    assert tree_diff({"cost": 3.0}, {"cost": None}) == [("~", "cost", 3.0, None)]
