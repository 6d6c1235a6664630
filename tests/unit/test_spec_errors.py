"""The malformed-spec corpus: every file in tests/data/bad_specs/ declares the exact diagnostics it must produce.

A header line `# expect: <yaml path> | <message regex>` per expected diagnostic; the set of reported paths must
equal the declared set (nothing missing, nothing extra), and each message must match.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dora.spec import SpecError, load_spec
from dora.spec.diagnostics import format_path

CORPUS = Path(__file__).resolve().parent.parent / "data" / "bad_specs"
CASES = sorted(CORPUS.glob("*.yaml"))


def _expectations(path: Path) -> list[tuple[str, str]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("# expect: "):
            where, _, regex = line[len("# expect: "):].partition(" | ")
            out.append((where.strip(), regex.strip()))
    return out


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_bad_spec_reports_exact_diagnostics(case: Path) -> None:
    expected = _expectations(case)
    assert expected, f"{case.name} declares no expectations"
    with pytest.raises(SpecError) as info:
        load_spec(str(case))
    got = {}
    for d in info.value.diagnostics:
        got.setdefault("" if not d.path else format_path(d.path), []).append(d)
    assert set(got) == {w for w, _ in expected}, "\n" + info.value.render()
    for where, regex in expected:
        assert any(re.search(regex, d.message) for d in got[where]), f"{where}: {regex!r} not in\n{info.value.render()}"
        for d in got[where]:
            assert d.hint, f"{where}: diagnostic has no fix hint"
            if where and case.stem != "alias_bomb":
                assert d.line is not None and d.line > 0, f"{where}: no line number"


def test_line_numbers_point_at_the_field() -> None:
    with pytest.raises(SpecError) as info:
        load_spec(str(CORPUS / "nodes_zero.yaml"))
    (diag,) = info.value.diagnostics
    text = (CORPUS / "nodes_zero.yaml").read_text().splitlines()
    assert text[diag.line - 1].strip() == "nodes: 0"


def test_cli_exit_code_and_no_traceback() -> None:
    bad = [str(CORPUS / "all_at_once.yaml"), str(CORPUS / "alias_bomb.yaml"), str(CORPUS / "not_yaml.yaml")]
    proc = subprocess.run([sys.executable, "-m", "dora.cli", "validate", *bad], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "did you mean 'preset'" in proc.stderr
    assert "to fix:" in proc.stderr


def test_missing_file_is_a_diagnostic() -> None:
    with pytest.raises(SpecError, match="file does not exist"):
        load_spec(str(CORPUS / "no-such-spec.yaml"))


TINY = CORPUS.parent.parent.parent / "specs" / "local-tiny.yaml"


def _dora(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dora.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("written", ["2024-02-30", "2024-13-01", "2024-02-28 25:00:00", "2024-02-28", "0000-01-01"])
def test_a_date_is_read_as_the_text_written(written: str) -> None:
    from dora.spec.loader import load_spec_text

    # ruamel built a date and raised ValueError (day is out of range for month) from every command; no spec field is
    # a date, so valid or not it is the text as written
    text = TINY.read_text().replace("name: local-tiny", f"name: {written}")
    assert load_spec_text(text, "x.yaml", TINY.parent).spec.name == written


def test_validate_reports_every_file_of_a_batch_when_one_holds_a_bad_tag(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("  nodes: 1", '  nodes: !!int "abc"'))
    line = bad.read_text().splitlines().index('  nodes: !!int "abc"') + 1
    proc = _dora("validate", "--json", str(TINY), str(bad))
    assert proc.returncode == 2, proc.stderr
    first, second = json.loads(proc.stdout)
    assert first["valid"] and not second["valid"]
    assert second["problems"] == [{"file": str(bad), "path": "cluster.nodes", "line": line,
                                   "message": '!!int "abc" is not an integer',
                                   "hint": "write a whole number such as 8 (the !!int tag is not needed)"}]
    proc = _dora("validate", str(bad))
    assert proc.returncode == 2 and "internal error" not in proc.stderr and "cluster.nodes (line" in proc.stderr


@pytest.mark.parametrize("text", ["[[1, 2]]: x\n", "? [[1, 2]]\n: x\n", "a:\n  !!pairs [{b: 1}]: x\n", "!!bool maybe\n"])
def test_odd_yaml_structure_is_a_diagnostic(text: str) -> None:
    from dora.spec.yamlio import parse_yaml

    with pytest.raises(SpecError) as info:  # TypeError, AttributeError or KeyError inside ruamel before
        parse_yaml(text, "x.yaml")
    assert all(d.hint for d in info.value.diagnostics)


def test_a_key_its_tag_cannot_build_is_reported_at_the_key() -> None:
    from dora.spec.yamlio import parse_yaml

    doc = parse_yaml('a: 1\n!!int "x": 1\n', "x.yaml")
    assert doc.data == {"a": 1, "x": 1}
    (problem,) = doc.problems
    assert (problem.path, problem.line, problem.message) == (("x",), 2, '!!int "x" is not an integer')


@pytest.mark.parametrize("target", ["/dev/zero", "directory", "fifo"])
def test_a_spec_that_is_not_a_regular_file_is_refused_before_reading(tmp_path: Path, target: str) -> None:
    # /dev/zero was read to a MemoryError (the size limit was checked after reading), a FIFO hung forever
    path = {"/dev/zero": "/dev/zero", "directory": str(tmp_path), "fifo": str(tmp_path / "spec.yaml")}[target]
    if target == "fifo":
        os.mkfifo(path)
    proc = _dora("validate", path, str(TINY), timeout=30)
    assert proc.returncode == 2 and "internal error" not in proc.stderr, proc.stderr
    assert ("is a directory" if target == "directory" else "is not a regular file") in proc.stderr
    assert f"ok {TINY}" in proc.stdout  # and the batch goes on


def test_a_spec_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    from dora.spec.yamlio import MAX_FILE_BYTES

    big = tmp_path / "big.yaml"
    big.write_text(TINY.read_text() + "#" * MAX_FILE_BYTES)
    with pytest.raises(SpecError, match=f"the file is larger than {MAX_FILE_BYTES:,} bytes"):
        load_spec(str(big))


@pytest.mark.parametrize(("content", "message"), [
    ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "it nests too deeply"),
    ('{"rope_theta": ' + "1" * 5000 + "}", "an integer of 5,000 digits"),
    ('{"rope_theta": ' + "1" * 400 + "}", "an integer of 400 digits"),  # float(int) raised OverflowError
])
def test_an_hf_config_python_cannot_read_is_a_diagnostic(tmp_path: Path, content: str, message: str) -> None:
    config = json.loads((CORPUS.parent / "hf_configs" / "qwen3-8b.json").read_text())
    (tmp_path / "config.json").write_text(content.replace("{", "{" + json.dumps(config)[1:-1] + ", ", 1))
    spec = tmp_path / "spec.yaml"
    spec.write_text((CORPUS / "nodes_string.yaml").read_text().replace("preset: qwen3-8b", "hf_config: config.json")
                    .replace('nodes: "two"', "nodes: 2"))
    with pytest.raises(SpecError) as info:
        load_spec(str(spec))
    (diag,) = info.value.diagnostics
    assert diag.path == ("model", "hf_config") and message in diag.message
    assert spec.read_text().splitlines()[diag.line - 1].strip() == "hf_config: config.json"


def test_a_character_yaml_refuses_is_reported_at_its_line() -> None:
    with pytest.raises(SpecError) as info:
        load_spec(str(CORPUS / "control_character.yaml"))
    (diag,) = info.value.diagnostics
    text = (CORPUS / "control_character.yaml").read_text().splitlines()
    assert diag.line is not None and "\x07" in text[diag.line - 1]


@pytest.mark.parametrize(("key", "shown"), [("true: 3", "the key `true` (YAML reads it as a boolean)"),
                                            ("~: 3", "the key `~` (null, or nothing before the colon)"),
                                            ("3: 3", "the key `3` (YAML reads it as a number)"),
                                            ("? [a, b]\n: 3", "a `? [...]` key (a list)")])
@pytest.mark.parametrize("nested", [False, True])
def test_a_key_that_is_not_text_is_named_with_its_line_and_the_valid_keys(key: str, shown: str, nested: bool) -> None:
    """Said `[1] (line N): Keys should be strings` (`true` read as 1), `None`, `('a', 'b')`."""
    from dora.spec.loader import load_spec_text

    lines = TINY.read_text().splitlines()
    at = lines.index("cluster:") + 1 if nested else len(lines)
    lines[at:at] = [("  " if nested else "") + line for line in key.split("\n")]
    with pytest.raises(SpecError) as info:
        load_spec_text("\n".join(lines) + "\n", "x.yaml", TINY.parent)
    (diag,) = info.value.diagnostics
    assert diag.message == f"{shown} is not a field name"
    assert diag.path == (("cluster",) if nested else ())
    assert diag.line == at + 1
    valid = "accelerator, accelerators_per_node, host_memory_gib_per_node, nodes" if nested else "algorithm, cluster, model, name"
    assert diag.hint.startswith(f"valid keys here: {valid}") and "`dora schema`" in diag.hint


@pytest.mark.parametrize(("written", "hint"), [
    ('"2"', "write a whole number without quotes, e.g. 8"),
    ("'0x10'", "write a whole number without quotes, e.g. 8"),
    ("2:0", "write a whole number, e.g. 8"),
    ("2001-12-14", "write a whole number, e.g. 8"),
    ('"two"', "write a whole number, e.g. 8"),
])
def test_without_quotes_is_said_only_when_the_quotes_made_it_text(written: str, hint: str) -> None:
    from dora.spec.loader import load_spec_text

    text = TINY.read_text().replace("  nodes: 1\n", f"  nodes: {written}\n")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    (diag,) = info.value.diagnostics
    assert diag.path == ("cluster", "nodes") and diag.hint == hint


@pytest.mark.parametrize("name", ['"   "', '"\\t"', "'\u00a0'"])
def test_a_blank_name_is_refused_at_its_line(name: str) -> None:
    from dora.spec.loader import load_spec_text

    text = TINY.read_text().replace("name: local-tiny\n", f"name: {name}\n")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    (diag,) = info.value.diagnostics
    assert diag.path == ("name",) and diag.message.startswith("is blank, got ")
    assert text.splitlines()[diag.line - 1].startswith("name: ") and "visible character" in diag.hint


def test_a_duplicate_key_says_which_two_entries_to_choose_from() -> None:
    from dora.spec.loader import load_spec_text

    text = TINY.read_text().replace("  nodes: 1\n", "  nodes: 1\n  nodes: 2\n")
    first = text.splitlines().index("  nodes: 1") + 1
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    (diag,) = info.value.diagnostics
    assert diag.line == first + 1 and 'duplicate key "nodes"' in diag.message
    assert diag.hint == "remove one of the two `nodes:` entries of that mapping"


def _tiny_with(old: str, new: str) -> str:
    text = TINY.read_text()
    assert old in text
    return text.replace(old, new)


def test_a_response_cap_with_no_room_for_the_count_task_s_answer_is_refused_at_its_line() -> None:
    """workload.response_length.max_tokens: 1 passed `dora validate`, then `dora apply` died with an IndexError."""
    from dora.spec.loader import load_spec_text

    old = "response_length: {median_tokens: 8, p99_tokens: 96, max_tokens: 128}"
    text = _tiny_with(old, "response_length: {median_tokens: 1, p99_tokens: 1, max_tokens: 1}")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    (diag,) = info.value.diagnostics
    assert diag.path == ("workload", "response_length", "max_tokens")
    assert "max_tokens (1) leaves no room for an answer of the count task" in diag.message
    assert diag.hint == "set workload.response_length.max_tokens to at least 2"
    assert "response_length:" in text.splitlines()[diag.line - 1]
    load_spec_text(text.replace("max_tokens: 1}", "max_tokens: 2}"), "x.yaml", TINY.parent)  # the least that fits


@pytest.mark.parametrize(("prompt_length", "fields"), [
    ("{median_tokens: 200, p99_tokens: 400, max_tokens: 512}", ["median_tokens", "p99_tokens", "max_tokens"]),
    ("{median_tokens: 4, p99_tokens: 4, max_tokens: 8}", ["max_tokens"]),
    ("{histogram_file: prompts.csv, max_tokens: 4}", ["histogram_file"]),
])
def test_the_count_task_s_prompt_length_must_be_the_four_tokens_it_generates(tmp_path: Path, prompt_length: str,
                                                                           fields: list[str]) -> None:
    """The task's prompts are always [BOS, a, b, SEP]; a spec saying 200 tokens was run with 4-token prompts while
    `dora apply` printed the plan of 200-token ones (28,560 trained tokens/s predicted instead of 8,416)."""
    from dora.spec.loader import load_spec_text

    (tmp_path / "prompts.csv").write_text("4,10\n")
    old = "prompt_length: {median_tokens: 4, p99_tokens: 4, max_tokens: 4}"
    text = _tiny_with(old, f"prompt_length: {prompt_length}")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", tmp_path)
    diags = info.value.diagnostics
    assert [d.path for d in diags] == [("workload", "prompt_length", f) for f in fields]
    for d in diags:
        assert "the count task's prompts are always 4 tokens ([BOS, a, b, SEP])" in d.message
        assert "prompt_length: {median_tokens: 4, p99_tokens: 4, max_tokens: 4}" in d.hint
        assert "prompt_length:" in text.splitlines()[d.line - 1]
    proc = _dora("validate", str(TINY))  # the shipped spec says what the task does
    assert proc.returncode == 0, proc.stderr


def test_an_unknown_key_does_not_hide_the_cross_field_problems() -> None:
    """`runtime.sed` was the only problem reported; the cross-field ones came after it was fixed."""
    from dora.spec.loader import load_spec_text

    text = _tiny_with("  seed: 0\n", "  seed: 0\n  sed: 1\n").replace("  rollout_engine: torch", "  rollout_engine: vllm")
    text = text.replace("  nodes: 1\n", "  nodes: 1000\n")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    got = {format_path(d.path): d for d in info.value.diagnostics}
    assert set(got) == {"runtime.sed", "cluster.nodes", "model.preset", "placement.rollout.versions_per_engine"}
    assert "did you mean 'seed'" in got["runtime.sed"].message
    assert "2,000 cpu cores" in got["cluster.nodes"].message
    assert text.splitlines()[got["runtime.sed"].line - 1] == "  sed: 1"


def test_a_misspelt_key_is_checked_as_the_field_it_is_closest_to() -> None:
    """With the misspelt key left out, its field's default was judged: `rollout_engin: torch` on the CPU spec was
    reported as vllm needing a GPU, with advice to remove the task. Read as `rollout_engine`, the spec has no other
    problem; a misspelt key under `model` no longer hides the checks that need the architecture, and the problems
    of the field it meant are reported at the misspelt key's line."""
    from dora.spec.loader import load_spec_text

    text = _tiny_with("  rollout_engine: torch", "  rollout_engin: torch")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    assert [format_path(d.path) for d in info.value.diagnostics] == ["runtime.rollout_engin"]

    text = _tiny_with("  dtype: fp32", "  dtype: fp32\n  chekpoint: foo").replace("max_version_lag: 3 ",
                                                                                    "max_version_lag: 1 ")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    assert {format_path(d.path) for d in info.value.diagnostics} == {"model.chekpoint",
                                                                     "placement.rollout.versions_per_engine"}

    text = _tiny_with("  dtype: fp32", "  dtyp: bf16")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    got = {format_path(d.path): d for d in info.value.diagnostics}
    assert set(got) == {"model.dtyp", "model.dtype"} and "model.dtype is bf16:" in got["model.dtype"].message
    assert text.splitlines()[got["model.dtype"].line - 1].startswith("  dtyp: bf16")


