"""Strings from the spec (name, checkpoint, address, output dir) can never inject shell, JSON or text lines.

Each hostile spec is lowered and written; then launch.sh is parsed with `bash -n` and really executed with a
stub `ray` first on PATH that records its argv. The hostile values must arrive as single literal arguments, and
none of the commands they contain may have run (each would create a canary file).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_lower_plans import REPO, example_plan

from dora.lower import write_launch_artifacts
from dora.runtime.config import RuntimeConfig
from dora.spec import load_spec_text

# Every payload tries to create the canary file PWNED in the working directory or $HOME.
HOSTILE = [
    "x; rm -rf ~; touch PWNED",
    "$(touch PWNED)",
    "`touch PWNED`",
    "a'b\"c'; touch PWNED; echo '",
    "line one\ntouch PWNED\n# line three",
    "\u00e9t\u00e9 \u4e2d\u6587 \U0001f600 $HOME ${PATH} \\ \\n",
    "--help || touch PWNED && echo",
    "{{ shell }} {% raw %} </script> ]]> key: value\n- item",
]


def _address(value: str) -> str:
    """A cluster address that passes validation and carries ``value`` in its path, its white space written as the
    shell's ``${IFS}`` (validation refuses white space; an injected ``$(touch${IFS}PWNED)`` would still run)."""
    return "http://head:8265/" + re.sub(r"\s", "${IFS}", value)


def _printable(value: str) -> str:
    """``value`` as validation lets it into a job name or a path: control characters refused there (a terminal would
    act on them) become spaces. The shell's metacharacters stay."""
    return re.sub(r"[\x00-\x1f\x7f]", " ", value)


def _name(value: str) -> str:
    return _printable(value)[:128]


def _spec_text(value: str) -> str:
    """A small dense-8b spec (one node, 16 prompts a step: it plans in a fraction of a second) with every free-text
    field set to ``value`` (JSON-quoted, valid YAML), the address to ``_address(value)``."""
    q = json.dumps(_printable(value), ensure_ascii=False)
    return f"""
name: {json.dumps(_name(value), ensure_ascii=False)}
model: {{preset: qwen3-8b, checkpoint: {q}, dtype: bf16}}
cluster: {{accelerator: h800, nodes: 1, accelerators_per_node: 8}}
workload:
  prompts_per_step: 16
  samples_per_prompt: 16
  prompt_length: {{median_tokens: 300, p99_tokens: 1000, max_tokens: 2048}}
  response_length: {{median_tokens: 1500, p99_tokens: 12000, max_tokens: 16384}}
  steps: 200
staleness: {{max_version_lag: 2}}
runtime: {{backend: ray-cluster, address: {json.dumps(_address(value), ensure_ascii=False)}, output_dir: {json.dumps("runs/" + _printable(value), ensure_ascii=False)}}}
"""


