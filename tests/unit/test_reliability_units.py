"""Reliability, pure parts: deadlocking budgets refused before launch (and every accepted tight budget
finishes in the simulator), stale plans refused, resume bookkeeping, and the schema's resume events."""

from __future__ import annotations

import dataclasses
import itertools
import json
import zipfile
from pathlib import Path

import pytest

from dora.apply import ApplyInputError, plan_for_apply
from dora.runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    config_key,
    prepare_resume,
    read_checkpoint,
    write_checkpoint,
)
from dora.runtime.faults import ledger
from dora.runtime.trace import read_jsonl
from planner.policies import MODES, PolicyConfig
from planner.schedule import check_trace
from planner.sim import LinearTiming, simulate
from planner.workload import LengthDistribution, Workload

REPO = Path(__file__).resolve().parents[2]
TAIL = Workload(response_length=LengthDistribution.lognormal(median=20, p99=400, max_tokens=500), prompt_tokens=5)
TIMING = LinearTiming(decode_base_s=0.01, train_base_s=0.2, weight_publish_s=0.05, weight_load_trainer_s=0.1,
                      weight_load_peer_s=0.05, prefill_per_token_s=0.001, kv_migration_s_per_token=1e-5)


# ----------------------------------------------------------------------------- no hang: planner side
@pytest.mark.parametrize(("changes", "match"), [
    ({"slots_per_group": 3, "samples_per_prompt": 4}, r"slots_per_group\(3\) < samples_per_prompt\(4\)"),
    ({"mode": "streaming", "max_version_lag": 0}, "k\\) = 0 is synchronous"),
    ({"mode": "bounded-async", "max_version_lag": 0}, "k\\) = 0 is synchronous"),
    ({"mode": "one-step-off", "max_version_lag": 0}, "needs max_version_lag"),
    ({"prompts_per_step": 0}, "prompts_per_step must be >= 1"),
    ({"max_versions_per_engine": 2}, "not supported"),
], ids=["group-larger-than-engine", "streaming-k0", "bounded-k0", "one-step-off-k0", "no-prompts", "multi-version"])
def test_budgets_that_would_deadlock_are_refused_before_launch(changes, match):
    base = dict(mode="sync", max_version_lag=0, num_rollout_groups=2, slots_per_group=4, prompts_per_step=2,
                samples_per_prompt=4, total_steps=3)
    with pytest.raises(ValueError, match=match):
        PolicyConfig(**{**base, **changes})


@pytest.mark.parametrize("mode", MODES)
def test_every_accepted_tight_budget_runs_to_the_end(mode):
    """The tightest budgets the config accepts (k = minimum, one group per engine, 1..3 engines) never stall."""
    k_min = {"sync": 0, "one-step-off": 1}.get(mode, 1)
    for k, engines, groups_per_engine, prompts in itertools.product((k_min, k_min + 1), (1, 2, 3), (1, 2), (1, 3)):
        config = PolicyConfig(mode=mode, max_version_lag=k, num_rollout_groups=engines,
                              slots_per_group=2 * groups_per_engine, prompts_per_step=prompts, samples_per_prompt=2,
                              total_steps=4, allow_version_mixing=mode == "partial-rollout")
        result = simulate(config, TAIL, TIMING, seed=k + engines)  # raises "simulation stalled" on a deadlock
        assert len(result.steps) == 4, config
        assert check_trace(list(result.events), k=k, allow_version_mixing=True).ok


# ----------------------------------------------------------------------------- stale plan refused
def _saved_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``dora plan spec.yaml --out plan`` in ``tmp_path`` (plans name their spec relative to the cwd)."""
    from dora.plan_cmd import write_plan_dir
    from dora.planning import make_plan
    from dora.spec import load_spec
    from planner.calibration import DEFAULT_CALIBRATION

    monkeypatch.chdir(tmp_path)
    Path("spec.yaml").write_text((REPO / "specs" / "local-tiny.yaml").read_text())
    resolved = load_spec("spec.yaml")
    write_plan_dir(resolved, make_plan(resolved, DEFAULT_CALIBRATION), tmp_path / "plan")
    return tmp_path / "plan" / "plan.json"


def test_a_saved_plan_is_refused_when_its_spec_changed_or_its_format_is_unknown(tmp_path, monkeypatch):
    plan = _saved_plan(tmp_path, monkeypatch)
    plan_for_apply(str(plan), None, None)  # fresh: accepted
    spec = json.loads(plan.read_text())["spec_file"]
    Path(spec).write_text(Path(spec).read_text().replace("steps: 150", "steps: 151"))
    with pytest.raises(ApplyInputError, match=r"saved plan is stale: .* was planned for spec hash \w+, but .*"
                                              r"changed since: workload.steps: 150 -> 151 \(`dora diff .*` lists them all\) — run"):
        plan_for_apply(str(plan), None, None)
    data = json.loads(plan.read_text())
    data["format_version"] = 999
    plan.write_text(json.dumps(data))
    with pytest.raises(ApplyInputError, match="format_version 999"):
        plan_for_apply(str(plan), None, None)


def test_a_saved_plan_edited_beyond_its_spec_is_refused(tmp_path, monkeypatch):
    """The spec hash still matches (only the plan file changed), so the plan's decisions are checked against the
    spec's bounds: a hand-raised k ran, and was audited against the edited k, not the spec's budget."""
    plan = _saved_plan(tmp_path, monkeypatch)
    original = json.loads(plan.read_text())
    for edit, message in (({"max_version_lag": 99}, "max_version_lag 99 is over staleness.max_version_lag 3"),
                          ({"mode": "partial-rollout"}, "mode partial-rollout, but staleness.mode pins streaming; "
                                                        "partial-rollout with version mixing, which"),
                          ({"rollout": original["rollout"] | {"replicas": 50, "accelerators": 50}},
                           "51 accelerators, more than the cluster's 2"),
                          ({"rollout": original["rollout"] | {"max_model_len": 1}},
                           r"rollout.max_model_len 1 is shorter than the spec's longest sequence \(prompt cap \+ "),
                          ({"rollout": original["rollout"] | {"kv_capacity_tokens": 0}},
                           "rollout.kv_capacity_tokens 0 cannot hold one sequence")):
        plan.write_text(json.dumps(original | edit))
        with pytest.raises(ApplyInputError, match=f"saved plan .* breaks its spec .*: {message}.*the plan file was edited"):
            plan_for_apply(str(plan), None, None)


def test_dora_apply_cli_refuses_a_stale_plan_cleanly(tmp_path, monkeypatch, capsys):
    from dora.cli import main

    plan = _saved_plan(tmp_path, monkeypatch)
    spec = json.loads(plan.read_text())["spec_file"]
    Path(spec).write_text(Path(spec).read_text().replace("seed: 0", "seed: 1"))
    assert main(["apply", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "stale" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- resume bookkeeping
def _line(e: dict) -> str:
    return json.dumps(e) + "\n"


def _trainer_state(path: Path) -> None:
    """A stand-in trainer file: a zip archive, as ``torch.save`` writes (the resume checks it is a whole one)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("state/data.pkl", b"state")