def test_an_unknown_key_with_a_tag_dora_cannot_read_is_reported_as_both() -> None:
    from dora.spec.loader import load_spec_text

    for written, tag_message in (('  sed: !!int "abc"', '!!int "abc" is not an integer'),
                                 ("  outputdir: !env HOME", "`!env HOME` carries the YAML tag !env")):
        key = written.split(":")[0].strip()
        with pytest.raises(SpecError) as info:
            load_spec_text(_tiny_with("  seed: 0\n", f"  seed: 0\n{written}\n"), "x.yaml", TINY.parent)
        messages = sorted(d.message for d in info.value.diagnostics)
        assert [format_path(d.path) for d in info.value.diagnostics] == [f"runtime.{key}"] * 2
        assert any(m.startswith(tag_message) for m in messages)
        assert any(m.startswith(f"unknown key '{key}' — did you mean") for m in messages)


@pytest.mark.parametrize(("written", "shown"), [
    ("  output_dir: !!env HOME", "`!!env HOME` carries the YAML tag !!env"),
    ("  output_dir: !e!include runs.yaml", "`!e!include runs.yaml` carries the YAML tag !e!include"),
    ("  output_dir: !<tag:example.com,2000:foo> runs", "`!<tag:example.com,2000:foo> runs` carries the YAML tag "
                                                       "!<tag:example.com,2000:foo>"),
    ("  output_dir: !!foo runs", "`!!foo runs` carries the YAML tag !!foo"),
    ("  output_dir: !!binary aGVsbG8=", "`!!binary aGVsbG8=` carries the YAML tag !!binary"),
    ("  output_dir: !!timestamp 2024-01-01", "`!!timestamp 2024-01-01` carries the YAML tag !!timestamp"),
    ("  output_dir: !!python/str runs", "`!!python/str runs` carries the YAML tag !!python/str"),
    ("  output_dir: !!set {a, b}", "this mapping carries the YAML tag !!set"),
])
def test_a_tag_outside_the_core_schema_is_reported_at_its_line(written: str, shown: str) -> None:
    """`!!env HOME` was read as "HOME", and the other tags as their text, silently."""
    from dora.spec.loader import load_spec_text

    text = "%TAG !e! tag:example.com,2000:\n---\n" + _tiny_with("  output_dir: runs/local-tiny", written)
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    (diag,) = info.value.diagnostics
    assert diag.path == ("runtime", "output_dir") and diag.message == f"{shown}, which dora does not read"
    assert text.splitlines()[diag.line - 1] == written


