"""The compiled simulator (mypyc, ``hatch_build.py``) and its guard (``planner/_native.py``).

The install compiles the simulator's hot path; the Python sources stay the reference. These tests check that both
give the same schedule to the bit, that an edited source is never shadowed by its stale extension, and (where the
test command asks for it, as ``.ci/run`` does) that the install really compiled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from planner import _native

REPO = Path(__file__).resolve().parents[2]

_DIGEST = """
import hashlib, json
from planner import _native
from planner.architecture import get_preset
from planner.hardware import get_accelerator
from planner.policies import PolicyConfig
from planner.sim import simulate
from planner.sim.costmodel import cost_model_timing
from planner.workload import LengthDistribution, Workload
h800 = get_accelerator("h800")
timing = cost_model_timing(get_preset("qwen2.5-32b"), rollout_acc=h800, train_acc=h800, rollout_tp=4,
                           num_rollout_groups=6, train_tp=4, train_pp=2, train_dp=2)
work = Workload(prompt_tokens=512, response_length=LengthDistribution.lognormal(median=800, p99=12000, max_tokens=16000))
out = {"status": _native.STATUS}
for mode, k, coloc in (("sync", 0, True), ("one-step-off", 1, False), ("bounded-async", 2, False),
                       ("streaming", 2, False), ("streaming", 2, True)):
    cfg = PolicyConfig(mode=mode, max_version_lag=k, colocated=coloc, num_rollout_groups=6, slots_per_group=48,
                       prompts_per_step=24, samples_per_prompt=4, total_steps=6,
                       consolidation_batch=16 if mode == "streaming" else None)
    r = simulate(cfg, work, timing, seed=11, record_events=True)
    trace = hashlib.sha256(json.dumps(r.events, sort_keys=True).encode()).hexdigest()
    out[f"{mode}/{coloc}"] = [trace, len(r.events), r.step_time_s.hex(), r.tokens_per_s.hex()]