def _attempt_one(out: Path) -> None:
    """A run killed during step 2: step 1 (groups 0, 2) checkpointed; groups 1, 3 admitted; step 2's event lost."""
    adm = [{"t": 0.1 * i, "type": "admitted", "traj": f"g{g}/{s}", "version": 0, "rollout_group": 0}
           for i, (g, s) in enumerate(itertools.product(range(4), range(2)))]
    fin = [{"t": 1 + 0.1 * i, "type": "finished", "traj": f"g{g}/{s}", "num_tokens": 3, "spans": [[0, 3]],
            "rollout_group": 0} for i, (g, s) in enumerate(itertools.product((0, 2, 1), range(2)))]
    step1 = {"t": 2.5, "type": "train_step", "step": 1, "start_t": 2.0, "produced_version": 1,
             "consumed": ["g0/0", "g0/1", "g2/0", "g2/1"]}
    out.mkdir(parents=True)
    (out / "trace.jsonl").write_text("".join(_line(e) for e in adm + fin) + '{"t": 2.6, "type": "fini')
    (out / "checkpoint").mkdir()
    _trainer_state(out / "checkpoint" / "trainer-000001.pt")
    write_checkpoint(out, Checkpoint(step=1, consumed_groups=(0, 2), trainer_state="trainer-000001.pt",
                                     step_event=step1, config_key=config_key({"mode": "sync"})))
    (out / "metrics.jsonl").write_text(_line({"step": 1}) + _line({"step": 2}))


def test_resume_repairs_the_trace_restores_the_lost_step_and_regenerates_untrained_groups(tmp_path):
    out = tmp_path / "run"
    _attempt_one(out)
    point = prepare_resume(out, {"mode": "sync", "steps": 9, "output_dir": "elsewhere"})  # steps may change
    assert point is not None and point.step == 1 and point.regenerate == (1, 3) and point.next_group == 4
    events = read_jsonl(out / "trace.jsonl")
    assert events[-5]["type"] == "train_step" and events[-5]["step"] == 1  # written from the checkpoint
    # then what the killed attempt's end would have written: its untrained groups, finished (g1) or not (g3)
    assert [(e["type"], e["traj"], e["finished"]) for e in events[-4:]] == [
        ("unfinished_at_end", "g1/0", True), ("unfinished_at_end", "g1/1", True),
        ("unfinished_at_end", "g3/0", False), ("unfinished_at_end", "g3/1", False)]
    assert point.clock_s > max(e["t"] for e in events)
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]
    # What the resumed attempt writes (the controller's protocol), then the audit of the combined trace.
    t = point.clock_s
    more = [{"t": t, "type": "resumed", "step": 1}]
    for g in (1, 3):
        for s in range(2):
            more += [{"t": t, "type": "regenerated", "traj": f"g{g}/{s}", "version": 1},
                     {"t": t, "type": "admitted", "traj": f"g{g}/{s}", "version": 1, "rollout_group": 0},
                     {"t": t + 1, "type": "finished", "traj": f"g{g}/{s}", "num_tokens": 2, "spans": [[1, 2]],
                      "rollout_group": 0}]
    more.append({"t": t + 3, "type": "train_step", "step": 2, "start_t": t + 2, "produced_version": 2,
                 "consumed": ["g1/0", "g1/1", "g3/0", "g3/1"]})
    with (out / "trace.jsonl").open("a") as f:
        f.write("".join(_line(e) for e in more))
    combined = read_jsonl(out / "trace.jsonl")
    assert check_trace(combined, k=1, allow_version_mixing=False).ok
    assert ledger(out / "trace.jsonl") == {"admitted": 8, "trained": 8, "lost": 0, "duplicated": 0,
                                           "regenerated": 4}
    # Without the regenerated events the same trace fails: admitted twice, and v1 tokens on a v0 admission.
    plain = [e for e in combined if e["type"] != "regenerated"]
    found = {v.constraint for v in check_trace(plain, k=1, allow_version_mixing=False).violations}
    assert found == {"integrity", "consistency"}


def test_resume_restores_the_metrics_row_a_kill_after_the_commit_lost(tmp_path):
    """Killed between checkpoint.json and the step's metrics row: the row comes back from the checkpoint, so a
    resumed run's summary covers every trained step (it once showed 7 of 8 reward points)."""
    out = tmp_path / "run"
    _attempt_one(out)
    step1 = read_checkpoint(out)
    row = {"step": 1, "reward_mean": 0.25}
    write_checkpoint(out, dataclasses.replace(step1, metrics_row=row))
    (out / "metrics.jsonl").write_text("")
    prepare_resume(out, {"mode": "sync", "steps": 9, "output_dir": "elsewhere"})
    assert read_jsonl(out / "metrics.jsonl") == [row]
    prepare_resume(out, {"mode": "sync", "steps": 9, "output_dir": "elsewhere"})  # a row already there stays one
    assert read_jsonl(out / "metrics.jsonl") == [row]