def test_the_core_schema_s_tags_are_read() -> None:
    from dora.spec.loader import load_spec_text

    text = _tiny_with("  nodes: 1\n", "  nodes: !!int 1\n").replace("name: local-tiny", "name: !!str 2024-01-01")
    text = text.replace("  seed: 0", "  seed: !<tag:yaml.org,2002:int> 0")
    text = text.replace("  accelerators_per_node: 2", "  !!str accelerators_per_node: 3")  # was a key named TaggedScalar(...)
    c = load_spec_text(text, "x.yaml", TINY.parent).spec
    assert (c.name, c.cluster.nodes, c.cluster.accelerators_per_node, c.runtime.seed) == ("2024-01-01", 1, 3, 0)


@pytest.mark.parametrize(("written", "hint"), [
    ("!!str 1", "write a whole number without the !!str tag, e.g. 8"),
    ('!!str "1"', "write a whole number without the !!str tag and quotes, e.g. 8"),
])
def test_a_number_the_str_tag_made_text_names_the_tag(written: str, hint: str) -> None:
    """Said "without quotes" of a value that had none."""
    from dora.spec.loader import load_spec_text

    with pytest.raises(SpecError) as info:
        load_spec_text(_tiny_with("  nodes: 1\n", f"  nodes: {written}\n"), "x.yaml", TINY.parent)
    (diag,) = info.value.diagnostics
    assert diag.path == ("cluster", "nodes") and diag.hint == hint