print(json.dumps(out))
"""


def _run(code: str, *, pure: bool, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("DORA_PURE_PYTHON", None)
    if pure:
        env["DORA_PURE_PYTHON"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=pythonpath or REPO)


def test_compiled_and_python_simulators_write_the_same_schedule():
    """Every mode's whole trace, step time and throughput (as exact hex floats), with the cost model's timing, agree
    between the extensions (when built; otherwise this compares the sources with themselves, and the status says so)
    and the sources."""
    native = json.loads(_run(_DIGEST, pure=False).stdout)
    python = json.loads(_run(_DIGEST, pure=True).stdout)
    assert python["status"] == "python: DORA_PURE_PYTHON=1"
    assert native["status"] == _native.STATUS
    assert all(run[1] > 500 for key, run in python.items() if key != "status")
    assert {k: v for k, v in native.items() if k != "status"} == {k: v for k, v in python.items() if k != "status"}


def test_the_install_compiled_the_simulator_or_says_why_not():
    """Compiled where the install could compile; otherwise the reason must be one a developer chose or can act on:
    DORA_PURE_PYTHON, a source edited since the build, or no C compiler. `.ci/run` sets DORA_EXPECT_NATIVE=1: a fresh
    clone with a compiler must run compiled."""
    import planner.policies.streaming
    import planner.sim.simulator

    status = _native.STATUS
    if os.environ.get("DORA_EXPECT_NATIVE") == "1" or status == "compiled (mypyc)":
        assert status == "compiled (mypyc)"
        assert not planner.sim.simulator.__file__.endswith(".py")
        assert not planner.policies.streaming.__file__.endswith(".py")
        return
    no_compiler = shutil.which(os.environ.get("CC", "cc")) is None
    assert (status == "python: DORA_PURE_PYTHON=1" or " changed since it was compiled" in status
            or (status.startswith("python: not compiled") and no_compiler)), status
    assert planner.sim.simulator.__file__.endswith(".py")


def _fake_build(root: Path) -> None:
    """A planner tree whose 'extensions' are garbage files with a manifest that matches the sources: importing one of
    them would fail, so a test that imports the module proves which file was loaded."""
    shutil.copytree(REPO / "planner", root / "planner", ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.json"),
                    dirs_exist_ok=True)
    suffix = next(s for s in EXTENSION_SUFFIXES if s.endswith(".so"))
    sources = {}
    for rel in _native.NATIVE_SOURCES:
        path = root / rel
        Path(f"{path.with_suffix('')}{suffix}").write_bytes(b"not an extension")
        sources[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    (root / _native.MANIFEST).write_text(json.dumps({"sources": sources}))


def test_the_guard_decides_from_the_manifest(tmp_path, monkeypatch):
    monkeypatch.delenv("DORA_PURE_PYTHON", raising=False)
    shutil.copytree(REPO / "planner", tmp_path / "planner", ignore=shutil.ignore_patterns("*.so", "*.json"))
    assert _native._decide(tmp_path) == (False, "python: not compiled (install with a C compiler, or "
                                                "`python hatch_build.py`)")
    _fake_build(tmp_path)
    assert _native._decide(tmp_path) == (True, "compiled (mypyc)")
    monkeypatch.setenv("DORA_PURE_PYTHON", "1")
    assert _native._decide(tmp_path) == (False, "python: DORA_PURE_PYTHON=1")
    monkeypatch.delenv("DORA_PURE_PYTHON")
    edited = tmp_path / "planner/sim/simulator.py"
    edited.write_text(edited.read_text() + "\n# edited\n")
    assert _native._decide(tmp_path) == (
        False, "python: planner/sim/simulator.py changed since it was compiled (rebuild: `python hatch_build.py`)")
    (tmp_path / _native.MANIFEST).unlink()
    assert _native._decide(tmp_path)[1].startswith("python: compiled modules without a readable")
    _fake_build(tmp_path)
    next((tmp_path / "planner/policies").glob("base.*.so")).unlink()
    assert _native._decide(tmp_path)[1].startswith("python: some compiled modules are missing")


def test_an_edited_source_runs_instead_of_its_stale_extension(tmp_path):
    """The stale 'extensions' are garbage, so the import only succeeds from the sources, all of them (policies
    included, which were not edited), and the run says why with a warning."""
    _fake_build(tmp_path)
    edited = tmp_path / "planner/policies/streaming.py"
    edited.write_text(edited.read_text() + "\nEDITED = True\n")
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import planner.sim.simulator as s, planner.policies.streaming as p, planner.policies.base as b\n"
            "from planner import _native\n"
            "print(_native.STATUS); print(s.__file__); print(b.__file__); print(p.EDITED)")
    done = _run(code, pure=False, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    status, sim_file, base_file, edited_flag = done.stdout.splitlines()
    assert status.startswith("python: planner/policies/streaming.py changed since it was compiled")
    assert sim_file == str(tmp_path / "planner/sim/simulator.py")
    assert base_file == str(tmp_path / "planner/policies/base.py")
    assert edited_flag == "True"
    assert "RuntimeWarning: dora planner python: planner/policies/streaming.py changed" in done.stderr


def test_dora_plan_says_when_the_install_did_not_compile(tmp_path):
    """Without the extensions (no C compiler at install), `dora plan` still plans, and says why it is slower."""
    shutil.copytree(REPO / "planner", tmp_path / "planner", ignore=shutil.ignore_patterns("*.so", "*.json"))
    env = {k: v for k, v in os.environ.items() if k != "DORA_PURE_PYTHON"}
    args = [sys.executable, "-m", "dora.cli", "plan", str(REPO / "specs/local-tiny.yaml"), "--json"]
    pure = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)  # `-m`: cwd first
    assert pure.returncode == 0, pure.stderr
    assert "note: the simulator ran from its Python sources (this install did not compile it" in pure.stderr
    usual = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert usual.returncode == 0, usual.stderr

    def plan(stdout: str) -> dict:
        return {k: v for k, v in json.loads(stdout).items() if k != "spec_file"}  # relative to each run's directory

    assert plan(usual.stdout) == plan(pure.stdout)
    assert ("note: the simulator ran from" in usual.stderr) == _native.STATUS.startswith("python: not compiled")