def test_read_jsonl_skips_only_a_cut_last_line_and_names_any_other_line_that_is_not_json(tmp_path):
    """It stopped at the first bad line: a resume then rewrote metrics.jsonl without every later row."""
    from dora.runtime.trace import JsonlError

    path = tmp_path / "metrics.jsonl"
    path.write_text(_line({"step": 1}) + _line({"step": 2}) + '{"step": 3, "rew')  # a writer killed mid-write
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text(_line({"step": 1}) + '{"step": 2, "rew\n' + _line({"step": 3}))
    with pytest.raises(JsonlError, match=r"metrics.jsonl, line 2: not a JSON record"):
        read_jsonl(path)
    path.write_bytes(b'{"step": 1}\n{"step": \xff}\n')
    with pytest.raises(JsonlError, match=r"line 2: not a JSON record \(not UTF-8"):
        read_jsonl(path)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_resume_refuses_a_metrics_file_with_a_bad_line_and_rewrites_nothing(tmp_path):
    """One cut line in the middle of metrics.jsonl: the resume kept the rows before it and deleted every later one."""
    out = tmp_path / "run"
    _attempt_one(out)
    (out / "metrics.jsonl").write_text(_line({"step": 1})[:5] + "\n" + _line({"step": 2}))
    before = _files(out)
    with pytest.raises(CheckpointError, match=r"metrics.jsonl, line 1: not a JSON record \(.*\): the run cannot be "
                                              r"resumed from it; restore metrics.jsonl as the run wrote it, or delete "
                                              r".*checkpoint to start over"):
        prepare_resume(out, {"mode": "sync", "steps": 9})
    assert _files(out) == before


@pytest.mark.parametrize(("damage", "match"), [
    ("cut-line", r"trace.jsonl, line 3: not a JSON record .*: the run cannot be resumed from it; restore trace.jsonl "
                 r"as the run wrote it, or delete .*checkpoint to start over"),
    ("no-step-1", r"trace.jsonl does not hold this checkpoint's steps: no train_step event for step 1 of the 2 it "
                  r"holds: .*; restore trace.jsonl as the run wrote it, or delete .*checkpoint to start over"),
    ("deleted", r"trace.jsonl is missing, and the checkpoint holds 2 steps: the data groups admitted before the stop"),
])
def test_a_resume_refuses_a_trace_that_lacks_the_checkpoints_steps(tmp_path, damage, match):
    """A damaged or deleted trace was resumed anyway: the groups admitted before the kill, which the trace names, were
    not regenerated, and the run failed its audit with hundreds of violations."""
    out = tmp_path / "run"
    _finished_run_killed_before_its_end(out, {"mode": "sync"})
    trace = out / "trace.jsonl"
    lines = trace.read_text().splitlines(keepends=True)
    if damage == "cut-line":
        lines[2] = lines[2][:20] + "\n"
    elif damage == "no-step-1":
        lines = [line for line in lines if '"step": 1,' not in line]
    trace.write_text("".join(lines))
    if damage == "deleted":
        trace.unlink()
    before = _files(out)
    with pytest.raises(CheckpointError, match=match):
        prepare_resume(out, {"mode": "sync", "steps": 4})
    assert _files(out) == before


def test_a_resume_refuses_a_cut_trainer_file_before_writing_anything(tmp_path):
    """A cut trainer-<s>.pt failed in the trainer's torch.load, after the trace was written to, as an internal error."""
    out = tmp_path / "run"
    _finished_run_killed_before_its_end(out, {"mode": "sync"})
    trainer = out / "checkpoint" / "trainer-000002.pt"
    trainer.write_bytes(trainer.read_bytes()[:40])
    before = _files(out)
    with pytest.raises(CheckpointError, match=r"trainer-000002.pt: unreadable trainer state \(File is not a zip "
                                              r"file\); delete .*checkpoint to start over"):
        prepare_resume(out, {"mode": "sync", "steps": 4})
    assert _files(out) == before


def _finished_run_killed_before_its_end(out: Path, config: dict, *, closed: int = 0) -> None:
    """Two steps trained and committed (groups 0-3), then SIGKILL before ``Controller._close``: groups 4 (finished)
    and 5 (one sample finished) admitted, never trained, and only the first ``closed`` of their
    ``unfinished_at_end`` events written."""
    def traj(g: int, s: int) -> str:
        return f"g{g}/{s}"

    events: list[dict] = [{"t": 0.1 * g, "type": "admitted", "traj": traj(g, s), "version": 0, "rollout_group": 0}
                          for g in range(6) for s in range(2)]
    events += [{"t": 1 + 0.1 * g, "type": "finished", "traj": traj(g, s), "num_tokens": 3, "spans": [[0, 3]],
                "rollout_group": 0} for g in range(5) for s in range(2)]
    events.append({"t": 1.9, "type": "finished", "traj": "g5/0", "num_tokens": 2, "spans": [[0, 2]],
                   "rollout_group": 0})
    for step in (1, 2):
        events.append({"t": 2.0 + step, "type": "train_step", "step": step, "start_t": 1.95 + step,
                       "produced_version": step,
                       "consumed": [traj(g, s) for g in (2 * step - 2, 2 * step - 1) for s in range(2)]})
    leftovers = [("g4/0", True), ("g4/1", True), ("g5/0", True), ("g5/1", False)]
    events += [{"t": 4.5, "type": "unfinished_at_end", "traj": t, "finished": f} for t, f in leftovers[:closed]]
    out.mkdir(parents=True)
    (out / "trace.jsonl").write_text("".join(_line(e) for e in events))
    (out / "checkpoint").mkdir()
    _trainer_state(out / "checkpoint" / "trainer-000002.pt")
    write_checkpoint(out, Checkpoint(step=2, consumed_groups=(0, 1, 2, 3), trainer_state="trainer-000002.pt",
                                     step_event=events[-1 - closed], config_key=config_key(config)))