def test_a_mapping_as_a_key_is_described_not_printed_as_python() -> None:
    from dora.spec.loader import load_spec_text

    text = _tiny_with("name: local-tiny\n", "name: local-tiny\n? {a: 1}\n: x\n")
    with pytest.raises(SpecError) as info:  # said: the key ordereddict([('a', 1)]) is not a field name
        load_spec_text(text, "x.yaml", TINY.parent)
    (diag,) = info.value.diagnostics
    assert diag.message == "a `? {...}` key (a mapping) is not a field name"
    assert text.splitlines()[diag.line - 1] == "? {a: 1}"


@pytest.mark.parametrize("merged", ["  <<: {accelerators_per_node: 0}", "  <<: *base"])
def test_a_merged_key_is_reported_at_the_merge_entry(merged: str) -> None:
    """Was reported at the line of `cluster:`, the mapping the key was merged into."""
    from dora.spec.loader import load_spec_text

    text = _tiny_with("  accelerators_per_node: 2\n", merged + "\n")
    text = ("x-base: &base {accelerators_per_node: 0}\n" if "*" in merged else "") + text
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml", TINY.parent)
    diag = next(d for d in info.value.diagnostics if d.path == ("cluster", "accelerators_per_node"))
    assert text.splitlines()[diag.line - 1] == merged


