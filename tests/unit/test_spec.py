"""The spec language on valid input: example specs, JSON Schema, catalogs, hashing, references."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import jsonschema
import pytest
from ruamel.yaml import YAML

from dora.spec import SpecError, load_spec, load_spec_text
from dora.spec.diagnostics import format_path
from dora.spec.models import AcceleratorName, ModelPresetName, Spec
from dora.spec.schema import spec_json_schema
from planner.architecture import MODEL_PRESETS
from planner.hardware import ACCELERATORS

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_specs_load(path: Path) -> None:
    resolved = load_spec(str(path))
    assert resolved.spec.name
    assert resolved.arch.num_layers > 0
    assert resolved.response_lengths.quantile(0.99) >= resolved.response_lengths.quantile(0.5)


def test_examples_cover_the_required_settings() -> None:
    specs = {p.stem: load_spec(str(p)).spec for p in EXAMPLES}
    sizes = sorted(s.total_accelerators for s in specs.values())
    assert {2, 64, 128, 512, 4096, 10240} <= set(sizes)
    dense32 = specs["dense-32b-h800x128"]
    assert dense32.workload.response_length.max_tokens >= 30000 and dense32.staleness.max_version_lag == 3


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_json_schema_validates_examples(path: Path) -> None:
    data = YAML(typ="safe").load(path.read_text())
    jsonschema.validate(data, spec_json_schema())


def test_json_schema_rejects_unknown_key() -> None:
    data = YAML(typ="safe").load((REPO / "specs" / "local-tiny.yaml").read_text())
    data["cluster"]["nodez"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, spec_json_schema())


def test_the_schema_says_what_its_integer_type_lets_through() -> None:
    """JSON Schema's integer accepts 1.0, which dora refuses: the schema cannot say so in a keyword, so it says so in
    its comment."""
    from dora.spec import SpecError

    text = (REPO / "specs" / "local-tiny.yaml").read_text().replace("  nodes: 1\n", "  nodes: 1.0\n")
    jsonschema.validate(YAML(typ="safe").load(text), spec_json_schema())
    with pytest.raises(SpecError, match="expected an integer, got 1.0"):
        load_spec_text(text, "x.yaml", REPO / "specs")
    assert "dora refuses 1.0 or 1e3 there, which this schema's integer type accepts" in spec_json_schema()["$comment"]


def test_schema_cli_prints_json() -> None:
    out = subprocess.run([sys.executable, "-m", "dora.cli", "schema"], capture_output=True, text=True, check=True)
    schema = json.loads(out.stdout)
    assert schema["properties"]["cluster"]["$ref"].endswith("ClusterSpec")
    assert "description" in schema["$defs"]["ClusterSpec"]["properties"]["nodes"]


def test_literals_match_catalogs() -> None:
    assert set(typing.get_args(AcceleratorName)) == set(ACCELERATORS)
    assert set(typing.get_args(ModelPresetName)) == set(MODEL_PRESETS)


def test_every_field_is_documented() -> None:
    def walk(model: type) -> None:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            for arg in typing.get_args(field.annotation) or (field.annotation,):
                if isinstance(arg, type) and hasattr(arg, "model_fields"):
                    walk(arg)

    walk(Spec)


def test_spec_hash_ignores_comments_and_sees_values() -> None:
    text = (REPO / "specs" / "local-tiny.yaml").read_text()
    base = load_spec_text(text, "a.yaml", REPO / "specs").spec_hash
    assert load_spec_text("# a new comment\n" + text, "b.yaml", REPO / "specs").spec_hash == base
    changed = text.replace("steps: 150", "steps: 151")
    assert changed != text
    assert load_spec_text(changed, "a.yaml", REPO / "specs").spec_hash != base


def test_hf_config_gives_the_preset_architecture(tmp_path: Path) -> None:
    configs = REPO / "tests" / "data" / "hf_configs"
    src = configs / "qwen3-8b.json"
    if not src.exists():
        pytest.fail("tests/data/hf_configs/qwen3-8b.json is missing")
    shutil.copy(src, tmp_path / "config.json")
    text = (REPO / "specs" / "dense-8b-h800x64.yaml").read_text().replace("preset: qwen3-8b", "hf_config: config.json")
    from_hf = load_spec_text(text, "x.yaml", tmp_path).arch
    preset = MODEL_PRESETS["qwen3-8b"]
    assert from_hf.total_params == preset.total_params
    assert from_hf.kv_bytes_per_token(2) == preset.kv_bytes_per_token(2)


def test_a_quantized_checkpoint_must_be_planned_as_it_is_served(tmp_path: Path) -> None:
    """A config.json with an fp8 quantization_config is served by vLLM in fp8: planned as bf16 it priced weights
    twice their size; an AWQ or GPTQ one is in no dtype the cost model prices (a fuzzing pass)."""
    config = json.loads((REPO / "tests" / "data" / "hf_configs" / "qwen3-8b.json").read_text())
    text = (REPO / "specs" / "dense-8b-h800x64.yaml").read_text().replace("preset: qwen3-8b", "hf_config: q.json")
    for quant, dtype, says in (({"quant_method": "fp8"}, "bf16", "quantizes the checkpoint to fp8 (quantization_config)"
                                ", so vLLM would serve fp8 weights, but model.dtype is bf16"),
                               ({"quant_method": "awq", "bits": 4}, "fp8", "quantizes the checkpoint ('awq' "
                                "quantization_config)")):
        (tmp_path / "q.json").write_text(json.dumps(config | {"quantization_config": quant}))
        with pytest.raises(SpecError, match=re.escape(says)) as info:
            load_spec_text(text.replace("dtype: bf16", f"dtype: {dtype}"), "x.yaml", tmp_path)
        assert [format_path(d.path) for d in info.value.diagnostics] == ["model.hf_config"]
    (tmp_path / "q.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "fp8"}}))
    resolved = load_spec_text(text.replace("dtype: bf16", "dtype: fp8"), "x.yaml", tmp_path)
    assert resolved.spec.model.dtype == "fp8"


def test_an_hf_model_is_named_by_its_checkpoint_folder_or_its_file(tmp_path: Path) -> None:
    """`hf_config: ../qwen3-8b.json` named the model '..' in every report."""
    config = (REPO / "tests" / "data" / "hf_configs" / "qwen3-8b.json").read_text()
    (tmp_path / "Qwen3-8B").mkdir()
    (tmp_path / "Qwen3-8B" / "config.json").write_text(config)
    (tmp_path / "qwen3-8b.json").write_text(config)
    (tmp_path / "specs").mkdir()
    text = (REPO / "specs" / "dense-8b-h800x64.yaml").read_text()
    for rel, name in (("../Qwen3-8B/config.json", "Qwen3-8B"), ("../qwen3-8b.json", "qwen3-8b")):
        resolved = load_spec_text(text.replace("preset: qwen3-8b", f"hf_config: {rel}"), "x.yaml", tmp_path / "specs")
        assert resolved.arch.name == name


def test_histogram_file_distribution(tmp_path: Path) -> None:
    (tmp_path / "lengths.csv").write_text("length,count\n100,50\n1000,45\n20000,5\n")
    text = (REPO / "specs" / "dense-8b-h800x64.yaml").read_text().replace(
        "response_length: {median_tokens: 1500, p99_tokens: 12000, max_tokens: 16384}",
        "response_length: {histogram_file: lengths.csv, max_tokens: 32768}")
    dist = load_spec_text(text, "x.yaml", tmp_path).response_lengths
    assert dist.quantile(0.25) == 100 and dist.quantile(0.99) == 20000
    # min_tokens bounds a histogram's lengths too (it used to be dropped), and an editor's byte-order mark is no row
    (tmp_path / "lengths.csv").write_text("\ufeff100,50\n1000,45\n20000,5\n", encoding="utf-8")
    floor = load_spec_text(text.replace("max_tokens: 32768}", "max_tokens: 32768, min_tokens: 500}"), "x.yaml",
                           tmp_path).response_lengths
    assert floor.quantile(0.25) == 500 and floor.quantile(0.99) == 20000


def test_the_inputs_a_plan_records_name_what_changed_the_hash(tmp_path: Path) -> None:
    """``ResolvedSpec.inputs`` is what the hash covers: a spec field by its YAML path, the architecture it resolves
    to, and the content of a file the spec reads (which changes the hash with no spec field changing)."""
    from dora.report import inputs_diff

    (tmp_path / "lengths.csv").write_text("length,count\n100,50\n1000,45\n20000,5\n")
    base = (REPO / "specs" / "dense-8b-h800x64.yaml").read_text().replace(
        "response_length: {median_tokens: 1500, p99_tokens: 12000, max_tokens: 16384}",
        "response_length: {histogram_file: lengths.csv, max_tokens: 32768}")
    before = load_spec_text(base, "x.yaml", tmp_path)
    assert set(before.inputs) == {"spec", "arch", "files"}
    assert json.loads(json.dumps(before.inputs)) == before.inputs  # plain JSON, as a plan file reads back
    assert before.inputs["spec"]["workload"]["prompts_per_step"] == before.spec.workload.prompts_per_step

    (tmp_path / "lengths.csv").write_text("length,count\n100,50\n1000,45\n20000,6\n")
    edited = load_spec_text(base, "x.yaml", tmp_path)
    assert edited.spec_hash != before.spec_hash
    assert [c[:2] for c in inputs_diff(before.inputs, edited.inputs)] == [("~", "files.response_histogram")]

    other_model = load_spec_text(base.replace("preset: qwen3-8b", "preset: qwen2.5-7b"), "x.yaml", tmp_path)
    changed = {path for _, path, _, _ in inputs_diff(edited.inputs, other_model.inputs)}
    assert {"model.preset", "arch.name", "arch.num_layers", "arch.qkv_bias"} <= changed
    assert inputs_diff(edited.inputs, load_spec_text(base + "\n# a comment\n", "x.yaml", tmp_path).inputs) == []


def test_validate_cli_accepts_all_examples() -> None:
    proc = subprocess.run([sys.executable, "-m", "dora.cli", "validate", *map(str, EXAMPLES)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok ") == len(EXAMPLES)


def test_version_and_help() -> None:
    from dora import __version__

    out = subprocess.run([sys.executable, "-m", "dora.cli", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"dora {__version__}"
    helptext = subprocess.run([sys.executable, "-m", "dora.cli", "--help"], capture_output=True, text=True).stdout
    assert "examples:" in helptext and "validate" in helptext


@pytest.mark.parametrize("text, accepted", [
    ("length,count\n8,1\n", True),
    ("# lengths\nlength,count\n8,1\n12,3\n", True),
    ("a,b\nc,d\n8,1\n", False),  # one header row, not several
    ("8_0,1\n", False),  # int() reads 80
    ("\u0668,1\n", False),  # an Arabic-Indic eight, which int() reads as 8
    ("8,+1\n", False),
    ("length,count\n8,5.0\n", True),  # pandas writes integer counts so once a column held a NaN
    ("8,5.5\n", False),
    ('"8","5"\n', True),  # csv.QUOTE_ALL: a single quoted row was read as a header, then "no observations"
    ('"length","count"\n"8","5"\n12,3\n', True),
    ('"8",5"\n', False),
])
def test_histogram_rows_are_plain_digits(text: str, accepted: bool) -> None:
    from dora.spec.loader import parse_histogram

    rows, why = parse_histogram(text)
    assert (rows is not None) == accepted, why
    if not accepted:
        assert "line" in why
    elif text.startswith('"'):
        assert rows[0] == (8, 5)


def test_a_json_input_that_repeats_a_key_is_refused() -> None:
    from dora.spec.files import loads_json

    with pytest.raises(ValueError, match="the key 'a' appears twice"):
        loads_json('{"b": {"a": 1, "a": 2}}')
    assert loads_json('{"a": {"a": 1}}') == {"a": {"a": 1}}
    assert loads_json('{"a": 1, "a": 1}') == {"a": 1}  # the same value twice: no reader can disagree


@pytest.mark.parametrize("name, bad", [
    ("qwen 32b \u00e9t\u00e9 \u4e2d\u6587", None),
    ("family \U0001f468\u200d\U0001f469\u200d\U0001f467", None),  # an emoji sequence: zero-width joiners
    ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", None),  # Persian needs the zero-width non-joiner
    ("a\u202eb", "U+202E"),  # a right-to-left override would reorder what a terminal shows
    ("a\u2066b", "U+2066"),
    ("a\x1b[31mb", "U+001B"),
    ("a\tb", "U+0009"),
    ("shaking \U0001fae8", None),  # Unicode 15: unassigned in Python 3.11's database, shown by current terminals
    ("scotland \U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f", None),  # tag characters
    ("icon \ue000", None),  # private use (icon fonts)
    ("a\u2028b", "U+2028"),  # a line separator
    ("a\u200bb", "U+200B"),  # a zero-width space
])
def test_a_job_name_may_hold_any_script_but_no_control_characters(name: str, bad: str | None) -> None:
    from dora.spec.checks import unprintable

    assert unprintable(name) == bad