@pytest.mark.parametrize("closed", [0, 1, 4])
def test_a_kill_after_the_last_commit_leaves_no_trajectory_unaccounted(tmp_path, closed):
    """Killed between the last step's commit and the end's ``unfinished_at_end`` events (or halfway through
    writing them): the run once failed its audit on every re-run. Re-running writes the missing events, each with
    whether it had finished, once."""
    from dora.runtime.checkpoint import unaccounted

    out = tmp_path / "run"
    _finished_run_killed_before_its_end(out, {"mode": "sync"}, closed=closed)
    before = read_jsonl(out / "trace.jsonl")
    assert not check_trace(before, k=1, allow_version_mixing=False).ok or closed == 4
    for _ in range(2):  # a second re-run finds nothing left to write
        point = prepare_resume(out, {"mode": "sync", "steps": 2})
        assert point is not None and point.step == 2 and point.regenerate == (4, 5) and point.next_group == 6
        events = read_jsonl(out / "trace.jsonl")
        added = [(e["traj"], e["finished"]) for e in events[len(before):]]
        assert added == [("g4/0", True), ("g4/1", True), ("g5/0", True), ("g5/1", False)][closed:]
        end = max(e["t"] for e in before)  # at the seam: the trace stays in time order
        assert all(e["type"] == "unfinished_at_end" and e["t"] == end for e in events[len(before):])
        assert unaccounted(events) == []
        report = check_trace(events, k=1, allow_version_mixing=False)
        assert report.ok, report.violations
        assert len(report.unfinished_at_end) == 4
        assert ledger(out / "trace.jsonl")["lost"] == 0


def test_re_running_a_run_killed_after_its_last_commit_audits_it_clean_without_ray(tmp_path):
    """The driver's path for a run that already holds every step: audited, every leftover accounted, the summary's
    unfinished count taken from the trace (the killed run wrote no summary)."""
    from rich.console import Console
    from test_runtime_config import _config

    from dora.runtime.driver import run_job

    rc = dataclasses.replace(_config("local-tiny"), steps=2, output_dir="run")
    _finished_run_killed_before_its_end(tmp_path / "run", json.loads(rc.to_json()))
    console = Console(record=True, width=200, force_terminal=False)
    result = run_job(rc, console=console, live=False, base_dir=tmp_path)
    assert result.ok, result.audit["violations"]
    assert "already holds 2 trained steps" in console.export_text()
    assert result.audit["unfinished_at_end"] == result.summary["unfinished_at_end"] == 4
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["audit"]["ok"]


def test_resume_refuses_another_jobs_checkpoint(tmp_path):
    out = tmp_path / "run"
    _attempt_one(out)
    with pytest.raises(CheckpointError, match="different job configuration"):
        prepare_resume(out, {"mode": "streaming", "steps": 9})
    assert prepare_resume(tmp_path / "fresh", {"mode": "sync"}) is None


def test_a_resume_may_change_the_step_count_and_the_spec_hash_and_a_refusal_names_each_changed_field(tmp_path):
    from dora.runtime.checkpoint import check_resumable

    ran = {"format_version": 3, "mode": "sync", "steps": 4, "spec_hash": "a" * 64,
           "model": {"hidden_size": 64, "rope_theta": 10000.0}, "seed": 0}
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    _trainer_state(out / "checkpoint" / "trainer-000001.pt")
    step1 = {"t": 1.0, "type": "train_step", "step": 1, "start_t": 0.5, "produced_version": 1, "consumed": []}
    write_checkpoint(out, Checkpoint(step=1, consumed_groups=(0,), trainer_state="trainer-000001.pt",
                                     step_event=step1, config_key=config_key(ran)))
    (out / "runtime.json").write_text(json.dumps(ran))
    # more steps, edited in the spec (so its hash changes too) or passed as --steps: the same job
    assert check_resumable(out, {**ran, "steps": 9, "spec_hash": "b" * 64}).step == 1
    changed = {**ran, "mode": "streaming", "seed": 1, "model": {"hidden_size": 64}}
    with pytest.raises(CheckpointError) as err:
        check_resumable(out, changed)
    assert ("different job configuration (mode: 'sync' -> 'streaming', model.rope_theta: 10000 -> (none), "
            "seed: 0 -> 1); resume it with the spec and overrides it ran with (add --steps N") in str(err.value)
    with pytest.raises(CheckpointError, match=r"\(written by another dora release \(runtime format 3, this one writes "
                                              r"4\); model.hidden_size: 64 -> 128\)"):
        check_resumable(out, {**ran, "format_version": 4, "model": {"hidden_size": 128, "rope_theta": 10000.0}})


def test_regenerated_supersedes_an_earlier_attempts_unfinished_at_end():
    base = [{"t": 0, "type": "admitted", "traj": "g0/0", "version": 0, "rollout_group": 0},
            {"t": 1, "type": "unfinished_at_end", "traj": "g0/0", "finished": False},
            {"t": 2, "type": "resumed", "step": 0},
            {"t": 2, "type": "regenerated", "traj": "g0/0", "version": 0},
            {"t": 2, "type": "admitted", "traj": "g0/0", "version": 0, "rollout_group": 1},
            {"t": 3, "type": "worker_restarted", "rollout_group": 1, "version": 0},
            {"t": 4, "type": "finished", "traj": "g0/0", "num_tokens": 1, "spans": [[0, 1]], "rollout_group": 1},
            {"t": 6, "type": "train_step", "step": 1, "start_t": 5, "consumed": ["g0/0"], "produced_version": 1}]
    assert check_trace(base, k=0, allow_version_mixing=False).ok
    twice = base[:2] + base[4:]  # re-admitted and trained after being declared unfinished, no regeneration
    assert not check_trace(twice, k=0, allow_version_mixing=False).ok