@pytest.mark.parametrize("newline", ["\r", "\r\n", "\u2028", "\x85"])
def test_a_character_yaml_refuses_is_reported_at_its_line_whatever_the_line_breaks(newline: str) -> None:
    """A CR-only file's control character was reported at line 1 (lines were counted by \\n alone)."""
    from dora.spec.yamlio import parse_yaml

    text = TINY.read_text().replace("name: local-tiny", "name: local\x07tiny")
    with pytest.raises(SpecError) as info:
        parse_yaml(text.replace("\n", newline), "x.yaml")
    (diag,) = info.value.diagnostics
    assert "\x07" in text.splitlines()[diag.line - 1]


def test_validate_json_names_the_file_and_the_document_as_the_human_output_does(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [\n")
    missing = tmp_path / "missing.yaml"
    proc = _dora("validate", "--json", str(bad), str(missing))
    assert proc.returncode == 2, proc.stderr
    problems = [p for result in json.loads(proc.stdout) for p in result["problems"]]
    assert [(p["file"], p["path"]) for p in problems] == [(str(bad), "<document>"), (str(missing), "<document>")]
    proc = _dora("validate", str(bad))
    assert "  <document> (line 2): not valid YAML" in proc.stderr


def test_an_empty_spec_path_is_refused_as_empty() -> None:
    """`dora validate ""` read "" as "." and said the file is a directory."""
    proc = _dora("validate", "")
    assert proc.returncode == 2 and "the file name is empty" in proc.stderr and "directory" not in proc.stderr
