"""RuntimeConfig: deterministic JSON, strict parsing with the failing field named, no torch/ray import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_lower_plans import EXAMPLE_SPECS, example_plan, load_example

from dora.lower.runtime import runtime_config
from dora.runtime.config import FORMAT_VERSION, RuntimeConfig, RuntimeConfigError


def _config(stem: str = "dense-8b-h800x64") -> RuntimeConfig:
    resolved = load_example(stem)
    return runtime_config(resolved, example_plan(resolved, stem))


@pytest.mark.parametrize("stem", EXAMPLE_SPECS)
def test_round_trip_is_exact_and_deterministic(stem: str) -> None:
    config = _config(stem)
    text = config.to_json()
    assert RuntimeConfig.from_json(text) == config
    assert RuntimeConfig.from_json(text).to_json() == text
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def test_values_mirror_spec_and_plan() -> None:
    resolved = load_example("local-tiny")
    plan = example_plan(resolved, "local-tiny")
    config = runtime_config(resolved, plan)
    spec = resolved.spec
    assert (config.mode, config.max_version_lag, config.rollout_workers) == (plan.mode, 2, plan.rollout.replicas)
    assert config.versions_per_engine == plan.rollout.versions_per_engine
    assert config.algorithm.learning_rate == spec.algorithm.learning_rate == 1.0e-3
    assert config.task is not None and config.task.warmup_steps == 500
    assert config.response_length.p99_tokens == 96 and config.response_length.kind == "lognormal"
    assert config.model.name == "tiny-local" and config.model.dtype == "fp32" and config.model.checkpoint is None
    assert (config.rollout_engine, config.trainer, config.output_dir) == ("torch", "torch", "runs/local-tiny")
    mla = _config("moe-560b-x4096").model.mla
    assert mla is not None and mla.kv_lora_rank == 512


def test_the_local_runtime_builds_the_model_the_plan_priced() -> None:
    """The plan of specs/local-tiny.yaml prices the ``tiny-local`` preset (a SwiGLU FFN); the torch trainer's
    model was a GELU one (a third fewer FFN weights and FLOPs), so the CPU constants fitted on its runs absorbed
    the difference."""
    from dora.runtime.driver import controller_config

    resolved = load_example("local-tiny")
    config = runtime_config(resolved, example_plan(resolved, "local-tiny"))
    built = controller_config(config).trainer.model
    assert built.mlp == "swiglu"
    assert built.num_params() == resolved.arch.total_params


def _mutated(path: list[str], value) -> str:
    data = json.loads(_config().to_json())
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(data)


@pytest.mark.parametrize(("path", "value", "message"), [
    (["algorithm", "tis_cap"], "2", r"field 'algorithm\.tis_cap': expected a number, got str"),
    (["steps"], True, r"field 'steps': expected an integer, got bool"),
    (["steps"], 1.5, r"field 'steps': expected an integer, got float"),
    (["colocated"], 0, r"field 'colocated': expected true or false, got int"),
    (["mode"], "async", r"field 'mode': must be one of 'sync', .* got 'async'"),
    (["model", "num_layers"], KeyError, r"field 'model\.num_layers': missing"),
    (["model", "mla"], {"kv_lora_rank": 1}, r"field 'model\.mla\.q_lora_rank': missing"),
    (["prompt_length", "median_tokens"], None, None),  # nullable: accepted
    (["task"], None, None),
    (["algorithm", "name"], None, r"field 'algorithm\.name': must be one of 'grpo', 'ppo', got None"),
    (["algorithm"], None, r"field 'algorithm': expected an object, got null"),
    (["format_version"], FORMAT_VERSION + 1, rf"field 'format_version': this dora reads version {FORMAT_VERSION}, got {FORMAT_VERSION + 1}"),
    # values in range: a hand-edited count of 0 once started Ray and died there with a traceback (exit 1, not 2)
    (["steps"], 0, r"field 'steps': must be at least 1, got 0"),
    (["max_num_seqs"], 0, r"field 'max_num_seqs': must be at least 1, got 0"),
    (["samples_per_prompt"], 0, r"field 'samples_per_prompt': must be at least 1, got 0"),
    (["rollout_workers"], 0, r"field 'rollout_workers': must be at least 1, got 0"),
    (["consolidation_batch"], 0, r"field 'consolidation_batch': must be at least 1, got 0"),
    (["consolidation_batch"], None, None),
    (["max_version_lag"], -1, r"field 'max_version_lag': must be at least 0, got -1"),
    (["algorithm", "minibatches_per_step"], 0, r"field 'algorithm\.minibatches_per_step': must be at least 1"),
    (["algorithm", "learning_rate"], 0, r"field 'algorithm\.learning_rate': must be above 0, got 0"),
    (["algorithm", "tis_cap"], float("nan"), r"field 'algorithm\.tis_cap': must be a finite number, got nan"),
    (["algorithm", "temperature"], -0.5, r"field 'algorithm\.temperature': must be at least 0 \(0 samples greedily\)"),
    (["algorithm", "temperature"], 0, None),  # greedy: sampler and trainers take log-probs under softmax(logits)
    (["response_length", "min_tokens"], 10**6, r"field 'response_length\.min_tokens': 1000000 is above "
                                                r"response_length\.max_tokens"),
    (["model", "num_layers"], 0, r"field 'model\.num_layers': must be at least 1, got 0"),
])
def test_from_json_names_the_bad_field(path, value, message) -> None:
    text = _mutated(path, value)
    if message is None:
        RuntimeConfig.from_json(text)
        return
    with pytest.raises(RuntimeConfigError, match=message) as info:
        RuntimeConfig.from_json(text)
    assert info.value.field.startswith(path[0])


def test_unknown_field_and_bad_document_are_refused() -> None:
    data = json.loads(_config().to_json())
    data["algorithm"]["tis_capp"] = 2.0
    with pytest.raises(RuntimeConfigError, match=r"field 'algorithm\.tis_capp': unknown field \(known: .*tis_cap"):
        RuntimeConfig.from_json(json.dumps(data))
    with pytest.raises(RuntimeConfigError, match=r"not JSON"):
        RuntimeConfig.from_json("{")
    with pytest.raises(RuntimeConfigError, match=r"expected an object, got list"):
        RuntimeConfig.from_json("[]")
    with pytest.raises(RuntimeConfigError, match=r"not JSON dora reads: it nests too deeply"):
        RuntimeConfig.from_json("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize(("changes", "message"), [
    ({"steps": 0}, r"field 'steps': must be at least 1, got 0"),
    ({"samples_per_prompt": 65, "max_num_seqs": 64},
     r"its values do not fit together: slots_per_group\(64\) < samples_per_prompt\(65\)"),
])
def test_the_driver_refuses_a_bad_config_with_exit_2_before_ray_starts(tmp_path, monkeypatch, capsys, changes,
                                                                        message) -> None:
    """Out of range (``from_json``) or not fitting together (the scheduling policy's checks, made before Ray
    starts): a message naming the values and exit 2, never a traceback from inside a started run."""
    import re

    from dora.runtime import driver

    data = {**json.loads(_config("local-tiny").to_json()), **changes}
    path = tmp_path / "runtime.json"
    path.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    assert driver.main(["--config", str(path), "--no-live"]) == driver.EXIT_BAD_CONFIG
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert re.search(message, err) and "Traceback" not in err, err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_importing_the_config_pulls_neither_torch_nor_ray() -> None:
    code = ("import sys, dora.runtime.config, dora.lower; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