def test_dora_apply_refuses_gpu_engines_before_contacting_the_cluster(capsys, monkeypatch):
    """Runs on GPUs are not implemented yet: say so, naming the spec's line, exit 2, submit nothing (the address is
    unreachable), and before planning (seconds on a GPU spec, for nothing); a saved plan of one is refused too."""
    import dora.planning
    from dora.cli import main
    from dora.runtime.config import RuntimeConfig
    from dora.runtime.driver import RuntimeConfigError, run_job

    def no_planning(*args, **kwargs):
        raise AssertionError("planned a spec it refuses")

    with monkeypatch.context() as m:
        m.setattr(dora.planning, "make_plan", no_planning)
        assert main(["apply", str(REPO / "specs" / "dense-32b-h800x128.yaml"), "--address", "http://127.0.0.1:9"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "runs on GPUs are not implemented yet" in err and "Traceback" not in err
    assert "cluster.accelerator 'h800' (" in err and "dense-32b-h800x128.yaml, line 10)" in err
    assert main(["apply", str(REPO / "tests" / "golden" / "plans" / "dense-32b-h800x128.plan.json")]) == 2
    err = capsys.readouterr().err
    assert "runs on GPUs are not implemented yet" in err and "cluster.accelerator 'h800'" in err
    # the driver a submitted job would run stops the same way, before Ray starts
    golden = REPO / "tests" / "golden" / "launch" / "dense-32b-h800x128" / "launch" / "runtime.json"
    with pytest.raises(RuntimeConfigError, match="not implemented yet"):
        run_job(RuntimeConfig.from_json(golden.read_text()))


def test_dora_apply_refuses_more_rollout_workers_than_the_cluster_has(capsys):
    # 1000 torch engines on a 2-core spec used to start 1000 Ray actors and hang; now it is refused before Ray starts.
    from dora.cli import main

    assert main(["apply", str(REPO / "specs" / "local-tiny.yaml"), "--rollout-workers", "1000", "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "--rollout-workers 1000 needs 1000 accelerators" in err and "so at most 2" in err
    assert "Traceback" not in err


def test_dora_apply_names_an_output_dir_it_cannot_write(tmp_path, capsys):
    from dora.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(["apply", str(REPO / "specs" / "local-tiny.yaml"), "--output-dir", str(blocker / "run"), "--no-live"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"cannot write the run's outputs to {blocker / 'run'}/" in err and "--output-dir" in err
    assert "Traceback" not in err and "internal error" not in err


def test_a_commit_removes_older_trainer_files_and_saves_a_kill_cut_short(tmp_path):
    """A kill during a trainer save leaves its temporary file (a name of its own per save); the next commit, which
    comes between two saves, removes it with the older trainer files."""
    out = tmp_path / "run"
    directory = out / "checkpoint"
    directory.mkdir(parents=True)
    for name in ("trainer-000001.pt", "trainer-000002.pt", ".trainer-000002.pt.k3j9x1.tmp", "notes.txt"):
        (directory / name).write_bytes(b"x")
    write_checkpoint(out, Checkpoint(step=2, consumed_groups=(0, 1), trainer_state="trainer-000002.pt",
                                     step_event=None, config_key="k"))
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint.json", "notes.txt", "trainer-000002.pt"]


def _metrics_row(step: int, reward: float) -> dict:
    return {"step": step, "reward_mean": reward, "num_sequences": 4, "response_tokens": 12, "mean_staleness": 0.5,
            "max_staleness": 1, "is_weight_mean": 1.0, "is_weight_max": 1.25, "is_weight_clip_frac": 0.0}


def test_a_run_audited_again_reports_its_own_steps_not_an_earlier_attempts_summary(tmp_path):
    """run --steps 1, then a longer attempt interrupted after a later step (it writes no summary), then the same
    command audits the directory again: it printed and wrote the first attempt's summary ("1/1 steps", its reward
    curve and its speed) over an audit of every step. Now the steps are the checkpoint's, the training figures every
    step's metrics row, and no attempt's speed is shown as the run's."""
    from rich.console import Console
    from test_runtime_config import _config

    from dora.runtime.display import render_summary
    from dora.runtime.driver import run_job

    rc = dataclasses.replace(_config("local-tiny"), steps=2, output_dir="run")
    out = tmp_path / "run"
    _finished_run_killed_before_its_end(out, json.loads(rc.to_json()))
    (out / "metrics.jsonl").write_text(_line(_metrics_row(1, 0.25)) + _line(_metrics_row(2, 0.75)))
    earlier = {"mode": rc.mode, "steps": 1, "total_steps": 1, "wall_s": 0.4, "steady_trained_tokens_per_s": 4441.0,
               "steady_generated_tokens_per_s": 19924.0, "steady_step_time_s": 0.34, "steady_rollout_share": 1.0,
               "steady_rollout_occupancy": 0.91, "mean_staleness": 0.0, "max_staleness": 0, "max_live_versions": 1,
               "mean_trained_response_tokens": 7.8, "reward_first": 0.0, "reward_last": 0.0, "reward_curve": [0.0],
               "is_weight_mean": 0.995, "is_weight_max": 1.0, "is_weight_clip_frac": 0.0, "warmup_s": 9.0,
               "resumed_from_step": None, "migrated_trajectories": 0, "weight_loads": 0, "unfinished_at_end": 7,
               "machine": {"cpu_model": "the machine that ran step 1", "cpu_count": 64}}
    (out / "summary.json").write_text(json.dumps({"summary": earlier, "audit": {"ok": True}}))
    console = Console(record=True, width=200, force_terminal=False)
    result = run_job(rc, console=console, live=False, base_dir=tmp_path)
    assert result.ok, result.audit["violations"]
    s = result.summary
    assert (s["steps"], s["total_steps"]) == (2, 2) and s["audited_again"]
    assert s["reward_curve"] == [0.25, 0.75] and s["reward_last"] == 0.75 and s["max_staleness"] == 1
    assert not any(key.startswith(("steady_", "first_step_")) for key in s)  # nothing ran: no speed of its own
    assert "wall_s" not in s and "warmup_s" not in s
    # ... but the only record of how fast the earlier attempt went is kept, apart (a second review: it was lost)
    assert s["earlier_attempt"] == {"steps": 1, "wall_s": 0.4, "warmup_s": 9.0, "resumed_from_step": None,
                                    **{k: v for k, v in earlier.items() if k.startswith("steady_")}}
    assert s["unfinished_at_end"] == result.audit["unfinished_at_end"] == 4  # from the trace, not the old summary
    assert s["machine"] == earlier["machine"]  # where the steps it holds ran (`dora calibrate --from-run` names it)
    assert json.loads((out / "summary.json").read_text())["summary"] == s
    console.print(render_summary(s, result.audit))
    text = console.export_text()
    assert "2/2 steps, audited again" in text and "1/1" not in text
    assert "0.250 -> 0.750" in text and "tokens/s" not in text and "4441" not in text


class _Stop(Exception):
    pass


def test_a_local_run_asks_ray_for_an_instance_of_its_own_beside_a_running_cluster(tmp_path, monkeypatch):
    """With a `ray start` cluster on the machine, ray.init(num_cpus=...) without an address connects to it and Ray
    refuses the sizing ("internal error: ValueError"). address="local" always starts an instance of its own (checked
    for real with a `ray start` head running; this stands in for Ray's rule)."""
    import ray
    from test_runtime_config import _config

    from dora.runtime.driver import run_job

    def init(address=None, num_cpus=None, **_):
        if address != "local" and num_cpus is not None:  # what Ray does when it finds the running cluster
            raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")
        assert num_cpus is not None and num_cpus >= 1
        raise _Stop

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    rc = dataclasses.replace(_config("local-tiny"), steps=1, output_dir="run")
    with pytest.raises(_Stop):
        run_job(rc, live=False, base_dir=tmp_path)


def _joined_cluster(monkeypatch, free: dict | list[dict], total: dict) -> list:
    """Ray as a job's driver finds it: initialised (by the job), with ``free`` (each node's, or one node's) of
    ``total`` resources. Returns the list the Controller's construction is recorded in (it must not be reached)."""
    import ray
    import ray._private.state

    from dora.runtime import controller

    nodes = free if isinstance(free, list) else [free]
    built: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray._private.state, "available_resources_per_node",
                        lambda: {f"node{i}": dict(node) for i, node in enumerate(nodes)})
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(total))

    def no_controller(*args, **kwargs):
        built.append(args)
        raise AssertionError("actors were created on a cluster that cannot hold them")

    monkeypatch.setattr(controller, "Controller", no_controller)
    return built


def test_a_cluster_with_no_free_cpu_stops_the_run_before_its_actors_wait_forever(tmp_path, monkeypatch):
    """A head with --num-cpus 1: the job's driver holds the CPU, Ray's available resources have no "CPU" key, and
    the driver took the submitting machine's core count: actors asking for CPUs that do not exist stayed pending
    with no end and no message. A missing key is 0, and the run stops with the figures."""
    from test_runtime_config import _config

    from dora.runtime import driver
    from dora.runtime.driver import JobStopped, run_job

    built = _joined_cluster(monkeypatch, free={"memory": 1e9}, total={"CPU": 1.0})
    monkeypatch.setattr(driver, "FREE_CPU_SETTLE_S", 0.5)  # none comes free: the wait for it is cut short here
    rc = dataclasses.replace(_config("local-tiny"), steps=1, output_dir="run", rollout_workers=1)
    with pytest.raises(JobStopped) as stopped:
        run_job(rc, live=False, base_dir=tmp_path)
    message = str(stopped.value)
    assert ("not enough free CPU on the Ray cluster: the trainer and 1 rollout worker need at least 1 CPU between "
            "them, and the cluster has 0 free of 1") in message
    assert "ray start --num-cpus N" in message and "--rollout-workers" in message
    assert not built


def test_actor_reservations_are_shares_of_what_is_free_and_an_unplaceable_one_stops_the_run(tmp_path, monkeypatch):
    """On a cluster the reservations never add up to more than is free; when Ray cannot place them all (free CPUs
    split over nodes, or taken meanwhile) the run stops after PLACEMENT_TIMEOUT_S instead of pending forever."""
    import importlib

    from rich.console import Console
    from test_runtime_config import _config

    from dora.runtime import driver

    rc = dataclasses.replace(_config("local-tiny"), steps=1, output_dir="run", rollout_workers=2)
    config = driver.controller_config(rc, base_dir=tmp_path, cpus=1.5)
    assert config.trainer_num_cpus == config.worker_num_cpus == 0.5  # 1.5 free over 3 actors, rounded down
    asked: list = []

    class Group:
        def wait(self, timeout_seconds):
            return False

    def placement_group(bundles, strategy):
        asked.append(bundles)
        return Group()

    removed: list = []
    pg = importlib.import_module("ray.util.placement_group")  # the module (ray.util's name is the function)
    monkeypatch.setattr(pg, "placement_group", placement_group)
    monkeypatch.setattr(pg, "remove_placement_group", removed.append)
    built = _joined_cluster(monkeypatch, free={"CPU": 1.5}, total={"CPU": 4.0})
    monkeypatch.setattr(driver, "PLACEMENT_TIMEOUT_S", 3.0)
    console = Console(record=True, width=200, force_terminal=False)
    with pytest.raises(driver.JobStopped) as stopped:
        driver.run_job(rc, console=console, live=False, base_dir=tmp_path)
    assert asked == [[{"CPU": 0.5}] * 3] and len(removed) == 1 and not built
    assert ("could not place the trainer and 2 rollout workers in 3 s: they reserve 0.5 CPU (trainer) + 2 x 0.5 "
            "(rollout workers) = 1.5, and the cluster has 1.5 CPU free of 4") in str(stopped.value)
    assert "waiting up to 3 s for the Ray cluster to place the trainer and 2 rollout workers" in console.export_text()


@pytest.mark.parametrize(("nodes", "actors", "share"), [
    pytest.param([2.0], 2, 1.0, id="this-machine-1-worker"),
    pytest.param([2.0], 3, 0.66, id="this-machine-2-workers-as-before"),
    pytest.param([1.5], 3, 0.5, id="one-node-rounded-down"),
    pytest.param([1.0, 2.0], 2, 1.0, id="1+2-not-1.5-each"),
    pytest.param([3.0, 3.0], 3, 1.5, id="3+3-not-2-each"),
    pytest.param([2.0, 2.0, 2.0, 2.0], 3, 2.0, id="4x2-not-2.66-each"),
    pytest.param([1.0, 4.0, 4.0], 4, 2.0, id="small-node-left-idle"),
    pytest.param([0.29, 0.0], 1, 0.29, id="hundredths-exact"),
    pytest.param([0.01, 0.01], 3, 0.0, id="too-little-anywhere"),
    pytest.param([], 2, 0.0, id="no-node"),
])
def test_an_actor_share_is_the_largest_equal_reservation_that_fits_on_the_nodes(nodes, actors, share):
    """The shares were the sum of every node's free CPUs split equally, which Ray cannot place when each reservation
    must fit on one node (1 + 2 free: 1.5 each, and neither node holds two)."""
    from dora.runtime.driver import actor_share

    got = actor_share(nodes, actors)
    assert got == share
    cents = [round(f * 100) for f in nodes]
    if got:  # it fits, and a hundredth more does not
        assert sum(c // round(got * 100) for c in cents) >= actors
        assert sum(c // (round(got * 100) + 1) for c in cents) < actors


def test_on_a_cluster_the_actors_reserve_shares_that_fit_on_a_node_and_the_trainer_threads_its_own(tmp_path,
                                                                                                    monkeypatch):
    """Nodes with 1 and 2 CPUs free: the actors reserved 1.5 each (the 3 free split in two), which no node holds,
    and the run stopped after PLACEMENT_TIMEOUT_S; the trainer ran as many torch threads as the cluster had cores."""
    import importlib

    from test_runtime_config import _config

    from dora.runtime import driver

    asked: list = []

    class Placed:
        def wait(self, timeout_seconds):
            return True

    def placement_group(bundles, strategy):
        asked.append(bundles)
        return Placed()

    pg = importlib.import_module("ray.util.placement_group")
    monkeypatch.setattr(pg, "placement_group", placement_group)
    monkeypatch.setattr(pg, "remove_placement_group", lambda group: None)
    built = _joined_cluster(monkeypatch, free=[{"CPU": 1.0}, {"CPU": 2.0}], total={"CPU": 4.0})
    rc = dataclasses.replace(_config("local-tiny"), steps=1, output_dir="run", rollout_workers=1, train_accelerators=4,
                             colocated=False)
    with pytest.raises(AssertionError, match="actors were created"):  # placed: the controller is built
        driver.run_job(rc, live=False, base_dir=tmp_path)
    assert asked == [[{"CPU": 1.0}, {"CPU": 1.0}]] and len(built) == 1
    config = built[0][0]
    assert config.trainer.num_threads == 1  # its 1-CPU share, not the cluster's 3 free or 4 in all
    assert driver.controller_config(rc, cpus=[3.0, 3.0]).trainer.num_threads == 3  # a share of 3, one each
    colocated = dataclasses.replace(rc, colocated=True)  # its engines idle while it trains: a node's cores
    assert driver.controller_config(colocated, cpus=[1.0, 2.0]).trainer.num_threads == 2


def test_a_run_records_the_machine_it_ran_on_in_its_summary(tmp_path, monkeypatch):
    """A run directory recorded nothing about its machine, so `dora calibrate --from-run` named the host it ran on
    instead of the one that made the runs."""
    import importlib
    import os

    from test_runtime_config import _config

    from dora.calibrate import machine_description
    from dora.runtime import controller, driver

    class Ran:
        steps = 1

        def summary(self):
            return {"mode": "sync", "steps": 1, "total_steps": 1}

    class Controller:  # the run itself is the integration tests': here it ends at once, with an empty trace
        def __init__(self, config, **_):
            (config.output_dir / "trace.jsonl").write_text("")

        def run(self):
            return Ran()

    class Placed:
        def wait(self, timeout_seconds):
            return True

    pg = importlib.import_module("ray.util.placement_group")
    monkeypatch.setattr(pg, "placement_group", lambda bundles, strategy: Placed())
    monkeypatch.setattr(pg, "remove_placement_group", lambda group: None)
    _joined_cluster(monkeypatch, free={"CPU": 2.0}, total={"CPU": 2.0})
    monkeypatch.setattr(controller, "Controller", Controller)
    rc = dataclasses.replace(_config("local-tiny"), steps=1, output_dir="run", rollout_workers=1)
    driver.run_job(rc, live=False, base_dir=tmp_path)
    machine = json.loads((tmp_path / "run" / "summary.json").read_text())["summary"]["machine"]
    assert machine == machine_description() and machine["cpu_count"] == os.cpu_count()


def test_one_step_off_does_not_raise_a_staleness_budget_of_zero(tmp_path):
    """--mode one-step-off set a spec's max_version_lag 0 to 1 without a word, while the other asynchronous modes
    are refused for k = 0: it is refused the same way (and a larger budget is still narrowed to one step)."""
    tiny = (REPO / "specs" / "local-tiny.yaml").read_text()
    spec = tmp_path / "k0.yaml"
    spec.write_text(tiny.replace("max_version_lag: 3", "max_version_lag: 0").replace("mode: streaming", "mode: sync")
                    .replace("versions_per_engine: 3", "versions_per_engine: 1"))
    plan_for_apply(str(spec), None, None)  # the spec itself is valid (sync)
    messages = {}
    for mode in ("one-step-off", "bounded-async"):
        with pytest.raises(ApplyInputError) as refused:
            plan_for_apply(str(spec), mode, None)
        messages[mode] = str(refused.value).replace(mode, "MODE")
    assert messages["one-step-off"] == messages["bounded-async"]
    assert "needs a staleness budget k >= 1, got k = 0 (staleness.max_version_lag)" in messages["one-step-off"]
    _, plan = plan_for_apply(str(REPO / "specs" / "local-tiny.yaml"), "one-step-off", None)
    assert plan.mode == "one-step-off" and plan.max_version_lag == 1


def test_a_damaged_warm_up_cache_file_is_a_miss_warmed_up_again_and_overwritten(tmp_path):
    """A cut cache file stopped the run in the trainer's torch.load ("internal error ... a bug in dora")."""
    import torch

    from dora.runtime.engines.tiny_model import TinyModelConfig
    from dora.runtime.engines.torch_trainer import TorchTrainer, TrainerConfig, warm_up
    from dora.runtime.tasks import TaskConfig
    from planner.workload import LengthDistribution

    model = TinyModelConfig(vocab_size=20, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16,
                            ffn_size=64)
    task = TaskConfig(number_tokens=17, warmup_steps=2, warmup_batch_size=4)
    lengths = LengthDistribution.lognormal(median=4, p99=12, max_tokens=16)
    first = TorchTrainer(TrainerConfig(model=model, seed=0))
    assert len(warm_up(first, task, lengths, seed=1, cache_dir=tmp_path)) == 2
    (cached,) = tmp_path.iterdir()
    whole = cached.read_bytes()
    cached.write_bytes(whole[:100])
    notes: list[str] = []
    again = TorchTrainer(TrainerConfig(model=model, seed=0))
    assert len(warm_up(again, task, lengths, seed=1, cache_dir=tmp_path, notes=notes)) == 2
    assert len(notes) == 1 and notes[0].startswith(f"the warm-up cache {cached} is unreadable (")
    assert notes[0].endswith("): warming up again, and overwriting it")
    assert len(cached.read_bytes()) == len(whole)  # whole again: the next run loads it
    loaded = TorchTrainer(TrainerConfig(model=model, seed=0))
    assert warm_up(loaded, task, lengths, seed=1, cache_dir=tmp_path, notes=notes) == [] and len(notes) == 1
    for key, value in first.export_weights()[1].items():
        assert torch.equal(value, loaded.export_weights()[1][key])


def test_a_resumed_runs_summary_counts_regenerations_restarts_and_resumes_of_every_attempt(tmp_path):
    """A resumed attempt's summary gave its own regenerated and restart counts, and an audit-only re-run the whole
    trace's: the same key meant two things. Both now give the whole run's; the restart times, which no trace holds,
    are the attempt's and named so."""
    from dora.runtime.driver import finish_job

    out = tmp_path / "run"
    _finished_run_killed_before_its_end(out, {"mode": "sync"})
    with (out / "trace.jsonl").open("a") as f:  # what two earlier attempts and this one wrote, in short
        f.write("".join(_line(e) for e in [
            {"t": 5.0, "type": "resumed", "step": 1}, {"t": 5.0, "type": "regenerated", "traj": "g9/0", "version": 1},
            {"t": 6.0, "type": "worker_restarted", "rollout_group": 0, "version": 1},
            {"t": 7.0, "type": "resumed", "step": 2}, {"t": 7.0, "type": "regenerated", "traj": "g9/1", "version": 2},
            {"t": 7.0, "type": "regenerated", "traj": "g8/1", "version": 2}]))
    attempt = {"mode": "sync", "steps": 2, "total_steps": 2, "resumed_from_step": 2, "regenerated_trajectories": 2,
               "worker_restarts": 0, "recovery_s": [], "resumed_at_steps": [2]}
    result = finish_job(out, attempt, k=1, allow_version_mixing=False, title="t")
    s = result.summary
    assert (s["regenerated_trajectories"], s["worker_restarts"], s["resumed_at_steps"]) == (3, 1, [1, 2])
    assert s["attempt_recovery_s"] == [] and "recovery_s" not in s
    again = finish_job(out, {"mode": "sync", "steps": 2, "audited_again": True}, k=1, allow_version_mixing=False,
                       title="t", whole_run=True).summary
    assert {k: again[k] for k in ("regenerated_trajectories", "worker_restarts", "resumed_at_steps")} == \
        {k: s[k] for k in ("regenerated_trajectories", "worker_restarts", "resumed_at_steps")}


def test_settling_the_heap_freezes_what_start_up_left_and_still_collects_later_garbage() -> None:
    """A full collection walked every object start-up left (torch, Ray, the model): 16-250 ms pauses in the driver,
    during which it handled nothing and the engine drained (dora.runtime.heap)."""
    import gc

    from dora.runtime.heap import settle_heap

    class Node:
        pass

    try:
        left = Node()
        left.me = left  # a cycle alive at start-up: frozen, never walked again
        frozen = settle_heap()
        assert frozen == gc.get_freeze_count() > 1000
        later = Node()
        later.me = later
        del later
        assert gc.collect() >= 1  # what the run allocates is still collected
    finally:
        gc.unfreeze()