STUB_RAY = """#!{python}
import json, os, sys
with open(os.environ["RAY_ARGV_FILE"], "w", encoding="utf-8") as fh:
    json.dump(sys.argv[1:], fh)
"""


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_spec_strings_stay_inert(value: str, tmp_path: Path) -> None:
    value = _printable(value)  # the address turns white space into ${IFS} either way
    resolved = load_spec_text(_spec_text(value), "hostile.yaml", REPO / "specs")
    assert resolved.spec.model.checkpoint == value
    plan_dir, home, work, bin_dir = (tmp_path / d for d in ("plan", "home", "work", "bin"))
    for d in (home, work, bin_dir):
        d.mkdir()
    write_launch_artifacts(resolved, example_plan(resolved, "dense-8b-h800x64"), plan_dir)
    launch = plan_dir / "launch"

    # JSON artifacts parse and carry the value verbatim.
    runtime = RuntimeConfig.from_json((launch / "runtime.json").read_text())
    assert runtime.spec_name == _name(value) and runtime.model.checkpoint == value
    assert json.loads((launch / "vllm/engine_args.json").read_text())["model"] == value
    job = json.loads((launch / "job.json").read_text())
    assert job["metadata"]["dora_spec_name"] == _name(value)
    for path in launch.rglob("*"):
        if path.is_file():
            text = path.read_bytes().decode("utf-8")
            if path.suffix in (".json", ".txt") and path.name != "args.txt":
                text.encode("ascii")  # JSON and notes carry escapes, never raw control or non-ASCII bytes

    # Argument lists split back into the exact values, each one word.
    serve = shlex.split((launch / "vllm/serve.args").read_text())
    assert serve[:3] == ["vllm", "serve", value]
    megatron = shlex.split((launch / "megatron/args.txt").read_text())
    assert megatron[megatron.index("--tokenizer-model") + 1] == value

    # Text lines: a newline in the name cannot forge extra lines in NOTES.txt or launch.sh's comments.
    notes = (launch / "NOTES.txt").read_text().splitlines()
    assert all(not line.startswith(("touch", "- item")) for line in notes)
    script = launch / "launch.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0

    # Run it for real with a recording `ray`.
    stub = bin_dir / "ray"
    stub.write_text(STUB_RAY.format(python=sys.executable))
    stub.chmod(0o755)
    argv_file = tmp_path / "argv.json"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
           "RAY_ARGV_FILE": str(argv_file)}
    result = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    argv = json.loads(argv_file.read_text())
    assert argv[:3] == ["job", "submit", "--address"]
    assert argv[3] == _address(value)  # the spec's address, one literal argument
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    assert runtime_env == job["runtime_env"]
    assert json.loads(argv[argv.index("--metadata-json") + 1]) == job["metadata"]
    assert argv[argv.index("--") + 1:] == ["python", "-m", "dora.runtime.driver", "--config",
                                           "launch/runtime.json"]
    canaries = [p for root in (tmp_path, home, work) for p in root.rglob("PWNED*")]
    assert canaries == [], "a command from the spec ran"


def test_ray_address_environment_overrides_the_spec(tmp_path: Path) -> None:
    resolved = load_spec_text(_spec_text("plain"), "plain.yaml", REPO / "specs")
    write_launch_artifacts(resolved, example_plan(resolved, "dense-8b-h800x64"), tmp_path / "plan")
    stub = tmp_path / "ray"
    stub.write_text(STUB_RAY.format(python=sys.executable))
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "RAY_ARGV_FILE": str(tmp_path / "argv.json"),
           "RAY_ADDRESS": "http://other:8265 $(touch PWNED)"}
    subprocess.run(["bash", str(tmp_path / "plan/launch/launch.sh")], env=env, check=True, timeout=30,
                   cwd=tmp_path)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[3] == "http://other:8265 $(touch PWNED)"
    assert not list(tmp_path.rglob("PWNED"))


@pytest.mark.parametrize(("output_dir", "excludes"), [
    ("runs/local-tiny", ["/runs/local-tiny/"]),
    ("./runs/local-tiny", ["/runs/local-tiny/"]),
    ("runs/x/../local-tiny", ["/runs/local-tiny/"]),
    ("runs/exp[1]*", ["/runs/exp\\[1\\]\\*/"]),
    ("../elsewhere", []),
    ("/abs/runs", []),
])
def test_the_run_outputs_are_left_out_of_the_upload(output_dir: str, excludes: list[str], tmp_path: Path) -> None:
    """Ray matches ``excludes`` as gitignore patterns (its own matcher here): `./runs/x` as written matched nothing
    (every earlier run's checkpoints went up with the job), and `[` or `*` in a name are patterns unless escaped."""
    import types

    from ray._private.runtime_env.packaging import _get_excludes

    from dora.lower.ray import runtime_env

    env = runtime_env(types.SimpleNamespace(output_dir=output_dir))  # type: ignore[arg-type]
    assert env["excludes"] == excludes
    if excludes:
        excluded = _get_excludes(tmp_path, excludes)
        inside = tmp_path / posixpath.normpath(output_dir) / "checkpoint" / "trainer-000001.pt"
        assert excluded(inside) and not excluded(tmp_path / "launch.sh")
